"""`--target-bpw` / `--target-size`: choose a GGUF type per tensor from measured sensitivity.

For every quantizable tensor t and candidate type q we predict L(t, q), the KL-divergence the model's
output gains when t is stored as q, and let quantize/allocate.py pick the types with the least total
predicted loss that fit the size budget:
1. imatrix: mean x^2 per input column of every matrix over the calibration chunks
   (localllm/imatrix.py), recorded in the Fisher passes' forwards; the encoders use it for
   importance-weighted rounding.
2. Fisher: for small weight errors dW, KL(p || p_dW) ~ 1/2 dW^T F dW with F the Fisher information of
   the output distribution; we keep its diagonal, estimated as E[(d log p(y) / dW)^2] with y sampled
   from the model itself, over the calibration chunks (one backward pass per chunk for all tensors),
   kept only on the rows that step 3 samples (localllm/fisher.py: each gradient squared into them as
   backward produces it, then dropped; an 8B model's whole fp32 diagonal would be 32 GB).
3. candidates: every type whose block fits the row length, round-tripped (with the imatrix) on a
   sample of rows; L(t, q) = 1/2 sum F_ij dW_ij^2 over the sampled rows, scaled to all rows.
A mixture of experts' stack (E, F, C) (GGUF blk.N.ffn_*_exps.weight, module blk.N.moe.*) is one tensor
of one type, as llama.cpp quantizes it: its E * F rows of C values are a 2-D weight's rows here (the
candidates by C, the Fisher of each expert's slice from the tokens routed to it), and each row is
rounded with its own expert's imatrix row (imatrix.collect_imatrix's (E, C)).
Measuring each tensor's KL with a probe (sensitivity.measure_sensitivity) predicts as well but costs half
a forward pass per tensor (~10 minutes for the default model on 2 cores), the Fisher a few seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import gguf
import torch

from localllm.kernels.cpu import load_extension
from localllm.quantize.allocate import Option, allocate
from localllm.quantize.formats import BLOCK_SIZES
from localllm.quantize.plan import TensorInfo, sample_rows
from localllm.quantize.presets import LAST_RESORT, allows_quantization

from .calibrate import roundtrip
from .imatrix import recording_imatrix
from .errors import LocalLLMError
from .fisher import fisher_diagonal, fisher_rows, layerwise_cache as _layerwise_cache  # noqa: F401 (tests)
from .fused import fused_parts
from .load import LoadedModel
from .settings import DEFAULT_CPU
from .weights import to_module_name

Q = gguf.GGMLQuantizationType
CANDIDATES = (Q.Q2_K, Q.Q3_K, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)
SAMPLE_ROWS = 64
CALIB_CTX, CALIB_CHUNKS = 256, 4


@dataclass(frozen=True)
class MixedPlan:
    choices: list[Q | None]  # per source tensor, None: kept as stored
    predicted_kl: float  # sum of the chosen types' predicted losses
    imatrix: dict[str, torch.Tensor]
    n_chunks: int  # calibration chunks the imatrix and sensitivities were measured on
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds (fisher[+imatrix], errors, search)


def candidates(cols: int) -> list[Q]:
    return [q for q in CANDIDATES if cols % BLOCK_SIZES[q][0] == 0]


def options_of(t: TensorInfo) -> list[Q]:
    """A tensor's types to choose from: the candidates of its rows, and its stored type where that is a
    block type outside them (gpt-oss's MXFP4 experts): kept as stored, the file copies its blocks and
    the model loses nothing (loss 0), instead of re-rounding MXFP4 values to another 4-bit type."""
    types = candidates(t.shape[-1])
    keep = t.source not in (Q.F32, Q.F16, Q.BF16) and t.source not in CANDIDATES and t.source in BLOCK_SIZES
    return types + [t.source] if keep and types and t.shape[-1] % BLOCK_SIZES[t.source][0] == 0 else types


def type_bytes(n_values: int, q: Q) -> int:
    block, size = BLOCK_SIZES[q]
    return n_values // block * size


def padded(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def sampled_losses(w: torch.Tensor, f: torch.Tensor, imp: torch.Tensor | None, types: Sequence[Q],
                   ext=None) -> dict[Q, float]:
    """1/2 sum F_ij dW_ij^2 of each type's round trip, over SAMPLE_ROWS rows, scaled to all rows.

    w, f: (out, in) weight and its Fisher diagonal; imp: (in,) imatrix for the rounding, or None, or
    (G, in) for groups of out / G rows (an expert stack's rows, one imatrix row per expert). ext: the
    C++ encoders (kernels/cpu.py load_extension: on the CPU, wherever w is), or None."""
    rows = sample_rows(w.shape[0], SAMPLE_ROWS).to(w.device)
    return row_losses(w[rows], f[rows], group_importance(imp, rows, w.shape[0]), types, w.shape[0], ext)


def row_losses(ws: torch.Tensor, fs: torch.Tensor, imp: torch.Tensor | None, types: Sequence[Q], n_rows: int,
               ext=None) -> dict[Q, float]:
    """sampled_losses of the sampled rows alone: ws, fs (k, in) a tensor's rows sample_rows(n_rows, k)
    of its weight and Fisher; imp: (in,), or (k, in) each row's own (group_importance), or None."""
    ws, fs = ws.float(), fs.double()
    scale = n_rows / ws.shape[0]
    return {q: 0.5 * scale * float((fs * (roundtrip(ws, q, imp, ext) - ws).double().pow(2)).sum()) for q in types}


def group_importance(imp: torch.Tensor | None, rows: torch.Tensor, n_rows: int) -> torch.Tensor | None:
    """imp as row_losses takes it for rows `rows` of n_rows: a (G, in) imatrix of G row groups (an expert
    stack's experts) -> each row's group's (k, in); (in,), (1, in) or None unchanged."""
    if imp is not None and imp.dim() == 2 and imp.shape[0] > 1:
        return imp.to(rows.device)[rows // (n_rows // imp.shape[0])]
    return imp


def sampled_parts(params: Mapping[str, torch.Tensor], names: Sequence[str], cols: int
                  ) -> tuple[int, torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A file tensor made of the parameters `names` (one, or a fused tensor's parts in row order; each
    as its (-1, cols) rows) -> (its row count n, its rows sample_rows(n, SAMPLE_ROWS), and per part
    (name, the part's own indices of the sampled rows that fall in it)): the rows of the concatenation
    without concatenating."""
    sizes = [params[n].numel() // cols for n in names]
    rows = sample_rows(sum(sizes), SAMPLE_ROWS)
    parts, start = [], 0
    for n, size in zip(names, sizes):
        inside = rows[(rows >= start) & (rows < start + size)] - start
        parts.append((n, inside))
        start += size
    return sum(sizes), rows, parts


def fisher_wanted(parts: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """(parameter name, row indices) pairs -> name -> the sorted union of its indices: the rows whose
    Fisher is kept (a parameter may back two file tensors: a tied token_embd / output)."""
    out: dict[str, torch.Tensor] = {}
    for name, r in parts:
        out[name] = torch.cat([out[name], r]).unique() if name in out else r.unique()
    return out


def chosen_and_fixed(tensors: Sequence[TensorInfo], fixed: Mapping[str, Q] | None
                     ) -> tuple[list[TensorInfo], dict[str, Q]]:
    """(the tensors whose type the allocator chooses, name -> type of those whose type is set).

    fixed: the --tensor-type overrides; rows that split into no candidate's blocks take the presets'
    last resort too (an allocation over no option would fail as "target too small")."""
    last_resort = {t.name: LAST_RESORT for t in tensors
                   if allows_quantization(t.name, len(t.shape)) and not candidates(t.shape[-1])}
    fixed = {**last_resort, **(fixed or {})}
    todo = [t for t in tensors if allows_quantization(t.name, len(t.shape)) and t.name not in fixed]
    return todo, fixed


def kept_bytes(tensors: Sequence[TensorInfo], todo: Sequence[TensorInfo], fixed: Mapping[str, Q], align: int) -> int:
    """Bytes of the tensors the allocator does not choose for: their fixed type, else as stored."""
    return sum(padded(type_bytes(math.prod(t.shape), fixed.get(t.name, t.source)), align)
               for t in tensors if t not in todo)


def size_range(tensors: Sequence[TensorInfo], align: int = 1, fixed: Mapping[str, Q] | None = None) -> tuple[int, int]:
    """(smallest, largest) total bytes any plan_mixed choice can give: checked before calibrating."""
    todo, fixed = chosen_and_fixed(tensors, fixed)
    kept = kept_bytes(tensors, todo, fixed, align)
    sizes = [[padded(type_bytes(math.prod(t.shape), q), align) for q in options_of(t)] for t in todo]
    return kept + sum(min(s) for s in sizes), kept + sum(max(s) for s in sizes)


def plan_mixed(
    lm: LoadedModel,
    tensors: Sequence[TensorInfo],
    budget: int,
    chunks: Sequence[Sequence[int]],
    imatrix: Mapping[str, torch.Tensor] | None = None,
    progress: Callable[[str, int, int], None] = lambda stage, done, total: None,
    align: int = 1,
    fixed: Mapping[str, Q] | None = None,
) -> MixedPlan:
    """Types for `tensors` (the source file's, in order) whose total bytes stay within `budget`.

    chunks: the calibration chunks (calibrate.calibration_chunks, CALIB_CTX and CALIB_CHUNKS).
    align: each tensor's bytes count rounded up to a multiple of it (a file budget: GGUF pads every
    tensor's data to the alignment; 1 for a bits-per-weight budget). fixed: name -> type of tensors
    whose type is already set (--tensor-type overrides): their bytes are taken off the budget."""
    todo, fixed = chosen_and_fixed(tensors, fixed)
    model = lm.model
    params = dict(model.named_parameters())
    # each chosen tensor's sampled rows, per module parameter (a fused tensor's parts, in row order)
    sampled = [sampled_parts(params, [_module_name(params, n) for n in fused_parts(lm.config, t.name)], t.shape[-1])
               for t in todo]
    wanted = fisher_wanted(part for _, _, parts in sampled for part in parts)
    seconds, mark = {}, time.perf_counter()
    fisher_progress = lambda done, total: progress("fisher", done, total)  # noqa: E731
    if imatrix is not None:
        imat = dict(imatrix)
        fisher = fisher_rows(model, chunks, wanted, fisher_progress)
        seconds["fisher"] = time.perf_counter() - mark
    else:  # the imatrix recorded in the Fisher passes' forwards: no forward of its own
        with recording_imatrix(model) as stats:
            fisher = fisher_rows(model, chunks, wanted, fisher_progress)
        imat = stats(chunks).means()
        seconds["fisher+imatrix"] = time.perf_counter() - mark
    mark = time.perf_counter()
    # the C++ encoders on the CPU whatever the model's device (the same bytes, tests/test_cpu_encode.py):
    # on a GPU the torch encoders' C-order searches dispatch 20k-135k kernels per 64-row round trip
    # (counted on the CPU), minutes over an 8B model's 226 x 10 candidates; C++: a few seconds
    ext = load_extension(DEFAULT_CPU.cache_dir)
    options = []
    for i, (t, (n_rows, rows, parts)) in enumerate(zip(todo, sampled)):
        cols = t.shape[-1]  # an expert stack (E, F, C) as its E * F rows
        w = torch.cat([params[n].data.reshape(-1, cols)[r.to(params[n].device)] for n, r in parts])
        f = torch.cat([fisher[n][torch.searchsorted(wanted[n], r).to(fisher[n].device)] for n, r in parts])
        types, rounded = options_of(t), candidates(t.shape[-1])
        imp = group_importance(imat.get(t.name), rows.to(w.device), n_rows)
        loss = row_losses(w, f, imp, rounded, n_rows, ext) | {q: 0.0 for q in types if q not in rounded}
        n = math.prod(t.shape)
        options.append([Option(q, padded(type_bytes(n, q), align), loss[q]) for q in types])
        progress("errors", i + 1, len(todo))
    seconds["errors"], mark = time.perf_counter() - mark, time.perf_counter()
    kept = kept_bytes(tensors, todo, fixed, align)
    try:
        picked = allocate(options, budget - kept)
    except ValueError as e:
        raise LocalLLMError(f"target too small: {e}") from None
    chosen = {t.name: options[i][k].qtype for i, (t, k) in enumerate(zip(todo, picked))}
    predicted = sum(options[i][k].loss for i, k in enumerate(picked))
    seconds["search"] = time.perf_counter() - mark
    return MixedPlan([chosen.get(t.name, fixed.get(t.name)) for t in tensors], predicted, imat, len(chunks), seconds)


def _module_name(params: Mapping[str, torch.nn.Parameter], gguf_name: str) -> str:
    """The model parameter holding a GGUF tensor (q/k rows may be permuted: per-row errors do not care)."""
    name = to_module_name(gguf_name)
    return "token_embd.weight" if name not in params and gguf_name == "output.weight" else name
