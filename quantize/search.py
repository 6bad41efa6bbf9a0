"""Scale searches of llama.cpp's ggml-quants.c, vectorized over groups: x (G, n) -> one scale per row.

Each function is the same search as its namesake in ggml-quants.c (make_qx_quants, make_q3_quants,
make_qkx2/3_quants, make_qp_quants), run on all groups of a tensor at once. Loops run over search
steps (a grid of candidate scales, or the element positions of a coordinate descent), never over
groups. nearest_int in ggml rounds half to even, as torch.round does.
"""

from __future__ import annotations

import torch

GROUP_MAX_EPS = 1e-15


def signed_max(x: torch.Tensor) -> torch.Tensor:
    """(G, n) -> (G, 1): the value of largest magnitude, sign kept (the first one on ties)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(G, n), (G, n) -> (G, 1) row-wise dot products."""
    return torch.linalg.vecdot(a, b).unsqueeze(-1)


def weighted_fit(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums for the weighted least-squares scale of x ~ scale * q: (sum w x q, sum w q^2), each (G, 1)."""
    wq = w * q
    return dot(wq, x), dot(wq, q)


def make_qx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quants q in [-nmax, nmax-1] and scale (G, 1) with x ~ scale * q.

    Tries iscale = -(nmax + 0.1 k) / max for k in -9..9 and keeps the one whose weighted least-squares
    fit explains the most (largest sumlx^2 / suml2), as ggml's make_qx_quants with rmse_type 1.
    """
    xmax = signed_max(x)
    live = xmax.abs() >= GROUP_MAX_EPS
    xmax = torch.where(live, xmax, torch.ones_like(xmax))
    best_q = best_scale = best_gain = None
    for k in [0, *range(-9, 0), *range(1, 10)]:
        iscale = -(nmax + 0.1 * k) / xmax
        q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        sumlx, suml2 = weighted_fit(x, w, q)
        scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), torch.zeros_like(sumlx))
        gain = scale * sumlx
        if best_q is None:
            best_q, best_scale, best_gain = q, scale, gain
            continue
        better = (suml2 > 0) & (sumlx * sumlx > best_gain * suml2)
        best_q = torch.where(better, q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_gain = torch.where(better, gain, best_gain)
    return torch.where(live, best_q, torch.zeros_like(best_q)), torch.where(live, best_scale, 0.0)


def refine_quants(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, qmin: int, qmax: int,
                  passes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinate descent on the quants of x ~ scale * q (scale = least-squares fit).

    Moves one quant at a time to the value that best fits the others' scale, keeping a move only when
    the fit improves (ggml's make_q3_quants / make_qp_quants inner loop). Returns (q, scale).
    """
    q = q.clone()
    sumlx, suml2 = weighted_fit(x, w, q)
    for _ in range(passes):
        for i in range(x.shape[-1]):
            xi, wi, li = x[:, i:i + 1], w[:, i:i + 1], q[:, i:i + 1]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = torch.round(xi * sl2 / torch.where(ok, slx, 1.0)).clamp(qmin, qmax)
            slx_new = slx + wi * xi * new
            sl2_new = sl2 + wi * new * new
            take = ok & (new != li) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            q[:, i:i + 1] = torch.where(take, new, li)
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), torch.zeros_like(sumlx))
    return q, scale


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_q3_quants with do_rmse: q in [-nmax, nmax-1] from max-abs, then refined with weights x^2."""
    xmax = signed_max(x)
    live = xmax.abs() >= GROUP_MAX_EPS
    iscale = -nmax / torch.where(live, xmax, torch.ones_like(xmax))
    q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
    q, scale = refine_quants(x, x * x, q, -nmax, nmax - 1)
    return torch.where(live, q, torch.zeros_like(q)), torch.where(live, scale, 0.0)


def make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric fit x ~ scale * q - min with q in [0, nmax]: (scale, min) per group, min >= 0.

    ggml's make_qkx2/make_qkx3_quants: start from the (min, max) range, then for each step try
    iscale = (nmax + rmin + rdelta * k) / (max - best_min), fit (scale, min) by weighted least squares
    and keep it when the weighted error (squared, or absolute with use_mad) drops. The callers round
    the values again against the scales as they decode, so the quants themselves are not returned.
    """
    xmax = x.amax(-1, keepdim=True)
    low = x.amin(-1, keepdim=True).clamp(max=0)  # the offset: value of q = 0, never above 0
    flat = xmax <= low
    sum_w, sum_x = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True)

    def error(scale, offset, q):
        diff = torch.addcmul(offset, scale, q) - x
        return (w * diff.abs()).sum(-1, keepdim=True) if use_mad else dot(w * diff, diff)

    iscale = nmax / torch.where(flat, torch.ones_like(xmax), xmax - low)
    q = torch.round(iscale * (x - low)).clamp(0, nmax)
    scale = 1 / iscale
    best = error(scale, low, q)
    for k in range(nstep + 1):
        iscale = (rmin + rdelta * k + nmax) / (xmax - low)
        q = (iscale * (x - low)).clamp(0, nmax).round()
        wq = w * q
        sum_l, sum_l2, sum_xl = wq.sum(-1, keepdim=True), dot(wq, q), dot(wq, x)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe_det = torch.where(det > 0, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        pos = this_low > 0  # an offset above 0 is not allowed: refit the scale alone
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_low = torch.where(pos, 0.0, this_low)
        err = error(this_scale, this_low, q)
        better = (det > 0) & (err < best)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_low, low)
    return torch.where(flat, 0.0, scale), -low


def make_qp_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quants q in [0, nmax] and scale (G, 1) for non-negative x (sub-block scales or mins): x ~ scale * q.

    ggml's make_qp_quants: best of iscale = (nmax + 0.1 k) / max for k in -4..4 by weighted error,
    then coordinate descent on the quants.
    """
    xmax = x.amax(-1, keepdim=True)
    live = xmax >= GROUP_MAX_EPS
    xmax = torch.where(live, xmax, torch.ones_like(xmax))
    best_iscale = nmax / xmax
    q = torch.round(best_iscale * x)
    best = (w * (x - q / best_iscale) ** 2).sum(-1, keepdim=True)
    for k in [*range(-4, 0), *range(1, 5)]:
        iscale = (0.1 * k + nmax) / xmax
        q = torch.round(iscale * x).clamp(max=nmax)
        err = (w * (x - q / iscale) ** 2).sum(-1, keepdim=True)
        better = err < best
        best = torch.where(better, err, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    q = torch.round(best_iscale * x).clamp(max=nmax)
    q, scale = refine_quants(x, w, q, -(2**30), nmax)
    return torch.where(live, q, torch.zeros_like(q)), torch.where(live, scale, 0.0)
