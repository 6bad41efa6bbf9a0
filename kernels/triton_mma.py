"""Tensor-core products for batched decode (issue 22): the integer-dot products of kernels/triton_q8.py
for x of many rows (decode_slots' buckets of >= MMA_ROWS rows), one int8 tl.dot per 32 weight values.

The dp4a products (triton_q8) decode each weight tile once per group of 8 x rows, so their arithmetic
grows with the rows; here a program holds BM x rows and BN weight rows, loads each 32-value block of
the weights once as an int8 (BN, 32) tile (Q4_0 / Q4_K nibbles and Q6_K's 6-bit values widened in
registers; values 0..63 fit int8) and takes the exact int32 block sums of all BM rows from one
tensor-core dot against x quantized per row per 32 values (quantize_act's q, d, s: the same input
the dp4a products take).

Bits equal to triton_q8.gemv_q8's: every block's int32 sum is exact either way, and the float work
after it is the dp4a kernel's expression by expression (triton_q8.unit_dot: the same scale products,
the same order of the sub-block terms, BK accumulators taking units u_lo + i BK + k in turn, added
in order at the end, the same split of K and the same epilogue). So a row's result does not depend
on which kernel or bucket computed it (tests/test_triton_mma.py under the interpreter,
tests/gpu/test_gpu_mma.py on the GPU), which decode_slots' batch invariance needs: a slot decoded in
a bucket of 64 gives the bits of that slot decoded alone (tests/test_triton_slots.py).

Fields are read in place from the block-major weights (QWeight.to_blocks: field (X / c, N, c), unit
stride U, row stride R), the same tensors the dp4a and prefill kernels read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.quantize.formats import FORMATS

from .qweight import Q, QWeight
from .triton_base import INTERPRET, round_act
from .triton_epilogue import FIXED_ONE, Launch

# Products of at least this many x rows take the tensor-core kernel (decode_slots' buckets 16, 32, 64;
# below that the dp4a kernels' 8-row groups cost less than a 16-row tile: issue 22's measurements).
MMA_ROWS = 16
MMA_FMT = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_K: 2, Q.Q6_K: 3}
MMA_TYPES = frozenset(MMA_FMT)
UNIT = {t: FORMATS[t].int_dot.unit for t in MMA_TYPES}
# (BM x rows, BN weight rows, warps, stages) per type; bench/mma_products.py sweeps them on the GPU.
CONFIGS = {Q.Q8_0: (64, 64, 4, 3), Q.Q4_0: (64, 64, 4, 3), Q.Q4_K: (64, 64, 4, 2), Q.Q6_K: (64, 64, 4, 2)}  # H100 sweep, 2026-11-27
if INTERPRET:  # few, large programs
    CONFIGS = {t: (16, 64, 4, 1) for t in CONFIGS}


@triton.jit
def _w_tile(P, U, R, u, n, nm, e, SHIFT: tl.constexpr):
    """Bytes of unit u of weight rows n (1, BN) at byte offsets e (32, 1) of the unit's row -> (32, BN)
    int32 (SHIFT < 0: the byte, else its 4 bits from SHIFT)."""
    b = tl.load(P + u * U + n * R + e, mask=nm, other=0).to(tl.int32)
    if SHIFT >= 0:
        b = (b >> SHIFT) & 15
    return b


@triton.jit
def _x_tile(xq_ptr, m, mm, K, col0):
    """x int8 values of rows m (BM, 1) at columns col0 .. col0 + 31 -> (BM, 32) int8."""
    c = tl.arange(0, 32)[None, :]
    return tl.load(xq_ptr + m.to(tl.int64) * K + col0 + c, mask=mm, other=0)


@triton.jit
def _dot(x, w):
    """x (BM, 32) int8, w (32, BN) int32 values in int8 range -> (BM, BN) exact int32 sums."""
    return tl.dot(x, w.to(tl.int8), out_dtype=tl.int32)


@triton.jit
def _unit(FMT: tl.constexpr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, R0, R1, R2, R3, R4, xq_ptr, xd_ptr, xs_ptr, u, u_hi,
          m, mm, n, nm, K):
    """Unit u's (BM, BN) fp32 sums, as triton_q8.unit_dot computes each (zeros for u >= u_hi)."""
    e = tl.arange(0, 32)[:, None]
    mo = mm & (u + 0 * m < u_hi)  # tensor compares: the interpreter's & of a mask and a scalar gives int32
    no = nm & (u + 0 * n < u_hi)
    m64 = m.to(tl.int64)
    xd = xd_ptr + m64 * (K // 32)
    xs = xs_ptr + m64 * (K // 16)
    if FMT == 0:  # Q8_0: w = d q
        s = _dot(_x_tile(xq_ptr, m, mo, K, 32 * u), (_w_tile(P0, U0, R0, u, n, no, e, -1) << 24) >> 24)
        dw = tl.load(P1 + u * U1 + n * R1, mask=no, other=0).to(tl.float32)
        return s.to(tl.float32) * (dw * tl.load(xd + u, mask=mo, other=0))
    elif FMT == 1:  # Q4_0: values 0-15 low nibbles of bytes 0..15, 16-31 high; w = d (q - 8)
        q = (_w_tile(P0, U0, R0, u, n, no, e % 16, -1) >> (4 * (e // 16))) & 15
        s = _dot(_x_tile(xq_ptr, m, mo, K, 32 * u), q)
        sx = tl.load(xs + 2 * u, mask=mo, other=0) + tl.load(xs + 2 * u + 1, mask=mo, other=0)
        dw = tl.load(P1 + u * U1 + n * R1, mask=no, other=0).to(tl.float32)
        return (s - 8 * sx).to(tl.float32) * (dw * tl.load(xd + u, mask=mo, other=0))
    elif FMT == 2:  # Q4_K chunk u: sub-block 2u low nibbles, 2u + 1 high; w = d sc q - dmin mn
        d = tl.load(P1 + (u // 4) * U1 + n * R1, mask=no, other=0).to(tl.float32)
        dmin = tl.load(P2 + (u // 4) * U2 + n * R2, mask=no, other=0).to(tl.float32)
        y = tl.zeros(d.shape, tl.float32) * tl.zeros(m.shape, tl.float32)
        b = _w_tile(P0, U0, R0, u, n, no, e, -1)
        for h in tl.static_range(2):
            s = _dot(_x_tile(xq_ptr, m, mo, K, 64 * u + 32 * h), (b >> (4 * h)) & 15)
            sb = 2 * u + h
            sc = tl.load(P3 + sb * U3 + n * R3, mask=no, other=0).to(tl.int32)
            mn = tl.load(P4 + sb * U4 + n * R4, mask=no, other=0).to(tl.int32)
            sx = tl.load(xs + 2 * sb, mask=mo, other=0) + tl.load(xs + 2 * sb + 1, mask=mo, other=0)
            part = d * (s * sc).to(tl.float32) - dmin * (sx * mn).to(tl.float32)
            y += part * tl.load(xd + sb, mask=mo, other=0)
        return y
    else:  # Q6_K half u: w = d sc (q - 32) per 16 values
        d = tl.load(P1 + (u // 2) * U1 + n * R1, mask=no, other=0).to(tl.float32)
        y = tl.zeros(d.shape, tl.float32) * tl.zeros(m.shape, tl.float32)
        ql0 = _w_tile(P0, U0, R0, u, n, no, e, -1)  # bytes 0..31 of the half's ql, 32..63, its qh
        ql1 = _w_tile(P0, U0, R0, u, n, no, e + 32, -1)
        qh = _w_tile(P2, U2, R2, u, n, no, e, -1)
        for k in tl.static_range(2):  # k: the 16-value group of each 32-value quarter (triton_q8's order)
            for t in tl.static_range(4):  # quarter t: values 32t .. 32t + 31 of the half
                if t % 2 == 0:
                    q = (ql0 >> (4 * (t // 2))) & 15
                else:
                    q = (ql1 >> (4 * (t // 2))) & 15
                q = q | (((qh >> (2 * t)) & 3) << 4)
                a = _dot(_x_tile(xq_ptr, m, mo, K, 128 * u + 32 * t), tl.where(e // 16 == k, q, 0))
                g = 8 * u + 2 * t + k
                sc = tl.load(P3 + g * U3 + n * R3, mask=no, other=0).to(tl.int32)
                y += (sc * (a - 32 * tl.load(xs + g, mask=mo, other=0))).to(tl.float32) * tl.load(
                    xd + 4 * u + t, mask=mo, other=0)
        return d * y


@triton.jit
def _mma_kernel(xq_ptr, xd_ptr, xs_ptr, out_ptr, bias_ptr, res_ptr, act_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4,
                R0, R1, R2, R3, R4, M, N, K, out_stride, units_per_split, FMT: tl.constexpr, UNIT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr, ROUND: tl.constexpr, SPLIT, STAGES: tl.constexpr):
    """out[m, n] (+)= sum_k W[n, k] x[m, k] for BM x rows and BN weight rows (grid: (M / BM, N / BN,
    SPLIT)), K part program_id(2) of units_per_split units; BK: the dp4a kernel's units per step (its
    accumulators: unit u_lo + i BK + k goes to accumulator k, added in order at the end, as its
    tl.sum over them adds). Epilogue as triton_epilogue.epilogue's for an int64 fixed-point
    accumulator (atomically with SPLIT > 1) or an unsplit output (bias, rounding, residual). SPLIT is a
    runtime value (one compiled kernel for every split of a type and tile)."""
    tl.static_assert(BK <= 4, "at most 4 accumulators")
    m = (tl.program_id(0) * BM + tl.arange(0, BM))[:, None]
    n = (tl.program_id(1) * BN + tl.arange(0, BN))[None, :]
    mm, nm = m < M, n < N
    u_lo = tl.program_id(2) * units_per_split
    u_hi = tl.minimum(u_lo + units_per_split, K // UNIT)
    a0 = tl.zeros((BM, BN), tl.float32)
    a1, a2, a3 = a0, a0, a0
    for u0 in tl.range(u_lo, u_hi, BK, num_stages=STAGES):
        a0 += _unit(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, R0, R1, R2, R3, R4, xq_ptr, xd_ptr, xs_ptr, u0,
                    u_hi, m, mm, n, nm, K)
        if BK > 1:
            a1 += _unit(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, R0, R1, R2, R3, R4, xq_ptr, xd_ptr, xs_ptr,
                        u0 + 1, u_hi, m, mm, n, nm, K)
        if BK > 2:
            a2 += _unit(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, R0, R1, R2, R3, R4, xq_ptr, xd_ptr, xs_ptr,
                        u0 + 2, u_hi, m, mm, n, nm, K)
        if BK > 3:
            a3 += _unit(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, R0, R1, R2, R3, R4, xq_ptr, xd_ptr, xs_ptr,
                        u0 + 3, u_hi, m, mm, n, nm, K)
    y = a0
    if BK > 1:
        y = y + a1
    if BK > 2:
        y = y + a2
    if BK > 3:
        y = y + a3
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            y += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)
    o = out_ptr + m.to(tl.int64) * out_stride + n
    om = mm & nm
    if out_ptr.dtype.element_ty == tl.int64:
        q = (y * FIXED_ONE).to(tl.int64)
        if SPLIT > 1:
            tl.atomic_add(o, q, mask=om, sem="relaxed")
        else:
            tl.store(o, tl.load(o, mask=om, other=0) + q, mask=om)
    else:
        y = round_act(y, act_ptr.dtype.element_ty, ROUND)
        if HAS_RES:
            y += tl.load(res_ptr + m.to(tl.int64) * out_stride + n, mask=om, other=0.0).to(tl.float32)
        tl.store(o, y, mask=om)


def takes(w: QWeight, m: int, glu: bool, launch: Launch) -> bool:
    """gemv_q8's product of m x rows goes to the tensor-core kernel: MMA_ROWS rows or more, a type it
    reads, and an epilogue it has (no GLU; split K only into an int64 accumulator)."""
    return (m >= MMA_ROWS and w.qtype in MMA_TYPES and not glu
            and (launch.split == 1 or launch.out.dtype == torch.int64))


def field_args(w: QWeight) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Block-major w -> its five fields in the kernel's order (unused ones repeat the first), their unit
    strides and their row strides (elements; a row view's step included)."""
    assert w.blocks, "the tensor-core products read block-major weights (QWeight.to_blocks)"
    ps = [w.parts[name] if name else None for name in FORMATS[w.qtype].int_dot.args]
    ps = [p if p is not None else ps[0] for p in ps]
    assert all(p.stride(2) == 1 for p in ps)
    return ps, [p.stride(0) for p in ps], [p.stride(1) for p in ps]


def gemv_mma(xa: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: QWeight, launch: Launch, bk: int,
             bias: torch.Tensor | None, residual: torch.Tensor | None, act_dtype: torch.dtype,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """triton_q8.gemv_q8's product (its plan `launch`: output, split K; bk: its units per step) on
    tensor cores; -> launch.out."""
    q, d, s = xa
    m, k = q.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.qtype in MMA_TYPES and k % UNIT[w.qtype] == 0
    ps, us, rs = field_args(w)
    bm, bn, warps, stages = config or CONFIGS[w.qtype]
    bm = min(bm, max(16, triton.next_power_of_2(m)))
    out = launch.out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), launch.split)
    _mma_kernel[grid](q, d, s, out, bias if bias is not None else out, residual if residual is not None else out,
                      launch.act_ref, *ps, *us, *rs, m, n, k, out.stride(0), launch.per_split,
                      FMT=MMA_FMT[w.qtype], UNIT=UNIT[w.qtype], BM=bm, BN=bn, BK=bk, HAS_BIAS=bias is not None,
                      HAS_RES=residual is not None, ROUND=act_dtype != torch.float32, SPLIT=launch.split,
                      STAGES=stages, num_warps=warps)
    return out
