"""Triton kernels over QWeight planar fields: fused dequantize + matrix-vector product, and dequantize.

Reference each kernel must match: `quantize.dequantize_torch(raw, qtype)` (values bit for bit in the
dequantize kernel; within fp32 summation order in the product, which is `x.float() @ w.float().T`).

Geometry: a weight row of K values is cut into groups of 2W values: W stored bytes (or dense values)
whose low nibbles give W values at columns `clo` and whose high nibbles give W values at `chi`
(for Q8_0 and dense: the first and second half of a 32-value block). Every group shares its scales,
so a (BN rows, G groups, W) tile loads each scale once and its quants with 16-byte vector loads.

The product kernel can also fuse what surrounds a projection in a decode step:
  NORM: x is the residual stream (fp32, or an int64 fixed-point accumulator); the product is
        rstd(x) * (W @ (x * norm weight)) (RMSNorm);
  GLU: the weight rows are interleaved (gate_i, up_i) and the output is silu(gate) * up;
  HAS_RES: out = residual + round(W x), the residual add of a transformer block.
Outputs are rounded as the torch modules round them (F.linear, F.silu in the activation dtype);
the epilogue and split K are kernels/triton_epilogue.py's. A program takes up to
triton_epilogue.MAX_ROWS x rows, decoding each weight tile once for all of them, and computes each
row exactly as a one-row program does (speculative decoding's verify pass). Dense weights with few x rows take kernels/triton_dense.py.
Speed: quants become floats by the 2^23 bit trick (int_f32)
rather than int->float conversions, and every load of a tile shares one register layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.quantize.formats import FORMATS

from .qweight import KERNEL_TYPES, Q, QWeight
from .triton_base import FUSION, INTERPRET, PDL, pdl_wait
from .triton_epilogue import epilogue, from_fixed_jit, part_out, plan, split_finish

# Format ids (constexpr FMT) and each format's group width W in stored bytes / dense values.
DENSE, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS = range(10)
FMT_OF = {Q.Q8_0: Q8_0, Q.Q4_0: Q4_0, Q.Q4_1: Q4_1, Q.Q4_K: Q4_K, Q.Q5_K: Q5_K, Q.Q6_K: Q6_K, Q.MXFP4: MXFP4,
          Q.IQ4_NL: IQ4_NL, Q.IQ4_XS: IQ4_XS}
WIDTH = {DENSE: 16, Q8_0: 16, Q4_0: 16, Q4_1: 16, Q4_K: 32, Q5_K: 32, Q6_K: 16, MXFP4: 16, IQ4_NL: 16, IQ4_XS: 16}
assert set(FMT_OF) == KERNEL_TYPES
# Field order passed as pointers P0..P5 (unused ones repeat P0): each type's Format.gemv (quantize/formats).
FIELDS = {DENSE: ("w",), **{fmt: FORMATS[t].gemv for t, fmt in FMT_OF.items()}}
# (rows per program BN, groups per iteration G, warps) per format for the product: the best of a
# sweep at 8B shapes on Hopper (docs/PERFORMANCE.md).
CONFIGS = {DENSE: (2, 32, 4), Q8_0: (4, 32, 4), Q4_0: (2, 32, 2), Q4_1: (2, 32, 2),
           Q4_K: (2, 32, 4), Q5_K: (2, 32, 4), Q6_K: (4, 32, 4),
           MXFP4: (2, 32, 2),  # MXFP4: Q4_0's, its layout's twin (not swept)
           IQ4_NL: (2, 32, 2), IQ4_XS: (2, 32, 2)}  # IQ4: Q4_0's too (not swept)
if INTERPRET:  # the interpreter pays per program, not per element: few large programs
    CONFIGS = {fmt: (64, 8, 4) for fmt in CONFIGS}


@triton.jit
def int_f32(q, bias: tl.constexpr):
    """Exact float(q) - bias for int32 0 <= q < 2^23, without the slow int->float conversion:
    the bits 0x4B000000 | q are the float 2^23 + q."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def e2m1_value(q):
    """Exact float of an MXFP4 code q (int32 0..15): E2M1 doubled, 0 1 2 3 4 6 8 12 for magnitudes
    m = q & 7 (m < 2: m, else (2 + (m & 1)) << ((m >> 1) - 1)), negative for q >= 8; code 8 is +0,
    as gguf's int8 table gives it (quantize/mxfp4.KVALUES)."""
    m = q & 7
    mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    v = tl.where(q >= 8, -mag, mag)
    return int_f32(v + 12, 12.0)


@triton.jit
def iq4_value(q):
    """Exact float of KVALUES[q] for IQ4_NL / IQ4_XS codes q (int32 0..15) (quantize/iq4.KVALUES, ggml's
    kvalues_iq4nl): u = KVALUES[q] + 127 is byte q of the little-endian int64 word bytes(0 23 44 62 78
    92 105 117) for q < 8, else byte q - 8 of bytes(0 12 24 37 52 68 88 112) plus 128 (every byte below
    128: a positive int64); the value is u - 127."""
    word = tl.where(q < 8, 0x75695c4e3e2c1700, 0x7058443425180c00).to(tl.int64)
    u = ((word >> (8 * (q & 7)).to(tl.int64)) & 0xFF).to(tl.int32) + (q & 8) * 16
    return int_f32(u, 127.0)


@triton.jit
def decode_tile(FMT: tl.constexpr, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5, rows, rmask, g, gmask,
                W: tl.constexpr):
    """rows (BN,), g (G,) -> lo, hi (BN, G, W) fp32 values and their columns clo, chi (G, W).

    S0..S5: row strides (elements) of the fields P0..P5."""
    w = tl.arange(0, W)
    r = rows.to(tl.int64)[:, None, None]
    gg = g[None, :, None]
    ww = w[None, None, :]
    mask = rmask[:, None, None] & gmask[None, :, None]
    if FMT == 0:  # dense: columns 32g + w and 32g + 16 + w
        lo = tl.load(P0 + r * S0 + 32 * gg + ww, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(P0 + r * S0 + 32 * gg + 16 + ww, mask=mask, other=0.0).to(tl.float32)
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 1:  # Q8_0 (qs as uint8 bits): x = q * d, q = (b ^ 0x80) - 128
        d = tl.load(P1 + r * S1 + gg, mask=mask, other=0.0).to(tl.float32)
        blo = tl.load(P0 + r * S0 + 32 * gg + ww, mask=mask, other=0).to(tl.int32)
        bhi = tl.load(P0 + r * S0 + 32 * gg + 16 + ww, mask=mask, other=0).to(tl.int32)
        lo = int_f32(blo ^ 0x80, 128.0) * d
        hi = int_f32(bhi ^ 0x80, 128.0) * d
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 2 or FMT == 3:  # Q4_0: x = d * (q - 8); Q4_1: x = d * q + m
        qs = tl.load(P0 + r * S0 + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        d = tl.load(P1 + r * S1 + gg, mask=mask, other=0.0).to(tl.float32)
        # High nibbles stay in place (16 q) and meet d / 16: the same products, one shift fewer.
        d16 = d * 0.0625
        if FMT == 2:
            lo = d * int_f32(qs & 15, 8.0)
            hi = d16 * int_f32(qs & 0xF0, 128.0)
        else:
            m = tl.load(P2 + r * S2 + gg, mask=mask, other=0.0).to(tl.float32)
            lo = d * int_f32(qs & 15, 0.0) + m
            hi = d16 * int_f32(qs & 0xF0, 0.0) + m
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 4 or FMT == 5:  # Q4_K / Q5_K: group = 32-byte chunk c of block b, g = 4b + c
        qs = tl.load(P0 + r * S0 + 32 * gg + ww, mask=mask, other=0).to(tl.int32)
        ql = qs & 15
        qh = qs & 0xF0  # 16 q: meets d * sc / 16 below (exact: powers of two)
        if FMT == 5:
            hb = tl.load(P5 + r * S5 + 32 * (gg // 4) + ww, mask=mask, other=0).to(tl.int32)
            bit = 2 * (gg % 4)
            ql = ql | (((hb >> bit) & 1) << 4)
            qh = qh | (((hb >> (bit + 1)) & 1) << 8)
        d = tl.load(P1 + r * S1 + gg // 4, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(P2 + r * S2 + gg // 4, mask=mask, other=0.0).to(tl.float32)
        sc_lo = tl.load(P3 + r * S3 + 2 * gg, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(P3 + r * S3 + 2 * gg + 1, mask=mask, other=0).to(tl.float32)
        m_lo = tl.load(P4 + r * S4 + 2 * gg, mask=mask, other=0).to(tl.float32)
        m_hi = tl.load(P4 + r * S4 + 2 * gg + 1, mask=mask, other=0).to(tl.float32)
        lo = (d * sc_lo) * int_f32(ql, 0.0) - dmin * m_lo
        hi = ((d * sc_hi) * 0.0625) * int_f32(qh, 0.0) - dmin * m_hi
        clo = 64 * g[:, None] + w[None, :]
        chi = clo + 32
    elif FMT == 7:  # MXFP4: x = d * value(q), d = 2^(e - 128); nibbles as Q4_0's
        qs = tl.load(P0 + r * S0 + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        e = tl.load(P1 + r * S1 + gg, mask=mask, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        lo = d * e2m1_value(qs & 15)
        hi = d * e2m1_value(qs >> 4)
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    elif FMT == 8 or FMT == 9:  # IQ4_NL: x = d * KVALUES[q]; IQ4_XS: x = (d * (scale - 32)) * KVALUES[q]
        qs = tl.load(P0 + r * S0 + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        if FMT == 8:
            d = tl.load(P1 + r * S1 + gg, mask=mask, other=0.0).to(tl.float32)
        else:  # group g = 8b + j: scales_h bits 2j..2j+1 of block b's uint16, scales_l nibble j of its 4 bytes
            b = gg // 8
            j = gg % 8
            sh = tl.load(P2 + r * S2 + 2 * b + j // 4, mask=mask, other=0).to(tl.int32)
            sl = tl.load(P3 + r * S3 + 4 * b + j // 2, mask=mask, other=0).to(tl.int32)
            sc = ((sl >> (4 * (j % 2))) & 15) | (((sh >> (2 * (j % 4))) & 3) << 4)
            d = tl.load(P1 + r * S1 + b, mask=mask, other=0.0).to(tl.float32) * int_f32(sc, 32.0)
        lo = d * iq4_value(qs & 15)
        hi = d * iq4_value(qs >> 4)
        clo = 32 * g[:, None] + w[None, :]
        chi = clo + 16
    else:  # Q6_K: g = 8b + 4h + s; ql byte 16g + w holds columns 256b + 128h + 16s + w (+64 high nibble)
        ql = tl.load(P0 + r * S0 + 16 * gg + ww, mask=mask, other=0).to(tl.int32)
        b = gg // 8
        h = (gg % 8) // 4
        s = gg % 4
        hb = tl.load(P5 + r * S5 + 64 * b + 32 * h + 16 * (s % 2) + ww, mask=mask, other=0).to(tl.int32)
        shift = 2 * (s // 2)
        q_lo = (ql & 15) | (((hb >> shift) & 3) << 4)
        q_hi = (ql >> 4) | (((hb >> (shift + 4)) & 3) << 4)
        d = tl.load(P1 + r * S1 + b, mask=mask, other=0.0).to(tl.float32)
        sb = 16 * b + 8 * h + s
        sc_lo = tl.load(P3 + r * S3 + sb, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(P3 + r * S3 + sb + 4, mask=mask, other=0).to(tl.float32)
        lo = (d * sc_lo) * int_f32(q_lo, 32.0)
        hi = (d * sc_hi) * int_f32(q_hi, 32.0)
        g2 = g[:, None]
        clo = 256 * (g2 // 8) + 128 * ((g2 % 8) // 4) + 16 * (g2 % 4) + w[None, :]
        chi = clo + 64
    return lo, hi, clo, chi


@triton.jit
def row_rstd(xrow, K, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the K values at xrow."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = from_fixed_jit(tl.load(xrow + k, mask=k < K, other=0))
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _norm_w(nw_ptr, cols, cmask, NORM: tl.constexpr):
    """The RMSNorm weight at cols (BN, G, W) in fp32 with NORM (1.0 without): shared by every x row."""
    if NORM:
        return tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        return 1.0


@triton.jit
def _row_acc(acc, R: tl.constexpr, ROWS: tl.constexpr, lo, hi, x0, x_stride, clo, chi, cmask, nlo, nhi,
             NORM: tl.constexpr):
    """acc + the tile's products with x row R of the program's ROWS (a no-op for R >= ROWS). Every row
    takes the same operations on the same values as a one-row program: a verify pass of several
    tokens sums each row exactly as the decode step of that token does (speculative decoding)."""
    if R < ROWS:
        xrow = x0 + R * x_stride
        vlo = tl.load(xrow + clo, mask=cmask, other=0.0).to(tl.float32)
        vhi = tl.load(xrow + chi, mask=cmask, other=0.0).to(tl.float32)
        if NORM:
            vlo = vlo * nlo
            vhi = vhi * nhi
        acc += lo * vlo
        acc += hi * vhi
    return acc


@triton.jit
def _row_out(acc, R: tl.constexpr, ROWS: tl.constexpr, m0, x0, x_stride, rows, rmask, out_ptr, bias_ptr, res_ptr,
             N, K, out_stride, eps, ACT: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr, SPLIT: tl.constexpr):
    """Row R's sums (BN, G, W) -> its output row m0 + R (nothing for R >= ROWS)."""
    if R < ROWS:
        y = tl.sum(tl.sum(acc, 2), 1)
        if NORM:
            y = y * row_rstd(x0 + R * x_stride, K, eps, 1024)
        epilogue(y, rows, rmask, m0 + R, out_ptr, bias_ptr, res_ptr, N, out_stride, ACT, BN, GLU, HAS_BIAS,
                  HAS_RES, ROUND, SPLIT)


DENSE_ROWS = 16  # dense weights: up to this many x rows take triton_dense's tensor-core kernel (its MP)


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, res_ptr, nw_ptr, act_ptr, ws_ptr, cnt_ptr, P0, P1, P2, P3, P4, P5,
                 S0, S1, S2, S3, S4, S5, M, N, K, x_stride, out_stride, eps, groups_per_split,
                 FMT: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr,
                 GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
                 SPLIT: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = sum_k W[n, k] x[m, k] for BN rows n of ROWS (<= triton_epilogue.MAX_ROWS) x rows m
    (grid: (N / BN, M / ROWS, SPLIT)): each weight tile is decoded once for all ROWS rows.

    GLU: rows come in (gate, up) pairs; out[m, n / 2] = silu(gate) * up, each rounded like F.silu.
    SPLIT > 1: program z sums groups [z, z + 1) * groups_per_split into its slice of ws, and the last
    part adds them into out, which holds the residual (or zeros) already (split_finish); no
    rounding then."""
    pdl_wait(PDL)
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    m0 = tl.program_id(1) * ROWS
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    x0 = x_ptr + m0.to(tl.int64) * x_stride
    ngroups = K // (2 * W)
    g_lo = tl.program_id(2) * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, ngroups)
    # one accumulator per x row (a verify pass has up to MAX_ROWS of them; unused ones are compiled away)
    a0 = tl.zeros((BN, G, W), tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    zero = (rows * 0)[:, None, None]
    for g0 in range(g_lo, g_hi, G):
        g = g0 + tl.arange(0, G)
        gmask = g < g_hi
        lo, hi, clo, chi = decode_tile(FMT, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5, rows, rmask, g, gmask, W)
        # x is loaded at the tile's full (BN, G, W) shape (rows repeat the same addresses, L1 hits) so
        # that it takes the weights' register layout: a (G, W) load would be re-laid out through
        # shared memory every iteration.
        cmask = (zero == 0) & gmask[None, :, None]
        clo3 = zero + clo[None, :, :]
        chi3 = zero + chi[None, :, :]
        nlo = _norm_w(nw_ptr, clo3, cmask, NORM)
        nhi = _norm_w(nw_ptr, chi3, cmask, NORM)
        a0 = _row_acc(a0, 0, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a1 = _row_acc(a1, 1, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a2 = _row_acc(a2, 2, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a3 = _row_acc(a3, 3, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a4 = _row_acc(a4, 4, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a5 = _row_acc(a5, 5, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a6 = _row_acc(a6, 6, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
        a7 = _row_acc(a7, 7, ROWS, lo, hi, x0, x_stride, clo3, chi3, cmask, nlo, nhi, NORM)
    pout, pstride = part_out(out_ptr, out_stride, ws_ptr, M, N, SPLIT)
    _row_out(a0, 0, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a1, 1, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a2, 2, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a3, 3, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a4, 4, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a5, 5, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a6, 6, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    _row_out(a7, 7, ROWS, m0, x0, x_stride, rows, rmask, pout, bias_ptr, res_ptr, N, K, pstride,
             eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND, SPLIT)
    split_finish(ws_ptr, cnt_ptr, out_ptr, out_stride, rows, rmask, m0, M, N, ROWS, SPLIT)


@triton.jit
def _dequant_kernel(out_ptr, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5, N, K,
                    FMT: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    """out (N, K) = the decoded values (grid: (N / BN, groups per row / G))."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    g = tl.program_id(1) * G + tl.arange(0, G)
    gmask = g < K // (2 * W)
    lo, hi, clo, chi = decode_tile(FMT, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5, rows, rmask, g, gmask, W)
    base = out_ptr + rows.to(tl.int64)[:, None, None] * K
    mask = rmask[:, None, None] & gmask[None, :, None]
    ty = out_ptr.dtype.element_ty
    tl.store(base + clo[None, :, :], lo.to(ty), mask=mask)
    tl.store(base + chi[None, :, :], hi.to(ty), mask=mask)


def weight_args(w: QWeight | torch.Tensor) -> tuple[int, tuple[int, int], list[torch.Tensor], list[int]]:
    """-> (format id, (N, K), six field pointers, their row strides) for a QWeight with a kernel or a
    dense (N, K) tensor. Fields may be row views with any row stride; columns must be contiguous."""
    if isinstance(w, torch.Tensor):
        ptrs = [w] * 6
    else:
        fmt = FMT_OF[w.qtype]
        ptrs = [w.parts[name] if name else None for name in FIELDS[fmt]]
        ptrs += [None] * (6 - len(ptrs))
        ptrs = [p if p is not None else ptrs[0] for p in ptrs]
    assert all(p.stride(-1) == 1 for p in ptrs), "weight fields need contiguous columns"
    fmt = DENSE if isinstance(w, torch.Tensor) else FMT_OF[w.qtype]
    return fmt, tuple(w.shape), ptrs, [p.stride(0) for p in ptrs]


def gemv(x: torch.Tensor, w: QWeight | torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         glu: bool = False, act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
         config: tuple[int, int, int] | None = None, split: int | None = 1, inplace: bool = False,
         counters: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) = round_act(W @ x' + bias) (+ residual), or (M, N / 2) with glu.

    x' is x, or RMSNorm(x) with norm_weight (x's rstd times the norm weight, in fp32: the module's
    rounding of the normed x to the activation dtype is skipped). glu: the rows of w are interleaved
    (gate_i, up_i) and the output is silu(gate) * up. act_dtype (default: x's dtype, or norm_weight's)
    is the dtype the torch modules round activations to; outputs are rounded to it unless it is fp32.
    out_dtype defaults to the residual's dtype, else act_dtype.
    split: K is cut into this many parts (None: chosen from the grid size), for few rows, summed in
    part order by the last part to finish (split_finish); the output is then fp32 (or an int64
    fixed-point accumulator: triton_epilogue) and not rounded. inplace: add into `residual` itself.
    counters: the zeroed per-program counters of split products (split_buffers). Dense weights with
    at most DENSE_ROWS rows of x take kernels/triton_dense.py instead (tensor cores, batch-invariant;
    its own split of K, the output always finished).
    """
    x = x.contiguous()
    if isinstance(w, torch.Tensor) and x.shape[0] <= DENSE_ROWS:  # tensor cores, batch-invariant
        from .triton_dense import gemv_dense

        return gemv_dense(x, w, bias, residual, norm_weight, eps, glu, act_dtype, out_dtype, inplace)
    fmt, (n, k), ptrs, strides = weight_args(w)
    m = x.shape[0]
    act = act_dtype or (norm_weight.dtype if norm_weight is not None else x.dtype)
    bn, g, warps = config or CONFIGS[fmt]
    bn = max(bn, 2) if glu else bn
    L = plan(m, n, bn, k // (2 * WIDTH[fmt]), g, glu, split, residual, inplace, out_dtype, act, x.device, counters)
    out = L.out
    _gemv_kernel[L.grid](
        x, out, bias if bias is not None else out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, L.act_ref, L.ws, L.counters, *ptrs, *strides,
        m, n, k, x.stride(0), out.stride(0), eps, L.per_split,
        FMT=fmt, W=WIDTH[fmt], BN=bn, G=g, NORM=norm_weight is not None, GLU=glu,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ROUND=act != torch.float32,
        SPLIT=L.split, ROWS=L.rows, PDL=PDL, num_warps=warps, launch_pdl=PDL, **FUSION
    )
    return out


def dequantize(w: QWeight, dtype: torch.dtype = torch.bfloat16, bn: int = 16, g: int = 16) -> torch.Tensor:
    """QWeight with a kernel -> dense (N, K) of `dtype` (exactly dequantize_torch's values in fp32)."""
    fmt, (n, k), ptrs, strides = weight_args(w)
    bn = 128 if INTERPRET else bn
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    groups = k // (2 * WIDTH[fmt])
    grid = (triton.cdiv(n, bn), triton.cdiv(groups, g))
    _dequant_kernel[grid](out, *ptrs, *strides, n, k, FMT=fmt, W=WIDTH[fmt], BN=bn, G=g, num_warps=4, **FUSION)
    return out
