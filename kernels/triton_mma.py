"""Tensor-core products for batched decode (issue 22): the integer-dot products of kernels/triton_q8.py
for x of many rows (decode_slots' buckets of >= MMA_ROWS rows), one int8 tl.dot per 32 weight values.

The dp4a products (triton_q8) decode each weight tile once per group of 8 x rows, so their arithmetic
grows with the rows; here a program holds BM x rows and BN weight rows, loads each unit's weight bytes
once as a contiguous (BN, 32) tile (Q4_0 / Q4_K nibbles and Q6_K's 6-bit values widened in registers;
values 0..63 fit int8) and takes the exact int32 block sums of all BM rows from one tensor-core dot
against x quantized per row per 32 values (quantize_act's q, d, s: the dp4a products' input).

Bits equal to triton_q8.gemv_q8's: every block's int32 sum is exact either way, and the float work
after it rounds the same real numbers in the same order as triton_units.unit_dot (the same products of
scales, the same order of the sub-block terms, BK accumulators taking units u_lo + i BK + k in turn,
added in order at the end of each of the dp4a launch's K parts, the same epilogue), with the same
expression shapes, so the compiler's FMA contraction pairs the same operations. So a row's result
does not depend on which kernel or bucket computed it (tests/test_triton_mma.py under the
interpreter, tests/gpu/test_gpu_mma.py on the GPU), which decode_slots' batch invariance needs: a slot
decoded in a bucket of 64 gives the bits of that slot decoded alone (tests/test_triton_slots.py).

Why the first version ran at 6-12% of the copy bandwidth at 64 rows (8B shapes; its time grew 3.4x
from 16 to 64 rows, so arithmetic, not bytes; its SASS, bench/mma_sass.py: 2513 instructions a step
of a 64 x 64 Q4_K tile, 4 warps, 255 registers and spills): (1) int -> float conversions (I2FP, a
fraction of the FMA rate): two per 32 values per (x row, weight row) for Q4_K, one per 16 for Q6_K;
here they are an integer add of 1.5 * 2^23's bits and a float subtraction (exact for |i| < 2^22),
and the scale products d sc, dmin mn are taken once per weight row (exact: an fp16 times a 6-bit
integer) instead of an integer product and a conversion per element (the same step: 1206
instructions with TRANS, none of them conversions); weight bytes are widened 4 a register;
(2) programs of 2-7 loop steps: each took one part of the dp4a launch's K split (its split is set for
1-row products: 4-14 units a part), exposed the load latency of its first steps every time and
ended in BM x BN int64 atomics per part (more bytes than the weights for the 8B shapes at 64 rows);
here a program takes several consecutive parts (`parts`), truncates each part's sum to fixed point
as the dp4a epilogue does and adds the parts as integers (any order, the same bits), so the loop is
long and the output is written once per program (atomically only when K is still shared);
(3) the per-unit scale vectors were replicated across the MMA layout's threads along the weight
rows (16 of 32 elements a thread); TRANS puts the weight rows on the MMA's M axis instead (2 rows a
thread), leaving the x-row vectors replicated, and those are loaded in pairs (int64 views).

Fields are read in place from the block-major weights (QWeight.to_blocks: field (X / c, N, c), unit
stride U, row stride R), the same tensors the dp4a and prefill kernels read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.quantize.formats import FORMATS

from .qweight import Q, QWeight
from .triton_base import FUSION, INTERPRET, load_even, round_act
from .triton_bytes import Q4_0_PTX, nibbles, packed, q6_values
from .triton_epilogue import FIXED_ONE, Launch

# Products of at least this many x rows take the tensor-core kernel (decode_slots' buckets 16, 32, 64;
# below that the dp4a kernels' 8-row groups cost less than a 16-row tile: issue 22's measurements).
MMA_ROWS = 16
MMA_FMT = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_K: 2, Q.Q6_K: 3}
MMA_TYPES = frozenset(MMA_FMT)
UNIT = {t: FORMATS[t].int_dot.unit for t in MMA_TYPES}
# Per type, per bucket (the entry of the most rows <= m): (BM x rows, BN weight rows, warps, stages,
# TRANS, registers a thread at most (0: ptxas's choice, which takes up to 255 and one program an SM),
# programs per SM the K split aims at (0: each program takes all of K)). bench/mma_products.py
# sweeps them on the GPU (every config's bits checked against the dp4a kernel) and prints this table;
# the run below: docs/PERFORMANCE.md, seventh session (1.35-2.41x the dp4a kernel a layer).
CONFIGS = {  # bench/mma_products.py on an H100 80GB HBM3, 2026-11-28
    Q.Q4_0: {16: (16, 128, 4, 1, 0, 128, 8), 32: (32, 128, 4, 1, 0, 0, 2), 64: (64, 64, 4, 3, 0, 0, 2)},
    Q.Q4_K: {16: (16, 64, 4, 2, 0, 128, 4), 32: (32, 64, 4, 3, 0, 0, 4), 64: (32, 64, 4, 3, 0, 128, 4)},
    Q.Q6_K: {16: (16, 64, 4, 2, 0, 0, 8), 32: (32, 64, 4, 2, 0, 0, 2), 64: (64, 32, 4, 1, 0, 128, 4)},
    Q.Q8_0: {16: (16, 64, 4, 3, 0, 128, 4), 32: (32, 64, 4, 3, 0, 128, 4), 64: (64, 64, 4, 3, 0, 0, 2)},
}
if INTERPRET:  # few, large programs
    CONFIGS = {t: {16: (16, 64, 4, 1, 0, 0, 0)} for t in CONFIGS}
SMS_CPU = 1  # the interpreter's multiprocessor count (it runs one program at a time): per_sm counts programs
MAGIC = tl.constexpr(0x4B400000)  # the bits of 1.5 * 2^23
MAGIC_F = tl.constexpr(12582912.0)


@triton.jit
def _biased_f32(b):
    """int32 b = i + MAGIC (|i| < 2^22) -> float(i), exactly i.to(float32): i sits in the low mantissa
    bits of 1.5 * 2^23 (one unit a step there), and the subtraction is exact. An integer add and a
    float subtraction instead of a conversion instruction (16 a clock per Hopper SM against 128 FMAs)."""
    return b.to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def _f32(i):
    """int32 i (|i| < 2^22) -> float(i), exactly (_biased_f32)."""
    return _biased_f32(i + MAGIC)


@triton.jit
def _dot(x, w, TRANS: tl.constexpr):
    """x (BM, 32) int8, w (BN, 32) int8 -> (BM, BN) exact int32 sums x w^T. TRANS: as w x^T on the MMA
    (weight rows on its M axis), transposed back."""
    if TRANS:
        return tl.trans(tl.dot(w, tl.trans(x), out_dtype=tl.int32))
    else:
        return tl.dot(x, tl.trans(w), out_dtype=tl.int32)


@triton.jit
def _w_bytes(P, U, R, u, nr, nro, e, EVEN: tl.constexpr):
    """Bytes e (1, C) of unit u of weight rows nr (BN, 1) -> (BN, C), as stored (one contiguous run
    of BN x C bytes where e covers the unit's row)."""
    return load_even(P + u * U + nr * R + e, nro, EVEN)


@triton.jit
def _w_vec(P, U, R, j, nc, nco, EVEN: tl.constexpr):
    """Element j (of the field's block-major axis) of weight rows nc (1, BN) -> (1, BN)."""
    return load_even(P + j * U + nc * R, nco, EVEN)


@triton.jit
def _x_tile(X, m, mo, col0, EVEN: tl.constexpr):
    """x int8 values of rows m (BM, 1) at columns col0 .. col0 + 31 -> (BM, 32)."""
    return load_even(X[0] + m.to(tl.int64) * X[3] + col0 + tl.arange(0, 32)[None, :], mo, EVEN)


@triton.jit
def _x_scale(X, m, mo, j, EVEN: tl.constexpr):
    """x's fp32 scale of 32-value block j, rows m (BM, 1)."""
    return load_even(X[1] + m.to(tl.int64) * (X[3] // 32) + j, mo, EVEN)


@triton.jit
def _x_scale_of_pair(X, m, mo, j, H: tl.constexpr, EVEN: tl.constexpr):
    """x's scale of block 2j + H, rows m (BM, 1), from the 8 bytes of blocks 2j, 2j + 1 (one load serves
    both: the scales as int64, X[4])."""
    v = load_even(X[4] + m.to(tl.int64) * (X[3] // 64) + j, mo, EVEN)
    return (v >> (32 * H)).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _x_block_sum(X, m, mo, j, EVEN: tl.constexpr):
    """x's int32 sum of 32-value block j (its two 16-value sums, one 8-byte load: the sums as int64,
    X[2]), rows m (BM, 1)."""
    v = load_even(X[2] + m.to(tl.int64) * (X[3] // 32) + j, mo, EVEN)
    return v.to(tl.int32) + (v >> 32).to(tl.int32)


@triton.jit
def _block32(FMT: tl.constexpr, F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS: tl.constexpr,
             EVEN: tl.constexpr, ASM: tl.constexpr):
    """Q8_0 / Q4_0 block u: unit_dot's s.to(f32) * (d_w * d_x), Q4_0's (s - 8 sx). Q4_0's values (0-15:
    low nibbles of bytes 0..15, 16-31: high) enter the dot minus 8 (int8 -8..7), so the dot is s - 8 sx
    itself (sx: the sum of x's int8 values, quantize_act's s): the same integer, no x sums to load."""
    e = tl.arange(0, 32)[None, :]
    if FMT == 0:
        q = _w_bytes(F[0], FU[0], FR[0], u, nr, nro, e, EVEN).to(tl.int8, bitcast=True)
    else:
        b = _w_bytes(F[0], FU[0], FR[0], u, nr, nro, e % 16, EVEN)  # byte e % 16 at value e
        if ASM:
            q = packed(Q4_0_PTX, b, tl.broadcast_to(tl.where(e < 16, 0, 255).to(tl.uint8), b.shape))
        else:
            q = (((b >> (4 * (e // 16))) & 15) - 8).to(tl.int8)
    s = _dot(_x_tile(X, m, mo, 32 * u, EVEN), q, TRANS)
    dw = _w_vec(F[1], FU[1], FR[1], u, nc, nco, EVEN).to(tl.float32)
    return _f32(s) * (dw * _x_scale(X, m, mo, u, EVEN))


@triton.jit
def _q4_k(F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS: tl.constexpr, EVEN: tl.constexpr,
          ASM: tl.constexpr):
    """Q4_K chunk u (sub-block 2u: low nibbles, 2u + 1: high): per sub-block
    (d sc) s - (dmin mn) sx, times its x scale, summed from zero. unit_dot takes d * (s sc) and
    dmin * (sx mn): the same real products (d sc and dmin mn are exact, an fp16 times a 6-bit integer;
    s sc and sx mn are exact integers in fp32), so the same roundings."""
    b = _w_bytes(F[0], FU[0], FR[0], u, nr, nro, tl.arange(0, 32)[None, :], EVEN)
    d = _w_vec(F[1], FU[1], FR[1], u // 4, nc, nco, EVEN).to(tl.float32)
    dmin = _w_vec(F[2], FU[2], FR[2], u // 4, nc, nco, EVEN).to(tl.float32)
    y = tl.zeros((m.shape[0], nc.shape[1]), tl.float32)
    for h in tl.static_range(2):
        sb = 2 * u + h
        s = _dot(_x_tile(X, m, mo, 64 * u + 32 * h, EVEN), nibbles(b, h, ASM), TRANS)
        dsc = d * _f32(_w_vec(F[3], FU[3], FR[3], sb, nc, nco, EVEN).to(tl.int32))
        dmn = dmin * _f32(_w_vec(F[4], FU[4], FR[4], sb, nc, nco, EVEN).to(tl.int32))
        sx = _x_block_sum(X, m, mo, sb, EVEN)
        part = dsc * _f32(s) - dmn * _f32(sx)
        y += part * _x_scale_of_pair(X, m, mo, u, h, EVEN)
    return y


@triton.jit
def _q6_k(F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS: tl.constexpr, EVEN: tl.constexpr,
          ASM: tl.constexpr):
    """Q6_K half u: d times the sum over its 16-value groups, in unit_dot's order (group k of each
    quarter t, k outer), of sc (a - 32 sx) d_x; unit_dot converts the integer sc (a - 32 sx), here
    float(sc) float(a - 32 sx) rounds the same real product once. Each group's a - 32 sx is one
    32-value dot of x with the weights minus 32 (int8 -32..31; sx: the sum of x's int8 values,
    quantize_act's s), the other 16 weights zeroed: the same integer, no x sums to load."""
    e = tl.arange(0, 32)[None, :]
    ql0 = _w_bytes(F[0], FU[0], FR[0], u, nr, nro, e, EVEN)  # bytes 0..31 of the half's ql
    ql1 = _w_bytes(F[0], FU[0], FR[0], u, nr, nro, e + 32, EVEN)  # 32..63
    qh = _w_bytes(F[2], FU[2], FR[2], u, nr, nro, e, EVEN)
    d = _w_vec(F[1], FU[1], FR[1], u // 2, nc, nco, EVEN).to(tl.float32)
    y = tl.zeros((m.shape[0], nc.shape[1]), tl.float32)
    for k in tl.static_range(2):  # k: the 16-value group of each 32-value quarter (unit_dot's order)
        keep = tl.broadcast_to(tl.where(e // 16 == k, 255, 0).to(tl.uint8), ql0.shape)
        for t in tl.static_range(4):  # quarter t: values 32t .. 32t + 31 of the half
            if t % 2 == 0:  # (a static if: a conditional expression of tensors does not compile)
                q = q6_values(ql0, qh, keep, t, ASM)
            else:
                q = q6_values(ql1, qh, keep, t, ASM)
            a = _dot(_x_tile(X, m, mo, 128 * u + 32 * t, EVEN), q, TRANS)
            g = 8 * u + 2 * t + k
            sc = _f32(_w_vec(F[3], FU[3], FR[3], g, nc, nco, EVEN).to(tl.int32))
            y += (sc * _f32(a)) * _x_scale_of_pair(X, m, mo, 2 * u + t // 2, t % 2, EVEN)
    return d * y


@triton.jit
def _unit(FMT: tl.constexpr, F, FU, FR, X, u, u_hi, m, M, nr, nc, N, TRANS: tl.constexpr, EVEN: tl.constexpr,
          ASM: tl.constexpr):
    """Unit u's (BM, BN) fp32 sums as triton_units.unit_dot computes each (zeros for u >= u_hi)."""
    mo = (m < M) & (u + 0 * m < u_hi)  # tensor compares: the interpreter's & of a mask and a scalar gives int32
    nro = (nr < N) & (u + 0 * nr < u_hi)
    nco = (nc < N) & (u + 0 * nc < u_hi)
    if FMT <= 1:
        return _block32(FMT, F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS, EVEN, ASM)
    elif FMT == 2:
        return _q4_k(F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS, EVEN, ASM)
    else:
        return _q6_k(F, FU, FR, X, u, m, mo, nr, nro, nc, nco, TRANS, EVEN, ASM)


@triton.jit
def _sum_acc(a0, a1, a2, a3, BK: tl.constexpr):
    """The BK accumulators added in order (the dp4a epilogue's tl.sum over them)."""
    y = a0
    if BK > 1:
        y = y + a1
    if BK > 2:
        y = y + a2
    if BK > 3:
        y = y + a3
    return y


@triton.jit(do_not_specialize=["M", "N", "per_split", "split", "parts"])
def _mma_kernel(xq_ptr, xd_ptr, xs2_ptr, xd2_ptr, out_ptr, bias_ptr, res_ptr, act_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4,
                R0, R1, R2, R3, R4, M, N, K, out_stride, per_split, split, parts, FMT: tl.constexpr,
                UNIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr,
                EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
                STAGES: tl.constexpr, ASM: tl.constexpr):
    """out[m, n] (+)= sum_k W[n, k] x[m, k] for BM x rows and BN weight rows (grid: (M / BM, N / BN,
    split / parts)); the program takes the dp4a launch's K parts program_id(2) * parts .. + parts - 1
    (per_split units each; `split` parts in all). BK: the dp4a kernel's units per step (its
    accumulators: unit u_lo + i BK + k goes to accumulator k, added in order at the end of a part).
    An int64 out is a fixed-point accumulator: each part's sum is truncated to it as the dp4a epilogue
    truncates it, the parts are added as integers and the total added to out (atomically when other
    programs share the tile's K); other outputs (split 1): bias, rounding, residual as
    triton_epilogue.epilogue. EVEN: every tile and step lies inside the tensors (no masks). ASM: the
    weight bytes widened 4 a register by inline PTX (the interpreter: elementwise, the same values)."""
    tl.static_assert(BK <= 4, "at most 4 accumulators")
    m = (tl.program_id(0) * BM + tl.arange(0, BM))[:, None]
    nr = (tl.program_id(1) * BN + tl.arange(0, BN))[:, None]  # weight rows of the byte tiles
    nc = (tl.program_id(1) * BN + tl.arange(0, BN))[None, :]  # and of the (BM, BN) sums
    F, FU, FR = (P0, P1, P2, P3, P4), (U0, U1, U2, U3, U4), (R0, R1, R2, R3, R4)
    X = (xq_ptr, xd_ptr, xs2_ptr, K, xd2_ptr)
    FIXED: tl.constexpr = out_ptr.dtype.element_ty == tl.int64
    units = K // UNIT
    if HAS_BIAS:
        bias = tl.load(bias_ptr + nc, mask=nc < N, other=0.0).to(tl.float32)
    zero = tl.zeros((BM, BN), tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    acc = tl.zeros((BM, BN), tl.int64)
    p_lo = tl.program_id(2) * parts
    # a loop over the parts around the steps' loop: a part's end tested inside the steps' loop was
    # compiled to selects, its int64 conversions run every step
    for p in range(p_lo, tl.minimum(p_lo + parts, split)):
        u_lo = p * per_split
        u_hi = tl.minimum(u_lo + per_split, units)
        a0 = zero
        if BK > 1:
            a1 = zero
        if BK > 2:
            a2 = zero
        if BK > 3:
            a3 = zero
        for u0 in tl.range(u_lo, u_hi, BK, num_stages=STAGES):
            a0 += _unit(FMT, F, FU, FR, X, u0, u_hi, m, M, nr, nc, N, TRANS, EVEN, ASM)
            if BK > 1:
                a1 += _unit(FMT, F, FU, FR, X, u0 + 1, u_hi, m, M, nr, nc, N, TRANS, EVEN, ASM)
            if BK > 2:
                a2 += _unit(FMT, F, FU, FR, X, u0 + 2, u_hi, m, M, nr, nc, N, TRANS, EVEN, ASM)
            if BK > 3:
                a3 += _unit(FMT, F, FU, FR, X, u0 + 3, u_hi, m, M, nr, nc, N, TRANS, EVEN, ASM)
        if FIXED:
            y = _sum_acc(a0, a1, a2, a3, BK)
            if HAS_BIAS:
                if p == 0:  # as the dp4a epilogue's program_id(2) == 0
                    y += bias
            acc += (y * FIXED_ONE).to(tl.int64)
    o = out_ptr + m.to(tl.int64) * out_stride + nc
    om = (m < M) & (nc < N)
    if FIXED:
        if parts < split:  # other programs add parts of the same tile
            tl.atomic_add(o, acc, mask=om, sem="relaxed")
        else:
            tl.store(o, tl.load(o, mask=om, other=0) + acc, mask=om)
    else:
        y = _sum_acc(a0, a1, a2, a3, BK)
        if HAS_BIAS:
            y += bias
        y = round_act(y, act_ptr.dtype.element_ty, ROUND)
        if HAS_RES:
            y += tl.load(res_ptr + m.to(tl.int64) * out_stride + nc, mask=om, other=0.0).to(tl.float32)
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


def config_for(qtype, m: int) -> tuple[int, ...]:
    """CONFIGS' entry for m x rows: the bucket of the most rows <= m (the smallest bucket below it)."""
    table = CONFIGS[qtype]
    fits = [r for r in table if r <= m]
    return table[max(fits) if fits else min(table)]


def k_groups(split: int, tiles: int, per_sm: int, device: torch.device) -> tuple[int, int]:
    """(programs along K, dp4a parts each) for `tiles` output tiles: enough programs for per_sm a
    multiprocessor, at most one per part; per_sm 0: one program takes all of K."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SMS_CPU
    groups = min(split, max(1, triton.cdiv(per_sm * sms, tiles)))
    parts = triton.cdiv(split, groups)
    return triton.cdiv(split, parts), parts


def gemv_mma(xa: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: QWeight, launch: Launch, bk: int,
             bias: torch.Tensor | None, residual: torch.Tensor | None, act_dtype: torch.dtype,
             config: tuple[int, ...] | None = None) -> torch.Tensor:
    """triton_q8.gemv_q8's product (its plan `launch`: output, split K; bk: its units per step) on
    tensor cores; -> launch.out. config: a CONFIGS entry (default: config_for's)."""
    q, d, s = xa
    m, k = q.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.qtype in MMA_TYPES and k % UNIT[w.qtype] == 0
    ps, us, rs = field_args(w)
    bm, bn, warps, stages, trans, regs, per_sm = config or config_for(w.qtype, m)
    bm = min(bm, max(16, triton.next_power_of_2(m)))
    out = launch.out
    assert launch.split == 1 or out.dtype == torch.int64
    tiles = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    groups, parts = k_groups(launch.split, tiles[0] * tiles[1], per_sm, q.device)
    even = m % bm == 0 and n % bn == 0 and (k // UNIT[w.qtype]) % bk == 0
    # the 16-value sums in pairs as int64 (a 32-value block's two in one load), the scales too where
    # K / 32 is even (the K-quants: their units hold several blocks)
    xd2 = d.view(torch.int64) if (k // 32) % 2 == 0 else d
    _mma_kernel[(*tiles, groups)](
        q, d, s.view(torch.int64), xd2, out, bias if bias is not None else out, residual if residual is not None else out, launch.act_ref,
        *ps, *us, *rs, m, n, k, out.stride(0), launch.per_split, launch.split, parts,
        FMT=MMA_FMT[w.qtype], UNIT=UNIT[w.qtype], BM=bm, BN=bn, BK=bk, TRANS=bool(trans), EVEN=even,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ROUND=act_dtype != torch.float32, STAGES=stages,
        ASM=not INTERPRET, num_warps=warps, **({"maxnreg": regs} if regs else {}), **FUSION)
    return out
