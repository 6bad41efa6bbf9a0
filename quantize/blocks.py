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

from . import kquants, simple
from .decode import DECODERS
from .formats import BLOCK_SIZES, check_type

Q = gguf.GGMLQuantizationType

FLOAT_ENCODERS = {Q.F32: simple.encode_f32, Q.F16: simple.encode_f16, Q.BF16: simple.encode_bf16}

BLOCK_ENCODERS = {
    Q.Q8_0: simple.encode_q8_0,
    Q.Q4_0: simple.encode_q4_0,
    Q.Q4_1: simple.encode_q4_1,
    Q.Q5_0: simple.encode_q5_0,
    Q.Q5_1: simple.encode_q5_1,
    Q.Q2_K: kquants.encode_q2_k,
    Q.Q3_K: kquants.encode_q3_k,
    Q.Q4_K: kquants.encode_q4_k,
    Q.Q5_K: kquants.encode_q5_k,
    Q.Q6_K: kquants.encode_q6_k,
}

# The K-quants take the imatrix itself; the 32-value formats take llama.cpp's per-row weights.
K_QUANTS = frozenset((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))

# Rows encoded together: bounds the working memory of the searches (a few dozen copies of a chunk).
CHUNK_VALUES = 1 << 22


def quantize_tensor(w: torch.Tensor, qtype: Q, importance: torch.Tensor | None = None) -> np.ndarray:
    """w (rows, cols) float -> uint8 (rows, bytes per row), the standard ggml block layout of qtype.

    importance: (cols,) imatrix-style mean of x^2 per input column, or None.
    """
    check_type(qtype)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(w.shape)}")
    block, nbytes = BLOCK_SIZES[qtype]
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    w = w.detach().float()
    if qtype in FLOAT_ENCODERS:
        return FLOAT_ENCODERS[qtype](w).cpu().numpy()
    if not torch.isfinite(w).all():
        raise ValueError(f"cannot quantize non-finite values to {qtype.name}")
    if importance is not None:
        importance = importance.detach().float().to(w.device).reshape(-1)
        if importance.shape[0] != cols:
            raise ValueError(f"importance has {importance.shape[0]} values for {cols} columns")
    step = max(1, CHUNK_VALUES // cols)
    parts = [encode_rows(w[r:r + step], qtype, importance) for r in range(0, rows, step)]
    return torch.cat(parts).reshape(rows, cols // block * nbytes).cpu().numpy()


def encode_rows(x: torch.Tensor, qtype: Q, importance: torch.Tensor | None) -> torch.Tensor:
    """(rows, cols) -> (rows * blocks per row, bytes per block): the best candidate of each block."""
    block = BLOCK_SIZES[qtype][0]
    xb = x.reshape(-1, block)
    qw = None if importance is None else importance.reshape(1, -1, block).expand(x.shape[0], -1, -1).reshape(-1, block)
    if qtype in K_QUANTS or qw is None:
        weights = qw
    else:
        weights = row_weights(x, importance).reshape(-1, block)
    candidates = BLOCK_ENCODERS[qtype](xb, weights)
    return pick_best(xb, qw, qtype, candidates)


def row_weights(x: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's weights for the 32-value formats: qw * sqrt(sigma2 + x^2), sigma2 = mean of x^2 over the row."""
    sigma2 = (x * x).mean(-1, keepdim=True)
    return importance * torch.sqrt(sigma2 + x * x)


def block_error(xb: torch.Tensor, qw: torch.Tensor | None, qtype: Q, data: torch.Tensor) -> torch.Tensor:
    diff = DECODERS[qtype](data) - xb
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
