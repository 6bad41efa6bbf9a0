"""quantize_tensor: a float tensor -> raw GGUF block bytes of any supported type.

Works on all blocks of a tensor at once, on the tensor's device. Where an encoder offers several
candidate encodings (llama.cpp's reference rule, its imatrix search, ...), each block keeps the
candidate with the least error, measured as the decoded values will be: squared error, weighted per
column by the importance when one is given. So a block is never worse than llama.cpp's own result.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from . import simple_search
from .formats import FORMATS, format_of
from .type_facts import CPP_K_TYPES, encode_threads

Q = gguf.GGMLQuantizationType

# type -> its encoder (each Format's encode): dense types take the tensor, block types (B, block)
# values and weights and give candidate encodings.
FLOAT_ENCODERS = {t: f.encode for t, f in FORMATS.items() if f.dense}
BLOCK_ENCODERS = {t: f.encode for t, f in FORMATS.items() if not f.dense}

# The K-quants take the imatrix itself; the 32-value formats take llama.cpp's per-row weights.
K_QUANTS = frozenset(t for t, f in FORMATS.items() if f.imatrix)
# Types whose encoder (with or without an importance) also runs in C++ (kernels/cpu_encode.cpp, same bytes).
SIMPLE_CPP = frozenset((Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1))

# Rows encoded together: bounds the working memory of the searches (a few dozen copies of a chunk).
CHUNK_VALUES = 1 << 22

def write_threads(values: int, qtype: Q) -> int:
    """The C++ encoders' threads for a whole tensor of `values` values written to qtype: all torch threads
    from type_facts.PARALLEL_MIN_WORK on."""
    return encode_threads(values, qtype, torch.get_num_threads())


def quantize_tensor(w: torch.Tensor, qtype: Q, importance: torch.Tensor | None = None, ext=None,
                    threads: int | None = None) -> np.ndarray:
    """w (rows, cols) float -> uint8 (rows, bytes per row), the standard ggml block layout of qtype.

    importance: (cols,) imatrix-style mean of x^2 per input column, or None; or (G, cols), one per
    group of rows / G consecutive rows: the per-expert imatrix of an expert stack (E, F, cols) quantized
    as its E * F rows, each expert's rows with its own statistics (llama.cpp's llama-quant.cpp passes
    each 3-D slice i its imatrix + i * cols). G = rows gives each row its own.
    threads: the C++ encoders' (ext's) threads; None: torch's thread count.
    """
    fmt = format_of(qtype)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(w.shape)}")
    block, nbytes = fmt.block, fmt.nbytes
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    if ext is not None and (qtype in SIMPLE_CPP or qtype in CPP_K_TYPES):  # on the CPU, wherever w is
        return encode_cpp(w, qtype, importance, ext, threads)
    w = w.detach().float()
    if fmt.dense:
        return fmt.encode(w).cpu().numpy()
    # both extremes finite <=> all finite (amax / amin propagate NaN); ~8x faster than isfinite(w).all()
    if w.numel() and not (torch.isfinite(w.amax()) and torch.isfinite(w.amin())):
        raise ValueError(f"cannot quantize non-finite values to {qtype.name}")
    if importance is not None:
        importance = check_importance(importance.detach().float().to(w.device), rows, cols)
    step = max(1, CHUNK_VALUES // cols)
    parts = [encode_rows(w[r:r + step], qtype, chunk_importance(importance, rows, r, min(r + step, rows)))
             for r in range(0, rows, step)]
    return torch.cat(parts).reshape(rows, cols // block * nbytes).cpu().numpy()


def encode_cpp(w: torch.Tensor, qtype: Q, importance: torch.Tensor | None, ext, threads: int | None) -> np.ndarray:
    """quantize_tensor through the C++ encoders (kernels/cpu_encode.cpp, cpu_kencode.cpp: the same bytes).
    An fp16 w (a GGUF file's F16 tensor) is read as it is: the encoders widen each row to fp32 (exact)
    and check it finite on the way, one pass over the values instead of a float32 copy and two scans."""
    rows, cols = w.shape
    x = w.detach().cpu()
    x = (x if x.dtype in (torch.float32, torch.float16) else x.float()).contiguous()
    qw = torch.empty(0)
    if importance is not None:
        qw = check_importance(importance.detach().float().cpu(), rows, cols)
        if qw.dim() == 2:  # (G, cols): each group's row for each of its rows / G rows
            qw = qw.repeat_interleave(rows // qw.shape[0], dim=0)
        qw = qw.contiguous()
    threads = torch.get_num_threads() if threads is None else threads
    try:
        if qtype in SIMPLE_CPP:
            return ext.encode_simple(x, int(qtype), qw, threads).numpy()
        return ext.kquant_encode(x, int(qtype), format_of(qtype).nbytes, qw, threads).numpy()
    except ValueError:  # the encoders found a NaN or Inf
        raise ValueError(f"cannot quantize non-finite values to {qtype.name}") from None


def check_importance(importance: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(cols,) or (G, cols) with rows % G == 0 (a 1-D one, or (1, cols), comes back as (cols,))."""
    if importance.dim() == 2 and importance.shape[0] > 1:
        groups = importance.shape[0]
        if importance.shape[1] != cols or rows % groups:
            raise ValueError(f"importance of shape {tuple(importance.shape)} for {rows} rows of {cols} columns "
                             f"(want ({cols},) or (groups, {cols}) with groups dividing the rows)")
        return importance
    importance = importance.reshape(-1)
    if importance.shape[0] != cols:
        raise ValueError(f"importance has {importance.shape[0]} values for {cols} columns")
    return importance


def chunk_importance(importance: torch.Tensor | None, rows: int, r0: int, r1: int) -> torch.Tensor | None:
    """The importance of rows r0 .. r1: (cols,) as given, or (r1 - r0, cols), each row its group's."""
    if importance is None or importance.dim() == 1:
        return importance
    per_group = rows // importance.shape[0]
    return importance[torch.arange(r0, r1, device=importance.device) // per_group]


def encode_rows(x: torch.Tensor, qtype: Q, importance: torch.Tensor | None) -> torch.Tensor:
    """(rows, cols) -> (rows * blocks per row, bytes per block): the best candidate of each block.

    importance: (cols,) for all rows, (rows, cols) per row, or None."""
    fmt = FORMATS[qtype]
    block = fmt.block
    xb = x.reshape(-1, block)
    qw = None if importance is None else importance.expand(x.shape).reshape(-1, block)
    if fmt.imatrix or qw is None:
        weights = qw
    else:
        weights = row_weights(x, importance).reshape(-1, block)
    candidates = fmt.encode(xb, weights)
    return pick_best(xb, qw, qtype, candidates)


def row_weights(x: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's weights for the 32-value formats: qw * sqrt(sigma2 + x^2), sigma2 = mean of x^2 over
    the row (summed in order, as kernels/cpu_encode.cpp: simple_search.row_weights)."""
    return simple_search.row_weights(x, importance)


def block_error(xb: torch.Tensor, qw: torch.Tensor | None, qtype: Q, data: torch.Tensor) -> torch.Tensor:
    if qtype in SIMPLE_CPP:  # summed in order, as kernels/cpu_encode.cpp picks
        return simple_search.block_error(FORMATS[qtype].decode(data), xb, qw)
    diff = FORMATS[qtype].decode(data) - xb
    err = diff * diff if qw is None else qw * diff * diff
    return torch.nan_to_num(err.sum(-1), nan=float("inf"))


def pick_best(xb: torch.Tensor, qw: torch.Tensor | None, qtype: Q, candidates: list[torch.Tensor]) -> torch.Tensor:
    """Per block, the candidate whose decoded values have the least (weighted) squared error; the first on ties."""
    if len(candidates) == 1:  # nothing to choose (e.g. Q4_0 without an imatrix): skip decoding it
        return candidates[0]
    best, best_err = candidates[0], block_error(xb, qw, qtype, candidates[0])
    for data in candidates[1:]:
        err = block_error(xb, qw, qtype, data)
        better = err < best_err
        best = torch.where(better.unsqueeze(-1), data, best)
        best_err = torch.where(better, err, best_err)
    return best
