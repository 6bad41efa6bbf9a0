"""Triton kernels over QWeight planar fields: fused dequantize + matrix-vector product, and dequantize.

Reference each kernel must match: `quantize.dequantize_torch(raw, qtype)` (values bit for bit in the
dequantize kernel; within fp32 summation order in the product, which is `x.float() @ w.float().T`).

Geometry: a weight row of K values is cut into groups of 2W values: W stored bytes (or dense values)
whose low nibbles give W values at columns `clo` and whose high nibbles give W values at `chi`
(for Q8_0 and dense: the first and second half of a 32-value block). Every group shares its scales,
so a (BN rows, G groups, W) tile loads each scale once and its quants with 16-byte vector loads.

The product kernel can also fuse what surrounds a projection in a decode step:
  X_MODE 1: x is the fp32 residual stream; the kernel applies RMSNorm (weight nw) to it first;
  X_MODE 2: x is (M, 2K) [gate | up]; the kernel multiplies by silu(gate) * up;
  HAS_RES: out = residual + round(W x), the residual add of a transformer block.
Rounding follows the torch modules (model.RMSNorm, F.silu, F.linear in the activation dtype).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .qweight import Q, QWeight

# Format ids (constexpr FMT) and each format's group width W in stored bytes / dense values.
DENSE, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K = range(7)
FMT_OF = {Q.Q8_0: Q8_0, Q.Q4_0: Q4_0, Q.Q4_1: Q4_1, Q.Q4_K: Q4_K, Q.Q5_K: Q5_K, Q.Q6_K: Q6_K}
WIDTH = {DENSE: 16, Q8_0: 16, Q4_0: 16, Q4_1: 16, Q4_K: 32, Q5_K: 32, Q6_K: 16}
# Field order passed as pointers P0..P5 (unused ones repeat P0).
FIELDS = {
    DENSE: ("w",), Q8_0: ("qs", "d"), Q4_0: ("qs", "d"), Q4_1: ("qs", "d", "m"),
    Q4_K: ("qs", "d", "dmin", "sc", "mn"), Q5_K: ("qs", "d", "dmin", "sc", "mn", "qh"),
    Q6_K: ("ql", "d", None, "sc", None, "qh"),
}
# (rows per program BN, groups per iteration G, warps) per format for the product; bench/gemv_sweep.py tunes.
CONFIGS = {DENSE: (4, 16, 4), Q8_0: (4, 32, 4), Q4_0: (8, 32, 4), Q4_1: (8, 32, 4),
           Q4_K: (8, 16, 4), Q5_K: (8, 16, 4), Q6_K: (8, 32, 4)}
if os.environ.get("LOCALLLM_GEMV_CONFIGS"):  # a file written by bench/cuda_check.py's sweep
    import json

    with open(os.environ["LOCALLLM_GEMV_CONFIGS"]) as _f:
        CONFIGS.update({int(k): tuple(v) for k, v in json.load(_f).items()})
# The CPU interpreter (tests) pays per program, not per element: few large programs.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    CONFIGS = {fmt: (64, 8, 4) for fmt in CONFIGS}


@triton.jit
def _tile(FMT: tl.constexpr, P0, P1, P2, P3, P4, P5, rows, rmask, g, gmask, K, W: tl.constexpr):
    """rows (BN,), g (G,) -> lo, hi (BN, G, W) fp32 values and their columns clo, chi (G, W)."""
    w = tl.arange(0, W)
    r = rows.to(tl.int64)[:, None, None]
    gg = g[None, :, None]
    ww = w[None, None, :]
    mask = rmask[:, None, None] & gmask[None, :, None]
    if FMT == 0:  # dense: columns 32g + w and 32g + 16 + w
        lo = tl.load(P0 + r * K + 32 * gg + ww, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(P0 + r * K + 32 * gg + 16 + ww, mask=mask, other=0.0).to(tl.float32)
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 1:  # Q8_0: x = q * d
        d = tl.load(P1 + r * (K // 32) + gg, mask=mask, other=0.0).to(tl.float32)
        lo = tl.load(P0 + r * K + 32 * gg + ww, mask=mask, other=0).to(tl.float32) * d
        hi = tl.load(P0 + r * K + 32 * gg + 16 + ww, mask=mask, other=0).to(tl.float32) * d
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 2 or FMT == 3:  # Q4_0: x = d * (q - 8); Q4_1: x = d * q + m
        qs = tl.load(P0 + r * (K // 2) + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        d = tl.load(P1 + r * (K // 32) + gg, mask=mask, other=0.0).to(tl.float32)
        if FMT == 2:
            lo = d * ((qs & 15) - 8).to(tl.float32)
            hi = d * ((qs >> 4) - 8).to(tl.float32)
        else:
            m = tl.load(P2 + r * (K // 32) + gg, mask=mask, other=0.0).to(tl.float32)
            lo = d * (qs & 15).to(tl.float32) + m
            hi = d * (qs >> 4).to(tl.float32) + m
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 4 or FMT == 5:  # Q4_K / Q5_K: group = 32-byte chunk c of block b, g = 4b + c
        qs = tl.load(P0 + r * (K // 2) + 32 * gg + ww, mask=mask, other=0).to(tl.int32)
        ql = qs & 15
        qh = qs >> 4
        if FMT == 5:
            hb = tl.load(P5 + r * (K // 8) + 32 * (gg // 4) + ww, mask=mask, other=0).to(tl.int32)
            bit = 2 * (gg % 4)
            ql = ql | (((hb >> bit) & 1) << 4)
            qh = qh | (((hb >> (bit + 1)) & 1) << 4)
        d = tl.load(P1 + r * (K // 256) + gg // 4, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(P2 + r * (K // 256) + gg // 4, mask=mask, other=0.0).to(tl.float32)
        sc_lo = tl.load(P3 + r * (K // 32) + 2 * gg, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(P3 + r * (K // 32) + 2 * gg + 1, mask=mask, other=0).to(tl.float32)
        m_lo = tl.load(P4 + r * (K // 32) + 2 * gg, mask=mask, other=0).to(tl.float32)
        m_hi = tl.load(P4 + r * (K // 32) + 2 * gg + 1, mask=mask, other=0).to(tl.float32)
        lo = (d * sc_lo) * ql.to(tl.float32) - dmin * m_lo
        hi = (d * sc_hi) * qh.to(tl.float32) - dmin * m_hi
        clo = 64 * g[:, None] + w[None, :]
        chi = clo + 32
    else:  # Q6_K: g = 8b + 4h + s; ql byte 16g + w holds columns 256b + 128h + 16s + w (+64 high nibble)
        ql = tl.load(P0 + r * (K // 2) + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        b = gg // 8
        h = (gg % 8) // 4
        s = gg % 4
        hb = tl.load(P5 + r * (K // 4) + 64 * b + 32 * h + 16 * (s % 2) + ww, mask=mask, other=0).to(tl.int32)
        shift = 2 * (s // 2)
        q_lo = ((ql & 15) | (((hb >> shift) & 3) << 4)) - 32
        q_hi = ((ql >> 4) | (((hb >> (shift + 4)) & 3) << 4)) - 32
        d = tl.load(P1 + r * (K // 256) + b, mask=mask, other=0.0).to(tl.float32)
        sb = 16 * b + 8 * h + s
        sc_lo = tl.load(P3 + r * (K // 16) + sb, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(P3 + r * (K // 16) + sb + 4, mask=mask, other=0).to(tl.float32)
        lo = (d * sc_lo) * q_lo.to(tl.float32)
        hi = (d * sc_hi) * q_hi.to(tl.float32)
        g2 = g[:, None]
        clo = 256 * (g2 // 8) + 128 * ((g2 % 8) // 4) + 16 * (g2 % 4) + w[None, :]
        chi = clo + 64
    return lo, hi, clo, chi


@triton.jit
def _rstd(xrow, K, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the K values at xrow."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _load_x(xrow, cols, cmask, X_MODE: tl.constexpr, rstd, nw_ptr, K, ACT: tl.constexpr):
    """x values at cols (BN, G, W) in fp32, after the fused prologue (see module doc)."""
    v = tl.load(xrow + cols, mask=cmask, other=0.0).to(tl.float32)
    if X_MODE == 1:  # model.RMSNorm: weight * (x * rstd).to(dtype), in the weight dtype
        nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        v = ((v * rstd).to(ACT).to(tl.float32) * nw).to(ACT).to(tl.float32)
    elif X_MODE == 2:  # F.silu(gate) * up, each rounded to the activation dtype
        up = tl.load(xrow + K + cols, mask=cmask, other=0.0).to(tl.float32)
        silu = (v / (1.0 + tl.exp(-v))).to(ACT).to(tl.float32)
        v = (silu * up).to(ACT).to(tl.float32)
    return v


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, res_ptr, nw_ptr, act_ptr, P0, P1, P2, P3, P4, P5,
                 N, K, x_stride, eps,
                 FMT: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                 X_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr):
    """out[m, n] = sum_k W[n, k] * x[m, k] for BN rows n of one x row m (grid: (N / BN, M))."""
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    m = tl.program_id(1)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    xrow = x_ptr + m.to(tl.int64) * x_stride
    rstd = 1.0
    if X_MODE == 1:
        rstd = _rstd(xrow, K, eps, 1024)
    ngroups = K // (2 * W)
    acc = tl.zeros((BN, G, W), tl.float32)
    for g0 in range(0, ngroups, G):
        g = g0 + tl.arange(0, G)
        gmask = g < ngroups
        lo, hi, clo, chi = _tile(FMT, P0, P1, P2, P3, P4, P5, rows, rmask, g, gmask, K, W)
        # x is loaded at the tile's full (BN, G, W) shape (rows repeat the same addresses, L1 hits) so
        # that it takes the weights' register layout: a (G, W) load would be re-laid out through
        # shared memory every iteration.
        zero = (rows * 0)[:, None, None]
        cmask = (zero == 0) & gmask[None, :, None]
        xlo = _load_x(xrow, zero + clo[None, :, :], cmask, X_MODE, rstd, nw_ptr, K, ACT)
        xhi = _load_x(xrow, zero + chi[None, :, :], cmask, X_MODE, rstd, nw_ptr, K, ACT)
        acc += lo * xlo + hi * xhi
    y = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if ROUND:
        y = y.to(ACT).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + m.to(tl.int64) * N + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * N + rows, y, mask=rmask)


@triton.jit
def _dequant_kernel(out_ptr, P0, P1, P2, P3, P4, P5, N, K,
                    FMT: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    """out (N, K) = the decoded values (grid: (N / BN, groups per row / G))."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    g = tl.program_id(1) * G + tl.arange(0, G)
    gmask = g < K // (2 * W)
    lo, hi, clo, chi = _tile(FMT, P0, P1, P2, P3, P4, P5, rows, rmask, g, gmask, K, W)
    base = out_ptr + rows.to(tl.int64)[:, None, None] * K
    mask = rmask[:, None, None] & gmask[None, :, None]
    ty = out_ptr.dtype.element_ty
    tl.store(base + clo[None, :, :], lo.to(ty), mask=mask)
    tl.store(base + chi[None, :, :], hi.to(ty), mask=mask)


def weight_args(w: QWeight | torch.Tensor) -> tuple[int, tuple[int, int], list[torch.Tensor]]:
    """-> (format id, (N, K), six field pointers) for a QWeight with a kernel or a dense (N, K) tensor."""
    if isinstance(w, torch.Tensor):
        return DENSE, tuple(w.shape), [w] * 6
    fmt = FMT_OF[w.qtype]
    ptrs = [w.parts[name] if name else None for name in FIELDS[fmt]]
    ptrs += [None] * (6 - len(ptrs))
    first = ptrs[0]
    return fmt, w.shape, [p if p is not None else first for p in ptrs]


def gemv(x: torch.Tensor, w: QWeight | torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         glu: bool = False, act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (M, K) [(M, 2K) with glu] -> (M, N) = round_act(x' @ W.T + bias) (+ residual).

    x' is x, RMSNorm(x) with norm_weight, or silu(gate) * up with glu. act_dtype (default: x's dtype,
    or norm_weight's) is the dtype the torch modules would round activations to; the product is
    rounded to it when it is not fp32. out_dtype defaults to the residual's dtype, else act_dtype.
    """
    fmt, (n, k), ptrs = weight_args(w)
    x = x.contiguous()
    m = x.shape[0]
    act = act_dtype or (norm_weight.dtype if norm_weight is not None else x.dtype)
    out_dtype = out_dtype or (residual.dtype if residual is not None else act)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    bn, g, warps = config or CONFIGS[fmt]
    x_mode = 1 if norm_weight is not None else 2 if glu else 0
    act_ref = torch.empty(1, dtype=act, device=x.device)
    grid = (triton.cdiv(n, bn), m)
    _gemv_kernel[grid](
        x, out, bias if bias is not None else out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, act_ref, *ptrs,
        n, k, x.stride(0), eps,
        FMT=fmt, W=WIDTH[fmt], BN=bn, G=g, X_MODE=x_mode, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, ROUND=act != torch.float32, num_warps=warps,
    )
    return out


def dequantize(w: QWeight, dtype: torch.dtype = torch.bfloat16, bn: int = 16, g: int = 16) -> torch.Tensor:
    """QWeight with a kernel -> dense (N, K) of `dtype` (exactly dequantize_torch's values in fp32)."""
    fmt, (n, k), ptrs = weight_args(w)
    bn = 128 if INTERPRET else bn
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    groups = k // (2 * WIDTH[fmt])
    grid = (triton.cdiv(n, bn), triton.cdiv(groups, g))
    _dequant_kernel[grid](out, *ptrs, n, k, FMT=fmt, W=WIDTH[fmt], BN=bn, G=g, num_warps=4)
    return out
