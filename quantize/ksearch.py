"""The K-quants' scale searches in ggml-quants.c's arithmetic order, vectorized over groups.

Each function is its namesake of ggml-quants.c (make_qkx2_quants / make_qkx3_quants, make_qp_quants,
make_qx_quants, make_q3_quants) run on all groups (G, n) of a tensor at once, computing every float
in llama.cpp's order: each product left to right as C writes it, each sum over a group's values in
sequence (seq_sum: a loop over the n positions, vectorized across groups), each float constant
(0.1f * is + nmax, ...) in float32. kernels/cpu_kencode.cpp does the same per block in C++; the two
agree bit for bit (tests/test_kencode.py). nearest_int rounds half to even, as torch.round does.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15


def f32(v) -> float:
    """A float constant computed as C computes it in float (the caller passes np.float32 arithmetic)."""
    return float(np.float32(v))


def rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t correctly rounded, as C's float division (torch's `c / t` is t.reciprocal() * c: not the same)."""
    return torch.full_like(t, c) / t


def sqrtf(t: torch.Tensor) -> torch.Tensor:
    """C's sqrtf, correctly rounded (torch.sqrt of float32 on the CPU is not always: via float64)."""
    return torch.sqrt(t.double()).float()


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """(G, n) -> (G, 1): t[:, 0] + t[:, 1] + ... in that order (a C loop's float sum, from 0)."""
    cols = t.t().contiguous()
    acc = torch.zeros_like(cols[0])
    for c in cols:
        acc = acc + c
    return acc.unsqueeze(-1)


def signed_max(x: torch.Tensor) -> torch.Tensor:
    """(G, n) -> (G, 1): the value of largest magnitude, sign kept (the first one on ties)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))


def make_qkx(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
             use_mad: bool = False, v3: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ scale * q - the_min, q in [0, nmax]: (scale, the_min) (G, 1) each, the_min >= 0.

    make_qkx3_quants (v3) or make_qkx2_quants: the (min, max) start, then iscale = (rmin + rdelta is
    + nmax) / (max - min) for is in 0..nstep, each fit by weighted least squares, kept when its
    weighted error (squared, or absolute with use_mad) is smaller."""
    xmax = x.amax(-1, keepdim=True)
    low = x.amin(-1, keepdim=True).clamp(max=0)
    flat = xmax <= low
    low0 = low
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)

    def error(scale, offset, q):
        diff = scale * q + offset - x
        return seq_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = rdiv(nmax, xmax - low)
    scale = rdiv(1, iscale)
    best = error(scale, low, torch.round(iscale * (x - low)).clamp(0, nmax))
    for k in range(nstep + 1):
        c = f32(np.float32(rmin) + np.float32(rdelta) * np.float32(k) + np.float32(nmax))
        v = rdiv(c, xmax - low) * (x - low)
        if v3:
            q = torch.where(v > 0, torch.round(v.clamp(max=nmax)), 0.0)
        else:
            q = torch.round(v).clamp(0, nmax)
        wq = w * q
        sum_l, sum_l2, sum_xl = seq_sum(wq), seq_sum(wq * q), seq_sum(wq * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = this_low > 0  # an offset above 0 is not allowed: the scale alone
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        this_low = torch.where(pos, 0.0, this_low)
        err = error(this_scale, this_low, q)
        better = (det > 0) & (err < best)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_low, low)
    return torch.where(flat, 0.0, scale), torch.where(flat, -low0, -low)


def make_qp_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative x (G, n) ~ scale * q, q in [0, nmax]: (q, scale (G, 1)). ggml's make_qp_quants: the
    best of iscale = (0.1f is + nmax) / max, is in -4..4, by weighted error, then coordinate descent."""
    xmax = x.amax(-1, keepdim=True).clamp(min=0)
    live = xmax >= GROUP_MAX_EPS
    xmax = torch.where(live, xmax, 1.0)
    best_iscale = rdiv(nmax, xmax)
    diff = x - rdiv(1, best_iscale) * torch.round(best_iscale * x)
    best = seq_sum(w * diff * diff)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale = rdiv(f32(np.float32(0.1) * np.float32(k) + np.float32(nmax)), xmax)
        diff = x - rdiv(1, iscale) * torch.round(iscale * x).clamp(max=nmax)
        err = seq_sum(w * diff * diff)
        better = err < best
        best = torch.where(better, err, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    q = torch.round(best_iscale * x).clamp(max=nmax)
    q, sumlx, suml2 = descend(x, w, q, -(2**30), nmax, lambda slx, sl2: (slx > 0) & (sl2 > 0))
    scale = torch.where(suml2 > 0, sumlx / suml2, 0.0)
    return torch.where(live, q, 0.0), torch.where(live, scale, 0.0)


def descend(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, qmin: int, qmax: int, gate, passes: int = 5):
    """ggml's coordinate descent on the quants of x ~ scale * q (make_qp_quants, make_q3_quants): each
    quant in turn moves to round(x sl2 / slx) when that raises sumlx^2 / suml2. gate(slx, sl2): where
    a move is tried (make_q3_quants checks sl2 > 0 only after the move). Returns (q, sumlx, suml2)."""
    q = q.clone()
    sumlx, suml2 = seq_sum(w * x * q), seq_sum(w * q * q)
    for _ in range(passes):  # ggml stops at a pass without a change: later passes would change nothing
        for i in range(x.shape[-1]):
            xi, wi, li = x[:, i:i + 1], w[:, i:i + 1], q[:, i:i + 1]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = gate(slx, sl2)
            new = torch.round(xi * sl2 / slx).clamp(qmin, qmax)
            slx_new = slx + wi * xi * new
            sl2_new = sl2 + wi * new * new
            take = ok & (new != li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            q[:, i:i + 1] = torch.where(take, new, li)
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
    return q, sumlx, suml2


def make_qx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric x (G, n) ~ scale * q, q in [-nmax, nmax-1]: (q, scale (G, 1)). ggml's make_qx_quants
    (rmse_type 1, weights w): iscale = -(nmax + 0.1f is) / max for is = 0, -9..9, kept when
    sumlx^2 / suml2 grows."""
    xmax = signed_max(x)
    live = xmax.abs() >= GROUP_MAX_EPS
    xmax = torch.where(live, xmax, 1.0)
    best_q = best_scale = best = None
    for k in (0, -9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9):
        c = f32(np.float32(nmax) + np.float32(0.1) * np.float32(k)) if k else float(nmax)
        q = torch.round(rdiv(-c, xmax) * x).clamp(-nmax, nmax - 1)
        sumlx, suml2 = seq_sum(w * x * q), seq_sum(w * q * q)
        if best_q is None:
            best_q, best_scale = q, torch.where(suml2 != 0, sumlx / suml2, 0.0)
            best = best_scale * sumlx
            continue
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = sumlx / suml2
        best_q = torch.where(better, q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(live, best_q, 0.0), torch.where(live, best_scale, 0.0)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_q3_quants with do_rmse: q in [-nmax, nmax-1] from the signed max, then coordinate
    descent weighted x^2: (q, scale (G, 1))."""
    xmax = signed_max(x)
    live = xmax.abs() >= GROUP_MAX_EPS
    q = torch.round(rdiv(-nmax, torch.where(live, xmax, 1.0)) * x).clamp(-nmax, nmax - 1)
    q, sumlx, suml2 = descend(x, x * x, q, -nmax, nmax - 1, lambda slx, sl2: slx > 0)
    scale = torch.where(suml2 > 0, sumlx / suml2, 0.0)
    return torch.where(live, q, 0.0), torch.where(live, scale, 0.0)
