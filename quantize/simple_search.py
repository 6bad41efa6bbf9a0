"""The imatrix searches of the 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in C's arithmetic order.

ggml-quants.c's quantize_row_q4_0_impl .. q5_1_impl run make_qx_quants (symmetric) and make_qkx2-style
fits (affine: ksearch.make_qkx, shared with the K-quants) on each block with per-value weights; here the
same searches run on all blocks (B, 32) at once, every float computed as the C loops compute it: each sum a sequential loop over the 32
values (seq_sum), each product left to right, float32 constants, correctly rounded divisions and
square roots. kernels/cpu_encode.cpp does the same per block; the bytes agree (tests/test_cpu_encode.py).
nearest_int rounds half to even, as torch.round does.
"""

from __future__ import annotations

import numpy as np
import torch

from .ksearch import GROUP_MAX_EPS, f32, rdiv, seq_sum, sqrtf  # noqa: F401  (C-order arithmetic, shared)

QX_STEPS = (0, -9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9)  # make_qx_quants' order


def row_weights(x: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """x (R, C), importance (C,) or (R, C) -> (R, C): qw * sqrtf(sigma2 + x^2), sigma2 = (sum of x^2 over
    the row, in order) / C, as quantize_row_q4_0_impl .. q5_1_impl."""
    sigma2 = seq_sum(x * x) / x.shape[-1]
    return importance * sqrtf(sigma2 + x * x)


def qx_scale(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """make_qx_quants(n, nmax, x, L, rmse_type 1, w): the scale (B, 1) of x ~ scale * q, q in
    [-nmax, nmax - 1]: iscale = -(nmax + 0.1f is) / max over QX_STEPS, kept when sumlx^2 / suml2 grows."""
    xmax = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))  # the first value of largest |x|
    live = xmax.abs() >= GROUP_MAX_EPS
    xmax = torch.where(live, xmax, 1.0)
    scale = best = None
    for k in QX_STEPS:
        c = f32(np.float32(nmax) + np.float32(0.1) * np.float32(k)) if k else float(nmax)
        q = torch.round(rdiv(-c, xmax) * x).clamp(-nmax, nmax - 1)
        wq = w * q
        sumlx, suml2 = seq_sum(w * x * q), seq_sum(wq * q)
        if scale is None:
            scale = torch.where(suml2 != 0, sumlx / suml2, 0.0)
            best = scale * sumlx
            continue
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        this = sumlx / suml2
        scale = torch.where(better, this, scale)
        best = torch.where(better, this * sumlx, best)
    return torch.where(live, scale, 0.0)


def block_error(decoded: torch.Tensor, x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """(B, 32) -> (B,): sum of (qw * diff) * diff (or diff * diff) in order, NaN as infinite."""
    diff = decoded - x
    err = seq_sum(diff * diff if qw is None else qw * diff * diff)[:, 0]
    return torch.nan_to_num(err, nan=float("inf"))
