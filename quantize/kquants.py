"""Encoders of the K-quants (super-blocks of 256 values): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Each encoder takes x (B, 256) float32 and the imatrix weights qw (B, 256) (None without importance)
and returns [the best candidate's bytes (B, bytes per block) uint8] (best_of: least error, summed in
order; *_candidates give them all). The candidates are llama.cpp's two quantizers of the format, quantize_row_*_ref (its choice without
an imatrix) and quantize_row_*_impl (with one; also run without one, on its default weights), the
impl search once more weighted as the error is measured (1, or the imatrix), and for each of these
two least-squares refits of the super-block scale(s) (ours). Each is: a scale search per sub-block
(ksearch.py: ggml-quants.c's arithmetic order, so each llama.cpp candidate is its bytes, and
kernels/cpu_kencode.cpp's C++ encoder gives these very bytes), the sub-block scales as ints against one fp16 super-block scale, then every value
re-rounded against the scales as they will decode. Bit layouts are drawn in formats/k_types.py.
"""

from __future__ import annotations

import torch

from .ksearch import GROUP_MAX_EPS, make_q3_quants, make_qkx, make_qp_quants, make_qx_quants, rdiv, seq_sum, signed_max, sqrtf
from .pack import cat_bytes, fp16_bytes, fp16_round, high_bit_bytes, pack_nibbles, two_bit_bytes


def sub_blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(B, 256) -> (B * 256 / n, n)."""
    return t.reshape(-1, n)


def block_sigma2(x: torch.Tensor, factor: float) -> torch.Tensor:
    """(B, 256) -> (B, 1): llama.cpp's sigma2 = factor * sum(x^2) / 256, summed in order."""
    return factor * seq_sum(x * x) / 256


def imatrix_weights(x: torch.Tensor, qw: torch.Tensor, sigma_factor: float) -> torch.Tensor:
    """llama.cpp's per-value weights with an imatrix: qw * sqrt(sigma2 + x^2), sigma2 = f * mean(x^2)."""
    return qw * sqrtf(block_sigma2(x, sigma_factor) + x * x)


def error_weights(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """The weights of the error blocks.py measures: the imatrix's, or 1."""
    return torch.ones_like(x) if qw is None else qw


def sub_block_rms(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, 256) -> (B, 256): the root mean square of each value's sub-block of n."""
    xs = x.reshape(-1, n)
    rms = sqrtf(seq_sum(xs * xs) / n)  # quantize_row_q4_K_ref's sqrtf(sum_x2 / 32)
    return rms.expand_as(xs).reshape(x.shape)


# ---- sub-block scales against one fp16 super-block scale: (ints, d) with d as it will decode

def scales_by_max(s: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative s (B, n) -> ints in [0, levels] with d = max / levels (the ref quantizers)."""
    top = s.amax(-1, keepdim=True).clamp(min=0) + 0.0  # llama.cpp's max starts at +0 (never -0)
    inv = torch.where(top > 0, rdiv(levels, torch.where(top > 0, top, 1.0)), 0.0)
    return torch.round(inv * s).clamp(0, levels).int(), fp16_round(top / levels)


def scales_by_search(s: torch.Tensor, sw: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative s (B, n) -> ints in [0, levels] by make_qp_quants weighted by sw (the impl quantizers)."""
    q, d = make_qp_quants(s, sw, levels)
    return q.int(), fp16_round(d)


def signed_scales_by_max(s: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed s (B, n) -> ints in [-levels, levels-1]: the largest |s| maps to -levels (Q3_K, Q6_K ref)."""
    top = signed_max(s)
    live = top.abs() >= GROUP_MAX_EPS
    iscale = torch.where(live, rdiv(-levels, torch.where(live, top, 1.0)), 0.0)
    d = torch.where(live, rdiv(1, torch.where(live, iscale, 1.0)), 0.0)
    return torch.round(iscale * s).clamp(-levels, levels - 1).int(), fp16_round(d)


# ---- final quants: every value re-rounded against its scales as they decode

def requantize_affine(x: torch.Tensor, d, sc, dmin, m, nmax: int) -> torch.Tensor:
    """q = round((x + dmin * m) / (d * sc)) in [0, nmax] per sub-block; 0 where d * sc is 0."""
    xs = x.reshape(x.shape[0], sc.shape[-1], -1)
    dl = (d * sc.float()).unsqueeze(-1)
    ml = (dmin * m.float()).unsqueeze(-1)
    q = torch.round((xs + ml) / torch.where(dl != 0, dl, 1.0)).clamp(0, nmax)
    return torch.where(dl != 0, q, 0.0).int().reshape(x.shape)


def requantize_symmetric(x: torch.Tensor, d, sc, nmax: int) -> torch.Tensor:
    """q = round(x / (d * sc)) in [-nmax, nmax-1] per sub-block; 0 where d * sc is 0."""
    xs = x.reshape(x.shape[0], sc.shape[-1], -1)
    dl = (d * sc.float()).unsqueeze(-1)
    q = torch.round(xs / torch.where(dl != 0, dl, 1.0)).clamp(-nmax, nmax - 1)
    return torch.where(dl != 0, q, 0.0).int().reshape(x.shape)


# ---- refits (ours, not llama.cpp's): least-squares super-block scale(s) for the final quants

def per_value(t: torch.Tensor) -> torch.Tensor:
    """(B, n sub-blocks) -> (B, 256), each sub-block's entry repeated over its values."""
    return t.float().repeat_interleave(256 // t.shape[-1], dim=-1)


def refit_affine(x: torch.Tensor, ew: torch.Tensor, nmax: int, d, sc, dmin, m) -> tuple:
    """(d, dmin) minimizing sum ew (d * sc * q - dmin * m - x)^2 for the current quants q."""
    a = per_value(sc) * requantize_affine(x, d, sc, dmin, m, nmax).float()
    b = per_value(m)
    saa, sab, sbb = (seq_sum(ew * u * v) for u, v in ((a, a), (a, b), (b, b)))
    sax, sbx = seq_sum(ew * a * x), seq_sum(ew * b * x)
    det = saa * sbb - sab * sab
    both = det > 1e-6 * saa * sbb  # else no mins to fit: d alone
    safe = torch.where(both, det, 1.0)
    new_d = torch.where(both, (sbb * sax - sab * sbx) / safe, sax / torch.where(saa > 0, saa, 1.0))
    new_dmin = torch.where(both, (sab * sax - saa * sbx) / safe, dmin)
    ok = (saa > 0) & torch.isfinite(new_d) & torch.isfinite(new_dmin)
    return torch.where(ok, fp16_round(new_d), d), sc, torch.where(ok, fp16_round(new_dmin), dmin), m


def refit_symmetric(x: torch.Tensor, ew: torch.Tensor, nmax: int, d, sc) -> tuple:
    """d minimizing sum ew (d * sc * q - x)^2 for the current quants q."""
    a = per_value(sc) * requantize_symmetric(x, d, sc, nmax).float()
    saa, sax = seq_sum(ew * a * a), seq_sum(ew * a * x)
    new_d = sax / torch.where(saa > 0, saa, 1.0)
    ok = (saa > 0) & torch.isfinite(new_d)
    return torch.where(ok, fp16_round(new_d), d), sc


def affine_values(q: torch.Tensor, d, sc, dmin, m) -> torch.Tensor:
    """The decoded (B, 256): (d * sc) * q - (dmin * m), as the torch decoders (and the C++ ones) compute it."""
    dl, ml = (d * sc.float()).unsqueeze(-1), (dmin * m.float()).unsqueeze(-1)
    return (dl * q.reshape(q.shape[0], sc.shape[-1], -1).float() - ml).reshape(q.shape)


def symmetric_values(q: torch.Tensor, d, sc) -> torch.Tensor:
    """The decoded (B, 256): (d * sc) * q."""
    dl = (d * sc.float()).unsqueeze(-1)
    return (dl * q.reshape(q.shape[0], sc.shape[-1], -1).float()).reshape(q.shape)


def best_of(x: torch.Tensor, qw: torch.Tensor | None, candidates: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per block, the bytes of the candidate whose values have the least error sum (qw * diff) * diff
    (or diff * diff), summed in order over the 256 values as kernels/cpu_kencode.cpp does; the first
    on ties, NaN as infinite."""
    best = best_err = None
    for values, data in candidates:
        diff = values - x
        err = seq_sum(diff * diff if qw is None else qw * diff * diff)
        err = torch.where(torch.isnan(err), torch.inf, err)
        if best is None:
            best, best_err = data, err
            continue
        better = err < best_err
        best = torch.where(better, data, best)
        best_err = torch.where(better, err, best_err)
    return best


def with_refits(found: list[tuple], refit, rounds: int = 2) -> list[tuple]:
    """The candidates plus, for each, `rounds` successive refits of it."""
    out = list(found)
    for fields in found:
        for _ in range(rounds):
            fields = refit(*fields)
            out.append(fields)
    return out


# ---- Q2_K, Q4_K, Q5_K: x ~ (d * sc) * q - (dmin * m), candidates as (d, sc, dmin, m)

IMPL_GRID = (-0.9, 0.05, 36)  # make_qkx3_quants' (rmin, rdelta, nstep) in every *_impl


def affine_fields(x: torch.Tensor, w: torch.Tensor, nmax: int, sub: int, grid: tuple, levels: int,
                  search_scales: bool, use_mad: bool = False) -> tuple:
    """Sub-block scales and mins by make_qkx_quants, then their ints against fp16 d and dmin."""
    xs, ws = sub_blocks(x, sub), sub_blocks(w, sub)
    scale, the_min = make_qkx(xs, ws, nmax, *grid, use_mad=use_mad, v3=search_scales)
    scale, the_min = scale.view(x.shape[0], -1), the_min.view(x.shape[0], -1)
    if search_scales:
        sw = seq_sum(ws).view(x.shape[0], -1)
        (sc, d), (m, dmin) = scales_by_search(scale, sw, levels), scales_by_search(the_min, sw, levels)
    else:
        (sc, d), (m, dmin) = scales_by_max(scale, levels), scales_by_max(the_min, levels)
    return d, sc, dmin, m


def q45_k_fields(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, ref_grid: tuple) -> list[tuple]:
    """quantize_row_q4_K/q5_K: ref (weights sub-block rms + |x|, scales by max), impl (weights
    super-block sigma + |x|, or the imatrix's; scales by search), and their refits."""
    found = [affine_fields(x, sub_block_rms(x, 32) + x.abs(), nmax, 32, ref_grid, 63, False)]
    found.append(affine_fields(x, sqrtf(block_sigma2(x, 2.0)) + x.abs(), nmax, 32, IMPL_GRID, 63, True))
    if qw is not None:
        found.append(affine_fields(x, imatrix_weights(x, qw, 2.0), nmax, 32, IMPL_GRID, 63, True))
    found.append(affine_fields(x, error_weights(x, qw), nmax, 32, IMPL_GRID, 63, True))
    return with_refits(found, lambda *f: refit_affine(x, error_weights(x, qw), nmax, *f))


def pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B, 8) 6-bit scales and mins -> the 12 scale bytes of Q4_K/Q5_K (formats/k_types.py draws them)."""
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    first = lo_sc | ((hi_sc >> 4) << 6)
    second = lo_m | ((hi_m >> 4) << 6)
    return cat_bytes(first, second, pack_nibbles(hi_sc, hi_m))


def k_low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(B, 256) -> (B, 128): chunk c of 64 values gives bytes q[64c + l] | q[64c + 32 + l] << 4."""
    chunks = q.reshape(-1, 4, 2, 32)
    return pack_nibbles(chunks[:, :, 0], chunks[:, :, 1]).reshape(-1, 128)


def q4_k_candidates(x: torch.Tensor, qw: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(decoded values, bytes) of each candidate, in the order best_of breaks ties by."""
    out = []
    for d, sc, dmin, m in q45_k_fields(x, qw, 15, (-1.0, 0.1, 20)):
        q = requantize_affine(x, d, sc, dmin, m, 15)
        out.append((affine_values(q, d, sc, dmin, m),
                    cat_bytes(fp16_bytes(d), fp16_bytes(dmin), pack_k_scales(sc, m), k_low_nibbles(q))))
    return out


def q5_k_candidates(x: torch.Tensor, qw: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for d, sc, dmin, m in q45_k_fields(x, qw, 31, (-0.5, 0.1, 15)):
        q = requantize_affine(x, d, sc, dmin, m, 31)
        out.append((affine_values(q, d, sc, dmin, m),
                    cat_bytes(fp16_bytes(d), fp16_bytes(dmin), pack_k_scales(sc, m), high_bit_bytes(q, 4),
                              k_low_nibbles(q))))
    return out


def encode_q4_k(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    return [best_of(x, qw, q4_k_candidates(x, qw))]


def encode_q5_k(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    return [best_of(x, qw, q5_k_candidates(x, qw))]


def q2_k_candidates(x: torch.Tensor, qw: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_row_q2_K: ref (weights |x|, absolute error, 4-bit scales by max), impl (imatrix weights,
    all-ones imatrix without one; scales by search), and their refits."""
    found = [
        affine_fields(x, x.abs(), 3, 16, (-0.5, 0.1, 15), 15, False, use_mad=True),
        affine_fields(x, imatrix_weights(x, error_weights(x, qw), 1.0), 3, 16, IMPL_GRID, 15, True),
        affine_fields(x, error_weights(x, qw), 3, 16, IMPL_GRID, 15, True),
    ]
    out = []
    for d, sc, dmin, m in with_refits(found, lambda *f: refit_affine(x, error_weights(x, qw), 3, *f)):
        q = requantize_affine(x, d, sc, dmin, m, 3)
        out.append((affine_values(q, d, sc, dmin, m),
                    cat_bytes(pack_nibbles(sc, m), two_bit_bytes(q), fp16_bytes(d), fp16_bytes(dmin))))
    return out


def encode_q2_k(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    return [best_of(x, qw, q2_k_candidates(x, qw))]


# ---- Q3_K, Q6_K: x ~ (d * sc) * q, candidates as (d, sc)

def pack_q3_scales(s: torch.Tensor) -> torch.Tensor:
    """(B, 16) scales in [-32, 31] -> 12 bytes: low nibbles of s0..7 | s8..15 << 4, then the top 2 bits."""
    u = s + 32
    top = ((u >> 4) & 3).reshape(-1, 4, 4)  # [s // 4, s % 4]
    high = (top << torch.arange(0, 8, 2, device=s.device, dtype=torch.int32).view(1, 4, 1)).sum(1)
    return cat_bytes(pack_nibbles(u[:, :8], u[:, 8:]), high)


def q3_k_candidates(x: torch.Tensor, qw: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_row_q3_K: ref (make_q3_quants, scales by max), impl (make_qx_quants weighted x^2 or by
    the imatrix, scales by the same weighted search), and their refits."""
    xs = sub_blocks(x, 16)
    _, scale = make_q3_quants(xs, 4)
    sc, d = signed_scales_by_max(scale.view(-1, 16), 32)
    found = [(d, sc)]
    ws = sub_blocks(x * x if qw is None else imatrix_weights(x, qw, 2.0), 16)
    _, scale = make_qx_quants(xs, ws, 4)
    sc, d = make_qx_quants(scale.view(-1, 16), seq_sum(ws).view(-1, 16), 32)
    found.append((fp16_round(d), sc.int()))
    ws = sub_blocks(error_weights(x, qw), 16)
    _, scale = make_qx_quants(xs, ws, 4)
    sc, d = make_qx_quants(scale.view(-1, 16), seq_sum(ws).view(-1, 16), 32)
    found.append((fp16_round(d), sc.int()))
    out = []
    for d, sc in with_refits(found, lambda *f: refit_symmetric(x, error_weights(x, qw), 4, *f)):
        q = requantize_symmetric(x, d, sc, 4)
        out.append((symmetric_values(q, d, sc),
                    cat_bytes(high_bit_bytes(q + 4, 2), two_bit_bytes(q + 4), pack_q3_scales(sc), fp16_bytes(d))))
    return out


def encode_q3_k(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    return [best_of(x, qw, q3_k_candidates(x, qw))]


def pack_q6_quants(q: torch.Tensor) -> torch.Tensor:
    """(B, 256) quants in [0, 63] -> ql (B, 128) then qh (B, 64) bytes."""
    halves = q.reshape(-1, 2, 4, 32)  # [half, k, l]: value 128 h + 32 k + l
    ql = torch.cat((pack_nibbles(halves[:, :, 0], halves[:, :, 2]), pack_nibbles(halves[:, :, 1], halves[:, :, 3])), -1)
    shifts = torch.arange(0, 8, 2, device=q.device, dtype=torch.int32).view(1, 1, 4, 1)
    qh = (((halves >> 4) & 3) << shifts).sum(2)
    return cat_bytes(ql.reshape(-1, 128), qh.reshape(-1, 64))


def q6_k_candidates(x: torch.Tensor, qw: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_row_q6_K: make_qx_quants weighted x^2 (ref) and by the error's weights (1, or the
    imatrix as impl), int8 scales by max, and their refits."""
    xs = sub_blocks(x, 16)
    found = []
    for ws in (xs * xs, sub_blocks(error_weights(x, qw), 16)):
        _, scale = make_qx_quants(xs, ws, 32)
        sc, d = signed_scales_by_max(scale.view(-1, 16), 128)
        found.append((d, sc))
    out = []
    for d, sc in with_refits(found, lambda *f: refit_symmetric(x, error_weights(x, qw), 32, *f)):
        q = requantize_symmetric(x, d, sc, 32)
        out.append((symmetric_values(q, d, sc),
                    cat_bytes(pack_q6_quants(q + 32), sc.to(torch.int8).view(torch.uint8), fp16_bytes(d))))
    return out


def encode_q6_k(x: torch.Tensor, qw: torch.Tensor | None) -> list[torch.Tensor]:
    return [best_of(x, qw, q6_k_candidates(x, qw))]
