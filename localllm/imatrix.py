"""The importance matrix (llama.cpp's imatrix): per weight matrix the mean of x_j^2 over the calibration
tokens of each input column j of the matmul it takes part in (localllm/calibrate.py says what it
measures), collected by forward hooks; saved and read in llama.cpp's files (imatrix_files.py) and
localllm's own older torch format.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .calibrate import Progress, device_cache, model_tensors
from .fused import file_imatrix
from .imatrix_files import (ImatrixStats, fit_shapes, read_dat_imatrix, read_gguf_imatrix, write_dat_imatrix,
                            write_gguf_imatrix)
from .model import Linear, Transformer, moe_mlp
from .moe import ExpertLinear
from .weights import ROPE_BUFFERS, gguf_name

IMATRIX_FORMAT = "localllm-imatrix"
IMATRIX_VERSION = 1


@contextmanager
def recording_imatrix(model: Transformer, dataset: str = "") -> Iterator[Callable[[Sequence[Sequence[int]]], ImatrixStats]]:
    """While open, every forward pass of `model` adds to the imatrix statistics (collect_imatrix_stats'),
    with or without autograd (mixed.plan_mixed records them during its Fisher passes: no forward of its
    own). Yields stats(chunks): the statistics so far, of those chunks (their count and size). The
    model's mixture-of-experts layers must run the reference MoE forward (TORCH_OPS: each expert's
    ExpertLinear, whose inputs the hooks record; a backend's grouped products would leave them out)."""
    if any(b.moe is not None and b.ops.moe is not moe_mlp for b in model.blk):
        raise ValueError("imatrix statistics need the reference mixture-of-experts forward: load the model "
                         "with the portable backend (load_model(..., backend=Runtime))")
    sums: dict[str, torch.Tensor] = {}  # name -> (in,) or (E, in) float64 sum of x^2 over tokens
    counts: dict[str, int | torch.Tensor] = {}  # tokens seen: int, or (E,) float64 per expert
    memo: list = [None, None]  # (last input, its sums): q/k/v and gate/up read the very same tensor

    def square_sums(x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) -> sum over tokens of x^2 (in,) in float64 (fp32 per call, exact enough for a mean).
        if memo[0] is not x:
            memo[:] = [x, x.detach().float().pow(2).reshape(-1, x.shape[-1]).sum(0).double()]
        return memo[1]

    def record(name: str, x: torch.Tensor) -> None:
        sums[name] = sums[name] + square_sums(x) if name in sums else square_sums(x).clone()
        counts[name] = counts.get(name, 0) + x.numel() // x.shape[-1]

    def record_expert(mod: ExpertLinear, name: str, x: torch.Tensor, expert: int) -> None:
        # ExpertLinear.forward(x (n, in), expert): the n tokens routed to this expert
        if name not in sums:
            sums[name] = torch.zeros(mod.n_experts, x.shape[-1], dtype=torch.float64, device=x.device)
            counts[name] = torch.zeros(mod.n_experts, dtype=torch.float64, device=x.device)
        sums[name][expert] += square_sums(x)
        counts[name][expert] += x.numel() // x.shape[-1]

    def stats(chunks: Sequence[Sequence[int]]) -> ImatrixStats:
        s = {k: v.cpu().reshape(-1, v.shape[-1]) for k, v in sums.items()}
        c = {k: torch.as_tensor(v, dtype=torch.float64).cpu().reshape(-1) for k, v in counts.items()}
        return ImatrixStats(file_imatrix(model.cfg, s), file_imatrix(model.cfg, c), len(chunks),
                            max(len(ch) for ch in chunks), [dataset] if dataset else [])

    hooks = [m.register_forward_pre_hook(lambda mod, args, name=gguf_name(n) + ".weight": record(name, args[0]))
             for n, m in model.named_modules() if isinstance(m, Linear)]
    hooks += [m.register_forward_pre_hook(lambda mod, args, name=gguf_name(n) + ".weight": record_expert(mod, name, *args))
              for n, m in model.named_modules() if isinstance(m, ExpertLinear)]
    # The output matmul runs inside Transformer.forward (kernels.linear): its input is output_norm's output.
    out_name = "token_embd.weight" if model.cfg.tied_output else "output.weight"  # the tensor it reads
    hooks.append(model.output_norm.register_forward_hook(lambda mod, args, out: record(out_name, out)))
    try:
        yield stats
    finally:
        for h in hooks:
            h.remove()
        memo.clear()


@torch.inference_mode()
def collect_imatrix_stats(model: Transformer, chunks: Sequence[Sequence[int]], progress: Progress | None = None,
                          dataset: str = "") -> ImatrixStats:
    """The raw statistics behind collect_imatrix, as llama-imatrix keeps them: per GGUF weight name the
    float64 sums of x_j^2 over the tokens (1, in) (an expert stack (E, in), row e over the tokens routed
    to expert e, as llama.cpp's MUL_MAT_ID statistics) and the tokens summed (1,) (or (E,)); with the
    chunk count and size, and `dataset` as the file's dataset name (imatrix_files writes them)."""
    with recording_imatrix(model, dataset) as stats:
        cache = device_cache(model, max(len(c) for c in chunks))
        for i, chunk in enumerate(chunks):
            model(torch.tensor([list(chunk)], device=model.output_norm.weight.device), cache, 0)
            if progress:
                progress("imatrix", i + 1, len(chunks))
        return stats(chunks)


def collect_imatrix(model: Transformer, chunks: Sequence[Sequence[int]], progress: Progress | None = None
                    ) -> dict[str, torch.Tensor]:
    """GGUF weight name -> (in_features,) fp32 mean of x_j^2 over all tokens of all chunks, where x is
    the input of the matmul that weight takes part in (one forward pass per chunk).

    Expert stacks (E, out, in) (moe.ExpertLinear) get (E, in): row e the mean over the tokens routed to
    expert e, as llama.cpp's imatrix keeps its MUL_MAT_ID statistics (in_sum2 (E, in), counts (E,));
    an expert no token reached gets 1 in every column, as llama-quantize reads a zero count."""
    return collect_imatrix_stats(model, chunks, progress).means()


def save_imatrix(path: str | Path, stats: ImatrixStats) -> Path:
    """Write stats in llama.cpp's format, as llama-imatrix does: the GGUF imatrix, or its legacy .dat
    when PATH ends in .dat (written whole or not at all). llama-quantize --imatrix reads either."""
    if str(path).endswith(".dat"):
        return write_dat_imatrix(path, stats)
    return write_gguf_imatrix(path, stats)


def load_imatrix(path: str | Path, model: Transformer | Mapping[str, Sequence[int]] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (name -> fp32 means as llama-quantize computes them from the file, meta with chunks (and
    chunk_size, datasets; tensors for our own older files)). Reads llama.cpp's GGUF imatrix and legacy
    .dat and localllm's own torch format. With a model (or its name -> shape mapping), a file whose
    entries are not this model's weights, or do not fit their shapes, is a ValueError."""
    if not Path(path).is_file():
        raise ValueError(f"imatrix file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        stats = read_gguf_imatrix(path)
        values, meta = stats.means(), {"chunks": stats.chunk_count, "chunk_size": stats.chunk_size,
                                       "datasets": stats.datasets}
    elif head.startswith(b"PK"):  # torch.save's zip: our own format, version 1
        values, meta = _load_torch_imatrix(path)
    else:
        values, chunks, datasets = read_dat_imatrix(path)
        meta = {"chunks": chunks, "datasets": datasets}
    if model is not None:
        expected = model_tensors(model) if isinstance(model, Transformer) else {k: tuple(v) for k, v in model.items()}
        values = fit_shapes(values, expected)
        if "tensors" in meta and (problem := _mismatch(meta["tensors"], expected)):
            raise ValueError(f"{path} was collected on a different model ({len(meta['tensors'])} tensors) than "
                             f"this one ({len(expected)} tensors): {problem}")
        if unknown := sorted(set(values) - set(expected)):
            raise ValueError(f"{path} was collected on a different model: it has {unknown[0]!r}, the model does not")
        if problem := _bad_value(values, expected):
            raise ValueError(f"{path} was collected on a different model: {problem}")
    return values, meta


def _load_torch_imatrix(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """localllm's own format (torch.save of {format, version, chunks, tensors, meta, imatrix})."""
    try:
        d = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:  # torch.load raises many kinds on foreign files
        d = None
    if not isinstance(d, dict) or d.get("format") != IMATRIX_FORMAT:
        raise ValueError(f"{path} is not an imatrix file (GGUF, llama.cpp's .dat or localllm's)")
    if d.get("version") != IMATRIX_VERSION:
        raise ValueError(f"{path} has imatrix format version {d.get('version')}, this localllm reads {IMATRIX_VERSION}")
    saved = {k: tuple(v) for k, v in d["tensors"].items()}
    return dict(d["imatrix"]), {**d["meta"], "chunks": d["chunks"], "tensors": saved}


def _bad_value(imatrix: dict, shapes: dict) -> str:
    """The first imatrix entry that is no tensor or not of its weight's shape: (cols,) for a matrix,
    (E, cols) or (cols,) for an expert stack (E, F, cols); '' when all fit."""
    if not isinstance(imatrix, dict):
        return "no imatrix entries"
    for name, v in imatrix.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        fits = [(shape[-1],)] + ([(shape[0], shape[-1])] if len(shape) == 3 else [])
        if not isinstance(v, torch.Tensor) or tuple(v.shape) not in fits:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return f"the entry of {name!r} has shape {got}, its weight {shape} takes {' or '.join(map(str, fits))}"
    return ""


def _mismatch(saved: dict, expected: dict) -> str:
    """The first difference between two name -> shape tables, or ''."""
    saved, expected = ({k: v for k, v in t.items() if not k.startswith(ROPE_BUFFERS)} for t in (saved, expected))
    for name in sorted(set(saved) | set(expected)):
        if name not in expected:
            return f"the file has {name!r}, the model does not"
        if name not in saved:
            return f"the model has {name!r}, the file does not"
        if saved[name] != expected[name]:
            return f"{name!r} has shape {saved[name]} in the file, {expected[name]} in the model"
    return ""
