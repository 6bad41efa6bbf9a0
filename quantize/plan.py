"""A quantization plan: one row per tensor, in the file's order (name, shape, stored type, chosen type,
bits per weight).

Any policy that picks a type per tensor makes a plan (`make_plan(tensors, choices)`): the presets
(presets.py) now, a bits-per-weight or size target later. `--tensor-type REGEX=TYPE` overrides and the
row-length fallback apply on top of every policy, as in llama-quantize: the first pattern that is
found in a tensor's name (re.search, as std::regex_search) sets its type, never-quantized tensors
(norms, 1-D) excepted. Two deviations: llama.cpp leaves an overridden attn_v/ffn_down out of its layer
counters, which shifts the preset's choices for later layers (here the preset's choices do not
depend on the overrides), and it ignores overrides under the float presets (F32/F16/BF16), where
they apply here.

`measure_errors` predicts each tensor's error (relative RMSE, ||decoded - w|| / ||w||) by quantizing
a sample of its rows and decoding them; `plan_table` shows it all as a rich table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from typing import TYPE_CHECKING

import gguf
from rich.table import Table

from .type_facts import BLOCK_SIZES, SUPPORTED_TYPES, bits_per_weight
from .presets import ModelShape, Preset, fallback, preset_types

if TYPE_CHECKING:
    import torch

# torch (and the encoders) are imported by the error measurement only: a plan is made without them
# (`localllm quantize`'s torch-free preset path, commands/quantize_native.py).

Q = gguf.GGMLQuantizationType


class PlanError(ValueError):
    """A bad --tensor-type or type name (the caller turns it into a user error)."""


@dataclass(frozen=True)
class TensorInfo:
    """What a plan needs of a source tensor."""

    name: str
    shape: tuple[int, ...]  # numpy order: (..., cols)
    source: Q  # stored type


@dataclass(frozen=True)
class PlanRow:
    name: str
    shape: tuple[int, ...]  # numpy order: (..., cols)
    source: Q
    target: Q
    note: str = ""  # "kept", "override", "fallback from Q4_K"

    @property
    def n_values(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        block, size = BLOCK_SIZES[self.target]
        return self.n_values // block * size

    @property
    def bits(self) -> float:
        return bits_per_weight(self.target)

    @property
    def source_nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.source]
        return self.n_values // block * size


@dataclass(frozen=True)
class Override:
    text: str  # as given: REGEX=TYPE
    pattern: re.Pattern
    type: Q


def parse_type(name: str) -> Q:
    """A tensor type by name, case-insensitive (q4_k, Q8_0, f16)."""
    t = Q.__members__.get(name.strip().upper())
    if t is None or t not in SUPPORTED_TYPES:
        known = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise PlanError(f"unknown tensor type {name!r} (types: {known})")
    return t


def parse_override(text: str) -> Override:
    """REGEX=TYPE; the pattern is lower-cased, as llama-quantize does."""
    pattern, sep, type_name = text.rpartition("=")
    if not sep or not pattern:
        raise PlanError(f"--tensor-type wants REGEX=TYPE, got {text!r}")
    try:
        compiled = re.compile(pattern.lower())
    except re.error as e:
        raise PlanError(f"bad pattern in --tensor-type {text!r}: {e}") from None
    return Override(text, compiled, parse_type(type_name))


def make_plan(tensors: Sequence[TensorInfo], choices: Sequence[Q | None],
              overrides: Sequence[Override] = ()) -> list[PlanRow]:
    """choices: a policy's type per tensor, None where the tensor is never quantized (it is kept)."""
    rows = []
    for t, choice in zip(tensors, choices, strict=True):
        if choice is None:
            rows.append(PlanRow(t.name, t.shape, t.source, t.source, "kept"))
            continue
        note = ""
        hit = next((o for o in overrides if o.pattern.search(t.name)), None)
        if hit is not None:
            choice, note = hit.type, f"override {hit.text}"
        target = fallback(choice, t.shape[-1])
        if target != choice:
            note = f"fallback from {choice.name}" + (f" ({note})" if note else "")
        rows.append(PlanRow(t.name, t.shape, t.source, target, note))
    return rows


def preset_plan(preset: Preset, tensors: Sequence[TensorInfo], model: ModelShape,
                overrides: Sequence[Override] = (), imatrix: bool = False) -> list[PlanRow]:
    choices = preset_types(preset, [(t.name, t.shape) for t in tensors], model, imatrix)
    return make_plan(tensors, choices, overrides)


def total_bytes(rows: Sequence[PlanRow]) -> int:
    return sum(r.nbytes for r in rows)


def total_bpw(rows: Sequence[PlanRow]) -> float:
    values = sum(r.n_values for r in rows)
    return 8 * total_bytes(rows) / values if values else 0.0


# ---- predicted error

def sample_rows(n_rows: int, k: int) -> torch.Tensor:
    """Up to k row indices spread evenly over the tensor (first and last included)."""
    import torch

    return torch.linspace(0, n_rows - 1, min(k, n_rows)).round().long().unique()


def relative_rmse(w: torch.Tensor, target: Q, device: str = "cpu") -> float:
    """||decode(encode(w)) - w|| / ||w|| for w (rows, cols) float32."""
    import torch

    from .blocks import quantize_tensor
    from .decode import dequantize_torch

    w = w.to(device=device, dtype=torch.float32)
    back = dequantize_torch(quantize_tensor(w, target), target).to(w.device)
    norm = torch.linalg.vector_norm(w).item()
    return torch.linalg.vector_norm(back - w).item() / norm if norm > 0 else 0.0


def measure_errors(rows: Sequence[PlanRow], read_rows: Callable[[str, torch.Tensor], torch.Tensor],
                   k: int = 16, device: str = "cpu") -> list[float]:
    """Each tensor's predicted relative RMSE against its stored values, from k sampled rows.

    read_rows(name, row indices) -> those rows as float32 (n, cols). Copied tensors (kept, or
    already of the chosen type) and F32 targets are exact: 0."""
    out = []
    for r in rows:
        if r.target == r.source or r.target == Q.F32:
            out.append(0.0)
            continue
        n_rows = r.n_values // r.shape[-1]
        w = read_rows(r.name, sample_rows(n_rows, k))
        out.append(relative_rmse(w.reshape(-1, r.shape[-1]), r.target, device))
    return out


# ---- the --dry-run table

MIB = 2**20


def gguf_shape(shape: tuple[int, ...]) -> str:
    """Numpy order -> GGUF's ne order, as llama-quantize prints it: [cols, rows]."""
    return "[" + ", ".join(str(d) for d in reversed(shape)) + "]"


def plan_table(rows: Sequence[PlanRow], errors: Sequence[float] | None = None, title: str | None = None) -> Table:
    table = Table(title=title, show_footer=True, box=None, pad_edge=False)
    src_mib = sum(r.source_nbytes for r in rows) / MIB
    table.add_column("tensor", footer=f"total ({len(rows)} tensors)", overflow="fold")
    table.add_column("shape", footer="")
    table.add_column("from", footer=f"{src_mib:.2f} MiB")
    table.add_column("type", footer="")
    table.add_column("bits/weight", justify="right", footer=f"{total_bpw(rows):.4f}")
    table.add_column("MiB", justify="right", footer=f"{total_bytes(rows) / MIB:.2f}")
    if errors is not None:
        values = sum(r.n_values for r in rows)
        # the values-weighted root mean square of the per-tensor relative errors
        mean = math.sqrt(sum(e * e * r.n_values for e, r in zip(errors, rows)) / values) if values else 0.0
        table.add_column("rel. RMSE", justify="right", footer=f"{mean:.4f}")
    table.add_column("note", footer="", overflow="fold")
    for i, r in enumerate(rows):
        cells = [r.name, gguf_shape(r.shape), r.source.name, r.target.name, f"{r.bits:.4g}", f"{r.nbytes / MIB:.3f}"]
        if errors is not None:
            cells.append(f"{errors[i]:.4f}")
        table.add_row(*cells, r.note)
    return table
