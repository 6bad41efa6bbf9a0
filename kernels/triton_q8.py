"""Integer-dot matrix-vector products for Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, IQ4_NL and IQ4_XS weights (decode,
few rows).

x is first quantized to int8 per 32 values (quantize/act.py, Q8_0's rule, plus sums over 16 values;
RMSNorm can be fused into that pass). Then every 32-bit word of weight quants meets a word of four
x int8s in one dp4a instruction (four products and their sum), and block scales are applied once per
16-64 values: about one instruction per weight against ~7 for a float decode (kernels/triton_gemv.py),
which is what keeps 4-bit products at memory speed. llama.cpp's CUDA matvec (mmvq) works the same way.

Reference each product must match, within fp32 summation order:
  dequantize_torch(W) @ dequantize_act(q_x, d_x)    (quantize/act.py),
so the only error against W @ x is Q8_0's on the activations (tests/gpu/test_gpu_kernels.py).

The weights are block-major (QWeight.to_blocks): the threads of a warp take consecutive rows of the
same units, so their 16-byte word loads form one contiguous run and the x words they need are the same
(a broadcast). Against a row-major layout, where every thread fetched its own x words, this took an 8B
gate/up Q4_0 product from about half of copy bandwidth to over four fifths (docs/PERFORMANCE.md).

The activation quantizer is kernels/triton_quant_act.py; each type's units (fields, dot products) are
kernels/triton_units.py, their 4-bit code tables kernels/triton_table16.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qweight import Q, QWeight
from .triton_base import FUSION, INTERPRET, PDL, pdl_trigger, pdl_wait
from .triton_epilogue import epilogue, part_out, plan, split_finish
from .triton_mma import gemv_mma, takes as mma_takes
from .triton_units import FMT, TYPES, UNIT, unit_dot, unit_weights, weight_args

# (rows per program BN, units per iteration BK, warps): the fastest of a sweep on Hopper; Q8_0 and
# Q4_0 take 2 units a step instead of 4, which was faster in the whole decode step (BK 1, or BN 16 / 64
# with BK 2, were slower; docs/PERFORMANCE.md). Every product is also split over K
# (triton_epilogue.auto_split) so that enough warps stream.
CONFIGS = {Q.Q8_0: (32, 2, 1), Q.Q4_0: (32, 2, 1), Q.Q4_K: (128, 2, 4), Q.Q6_K: (32, 1, 1),
           Q.MXFP4: (32, 2, 1),  # MXFP4: Q4_0's (the same loads; not swept)
           Q.IQ4_NL: (32, 2, 1), Q.IQ4_XS: (32, 2, 1)}  # IQ4: Q4_0's too (not swept)
if INTERPRET:  # the interpreter pays per program: few large ones
    CONFIGS = {t: (64, 4, 4) for t in CONFIGS}
# Products load their first PRELOAD steps' weights (BK units each) before their PDL wait, overlapping
# the kernel before them (a quantizer or the attention's combine: while it runs, the next product's
# first programs are resident and idle): 0, 1 or 2 per type, the fastest of each in the decode step.
PRELOAD = {Q.Q8_0: 1, Q.Q4_0: 2, Q.Q4_K: 2, Q.Q6_K: 2, Q.MXFP4: 2, Q.IQ4_NL: 2, Q.IQ4_XS: 2}


@triton.jit
def _row_units(acc, R: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3,
               um3, ASM: tl.constexpr, EVEN: tl.constexpr):
    """acc + x row m0 + R's sums over the units u3 of the weight fields W (a no-op for R >= ROWS).
    Each row runs a one-row program's operations on the same loaded fields, so a verify pass of
    several tokens sums each row exactly as the decode step of that token does (speculative
    decoding)."""
    if R < ROWS:
        m64 = (m0 + R).to(tl.int64)
        xq, xd, xs = xq_ptr + m64 * (K // 4), xd_ptr + m64 * (K // 32), xs_ptr + m64 * (K // 16)
        acc += unit_dot(FMT, W, xq, xd, xs, u3, um3, ASM, EVEN)
    return acc


@triton.jit
def _rows_step(A, ROWS: tl.constexpr, FMT: tl.constexpr, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3,
               ASM: tl.constexpr, EVEN: tl.constexpr):
    """The 8 row accumulators A (a tuple; rows >= ROWS stay as they are) + the units u3 of W."""
    return (_row_units(A[0], 0, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[1], 1, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[2], 2, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[3], 3, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[4], 4, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[5], 5, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[6], 6, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN),
            _row_units(A[7], 7, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN))


@triton.jit
def _row_out(acc, R: tl.constexpr, ROWS: tl.constexpr, m0, rows, rmask, out_ptr, bias_ptr, res_ptr, N, out_stride,
             ACT: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
             ROUND: tl.constexpr, SPLIT: tl.constexpr):
    if R < ROWS:
        epilogue(tl.sum(tl.sum(acc, 2), 0), rows, rmask, m0 + R, out_ptr, bias_ptr, res_ptr, N, out_stride, ACT,
                  BN, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)


@triton.jit(do_not_specialize=["step"])
def _q8_gemv_kernel(xq_ptr, xd_ptr, xs_ptr, out_ptr, bias_ptr, res_ptr, act_ptr, ws_ptr, cnt_ptr, P0, P1, P2, P3, P4,
                    U0, U1, U2, U3, U4, step, M, N, K, out_stride, units_per_split, FMT: tl.constexpr,
                    UNIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr, SPLIT: tl.constexpr,
                    ROWS: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, CHAIN: tl.constexpr,
                    PRELOAD: tl.constexpr, PDL: tl.constexpr, GROUPS_FIRST: tl.constexpr = False):
    """out[m, n] = sum_k W[n, k] x[m, k] for BN rows n of ROWS (<= triton_epilogue.MAX_ROWS) x rows m
    (grid: (N / BN, M / ROWS, SPLIT)); each iteration takes BK units of K. step: the fields' row
    step (2 for an interleaved view; kept a runtime value so that the per-row scale loads keep the
    word tile's layout). The epilogue (bias, GLU, residual, split K) is triton_epilogue's.
    EVEN: N % BN == 0 and every BK-unit step exists.
    PRELOAD: the first PRELOAD steps' weights are loaded into registers before the PDL wait (weights
    are never written), so the first programs stream while the small kernel before them runs (a
    several-percent faster quantized decode step; prefetching them into L2 there instead was slower:
    docs/PERFORMANCE.md).
    CHAIN: products of one x into disjoint outputs, run back to back (Q4_K_M's q, k and v), overlap:
    the first (1) lets the next be scheduled once it has waited for its input; the others (2) start
    at once (their input is complete: the first waited for it) and wait at their end instead, so
    each still ends after the one before it and the kernel after the chain sees all of them done.
    GROUPS_FIRST: the grid is (M / ROWS, N / BN, SPLIT) instead, so that the programs of one weight
    tile's x row groups run side by side and all but the first read it from L2 (decode_slots' batches
    of more than ROWS rows; not with the epilogue's GLU or split_finish, which read program_id(0) as
    the tile)."""
    tl.static_assert(PRELOAD <= 2, "PRELOAD takes 0, 1 or 2 steps (W, W2 below)")
    if GROUPS_FIRST:
        tile = tl.program_id(1)
        group = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        group = tl.program_id(1)
    rows = tile * BN + tl.arange(0, BN)
    u_lo = tl.program_id(2) * units_per_split
    u_hi = tl.minimum(u_lo + units_per_split, K // UNIT)
    r3 = (rows * step)[None, :, None]
    rmask = rows < N
    u3 = (u_lo + tl.arange(0, BK))[:, None, None]
    um3 = u3 < u_hi
    if PRELOAD >= 1:  # the first units' weights, while the kernel before still runs
        W = unit_weights(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, r3, rmask[None, :, None] & um3, EVEN)
    if PRELOAD >= 2:
        W2 = unit_weights(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3 + BK, r3,
                          rmask[None, :, None] & (u3 + BK < u_hi), EVEN)
    if CHAIN == 2:
        pdl_trigger(PDL)
    else:
        pdl_wait(PDL)
        if CHAIN == 1:
            pdl_trigger(PDL)
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    m0 = group * ROWS
    a = tl.zeros((BK, BN, 1), tl.float32)
    A = (a, a, a, a, a, a, a, a)
    if PRELOAD >= 1:
        A = _rows_step(A, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN)
    if PRELOAD >= 2:
        A = _rows_step(A, ROWS, FMT, W2, xq_ptr, xd_ptr, xs_ptr, m0, K, u3 + BK, u3 + BK < u_hi, ASM, EVEN)
    for u0 in range(u_lo + PRELOAD * BK, u_hi, BK):
        u3 = (u0 + tl.arange(0, BK))[:, None, None]
        um3 = u3 < u_hi
        W = unit_weights(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, r3, rmask[None, :, None] & um3, EVEN)
        A = _rows_step(A, ROWS, FMT, W, xq_ptr, xd_ptr, xs_ptr, m0, K, u3, um3, ASM, EVEN)
    a0, a1, a2, a3, a4, a5, a6, a7 = A
    pout, pstride = part_out(out_ptr, out_stride, ws_ptr, M, N, SPLIT)
    _row_out(a0, 0, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a1, 1, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a2, 2, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a3, 3, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a4, 4, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a5, 5, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a6, 6, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    _row_out(a7, 7, ROWS, m0, rows, rmask, pout, bias_ptr, res_ptr, N, pstride, ACT, BN, GLU, HAS_BIAS,
             HAS_RES, ROUND, SPLIT)
    split_finish(ws_ptr, cnt_ptr, out_ptr, out_stride, rows, rmask, m0, M, N, ROWS, SPLIT)
    if CHAIN == 2:
        pdl_wait(PDL)


def gemv_q8(xa: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: QWeight, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, glu: bool = False, act_dtype: torch.dtype = torch.bfloat16,
            out_dtype: torch.dtype | None = None, config: tuple[int, int, int] | None = None,
            split: int | None = 1, inplace: bool = False, counters: torch.Tensor | None = None,
            chain: int = 0, mma: bool | tuple = True) -> torch.Tensor:
    """xa = quantize_act(x) of x (M, K) -> (M, N) as triton_gemv.gemv (same bias / residual / glu /
    split / inplace / counters meaning), the product taken in integers; w block-major
    (QWeight.to_blocks). chain: 1 / 2 for the first / a later one of products overlapped on one x
    (the kernel's CHAIN; split K's fp32 workspace is not for them). mma: products of
    triton_mma.MMA_ROWS rows or more may take the tensor-core kernel (the same bits; False: the dp4a
    kernel, for tests and benchmarks; a triton_mma.CONFIGS entry: with that config)."""
    assert chain == 0 or (inplace and residual is not None and residual.dtype == torch.int64)
    q, d, s = xa
    m, k = q.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.qtype in TYPES
    ptrs, strides, step = weight_args(w)
    bn, bk, warps = config or CONFIGS[w.qtype]
    bn = max(bn, 2) if glu else bn
    units = k // UNIT[w.qtype]
    L = plan(m, n, bn, units, bk, glu, split, residual, inplace, out_dtype, act_dtype, q.device, counters)
    out = L.out
    if mma and mma_takes(w, m, glu, L):  # many x rows (decode_slots' larger buckets): tensor cores, the same bits
        return gemv_mma(xa, w, L, bk, bias, residual, act_dtype, mma if isinstance(mma, tuple) else None)
    even = n % bn == 0 and units % bk == 0
    # unmasked (even) tiles must exist: at most the shortest part's steps. Several x rows (a verify
    # pass, a batch): none; ROWS x PRELOAD unrolled copies of a step gave Q6_K a kernel that Triton
    # 3.6's coalesce pass failed on and that took minutes to compile
    preload = min(PRELOAD[w.qtype], (units - (L.split - 1) * L.per_split) // bk) if even else PRELOAD[w.qtype]
    preload = preload if L.rows == 1 else 0
    # several x row groups: each tile's groups side by side (L2 reuse of its weights)
    groups_first = L.rows < m and not glu and (L.split == 1 or out.dtype == torch.int64)
    grid = (L.grid[1], L.grid[0], L.grid[2]) if groups_first else L.grid
    _q8_gemv_kernel[grid](
        q.view(torch.int32), d, s, out, bias if bias is not None else out, residual if residual is not None else out,
        L.act_ref, L.ws, L.counters, *ptrs, *strides, step, m, n, k, out.stride(0), L.per_split,
        FMT=FMT[w.qtype], UNIT=UNIT[w.qtype], BN=bn, BK=bk, GLU=glu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, ROUND=act_dtype != torch.float32, SPLIT=L.split, ROWS=L.rows,
        ASM=not INTERPRET,
        EVEN=even, CHAIN=chain, PRELOAD=preload, PDL=PDL, GROUPS_FIRST=groups_first,
        num_warps=warps, launch_pdl=PDL, **FUSION
    )
    return out
