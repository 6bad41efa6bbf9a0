"""The units of the integer-dot products, per weight type: the fields a unit loads (weight_args,
unit_weights) and its integer dot products with the quantized x, block scales applied (unit_dot). The
decode products (kernels/triton_q8.py) and the MoE products (kernels/triton_moe.py) run them.

A program takes BN rows and walks K in units (Q8_0/Q4_0/MXFP4/IQ4_NL: a 32-value block; IQ4_XS:
a 32-value sub-block; Q4_K: a 64-value chunk of a super-block, whose low nibbles are sub-block 2u and
high nibbles 2u + 1; Q6_K: a 128-value half of a super-block). MXFP4's and IQ4's 4-bit codes become
their int8 table values (kernels/triton_table16.py) before the dot products.
Under TRITON_INTERPRET (CPU tests) dp4a, an inline PTX instruction, is emulated by shifts (and IQ4's
table lookup by table16_dot): the integer sums are the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.quantize.formats import FORMATS

from .qweight import INT_DOT_TYPES, Q, QWeight
from .triton_base import load_even as _ld
from .triton_table16 import (IQ4_PTX, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3, e2m1_bytes, e2m1_lookup, table16_dot,
                             table16_lookup)

# Weight fields per type (P0..P4; word fields viewed as int32) and values per unit: each type's
# Format.int_dot (quantize/formats).
FIELDS = {t: FORMATS[t].int_dot.args for t in INT_DOT_TYPES}
WORDS = ("qs", "ql", "qh")
FMT = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_K: 2, Q.Q6_K: 3, Q.MXFP4: 4, Q.IQ4_NL: 5, Q.IQ4_XS: 6}
UNIT = {t: FORMATS[t].int_dot.unit for t in INT_DOT_TYPES}
TYPES = INT_DOT_TYPES
assert set(FMT) == TYPES
M4, M30 = tl.constexpr(0x0F0F0F0F), tl.constexpr(0x30303030)  # nibble and Q6_K high-bit masks


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the sum of the four products of the signed bytes of a and b (int32 words)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for j in tl.static_range(4):
            c += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return c


@triton.jit
def unit_weights(FMT: tl.constexpr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, r3, m3, EVEN: tl.constexpr):
    """The weight fields of units u3 (BK, 1, 1) of rows r3 (1, BN, 1) (row offsets: row * step), as a
    tuple for unit_dot. Fields are block-major: P + unit * U + row * (elements per unit row) + e; word
    loads are (BK, BN, 4): one 16-byte vector per thread. Weights are never written, so a product may
    load them before its PDL wait (PRELOAD)."""
    j = tl.arange(0, 4)[None, None, :]
    if FMT == 0:  # Q8_0: 8 words of int8 quants per block, its scale
        return (_ld(P0 + u3 * U0 + r3 * 8 + j, m3, EVEN), _ld(P0 + u3 * U0 + r3 * 8 + 4 + j, m3, EVEN),
                _ld(P1 + u3 * U1 + r3, m3, EVEN))
    elif FMT == 1 or FMT == 4 or FMT == 5:  # Q4_0 / MXFP4 / IQ4_NL: 4 words of nibbles per block, its
        return _ld(P0 + u3 * U0 + r3 * 4 + j, m3, EVEN), _ld(P1 + u3 * U1 + r3, m3, EVEN)  # scale (d / E8M0 e)
    elif FMT == 6:  # IQ4_XS sub-block u: 4 words of nibbles, the super-block's d, the scales_h / scales_l
        return (_ld(P0 + u3 * U0 + r3 * 4 + j, m3, EVEN), _ld(P1 + (u3 // 8) * U1 + r3, m3, EVEN),  # bytes
                _ld(P2 + (u3 // 4) * U2 + r3, m3, EVEN), _ld(P3 + (u3 // 2) * U3 + r3, m3, EVEN))  # with its scale
    elif FMT == 2:  # Q4_K chunk u: 8 words, the super-block's d and dmin, sub-blocks 2u, 2u + 1's sc and mn
        sb = 2 * u3
        return (_ld(P0 + u3 * U0 + r3 * 8 + j, m3, EVEN), _ld(P0 + u3 * U0 + r3 * 8 + 4 + j, m3, EVEN),
                _ld(P1 + (u3 // 4) * U1 + r3, m3, EVEN), _ld(P2 + (u3 // 4) * U2 + r3, m3, EVEN),
                _ld(P3 + sb * U3 + r3, m3, EVEN), _ld(P4 + sb * U4 + r3, m3, EVEN),
                _ld(P3 + (sb + 1) * U3 + r3, m3, EVEN), _ld(P4 + (sb + 1) * U4 + r3, m3, EVEN))
    else:  # Q6_K half u: ql words 4k + j and 8 + 4k + j, qh words 4k + j (k = 0, 1), d, 8 group scales
        g = 8 * u3
        return (_ld(P0 + u3 * U0 + r3 * 16 + j, m3, EVEN), _ld(P0 + u3 * U0 + r3 * 16 + 8 + j, m3, EVEN),
                _ld(P2 + u3 * U2 + r3 * 8 + j, m3, EVEN), _ld(P0 + u3 * U0 + r3 * 16 + 4 + j, m3, EVEN),
                _ld(P0 + u3 * U0 + r3 * 16 + 12 + j, m3, EVEN), _ld(P2 + u3 * U2 + r3 * 8 + 4 + j, m3, EVEN),
                _ld(P1 + (u3 // 2) * U1 + r3, m3, EVEN),
                _ld(P3 + g * U3 + r3, m3, EVEN), _ld(P3 + (g + 1) * U3 + r3, m3, EVEN),
                _ld(P3 + (g + 2) * U3 + r3, m3, EVEN), _ld(P3 + (g + 3) * U3 + r3, m3, EVEN),
                _ld(P3 + (g + 4) * U3 + r3, m3, EVEN), _ld(P3 + (g + 5) * U3 + r3, m3, EVEN),
                _ld(P3 + (g + 6) * U3 + r3, m3, EVEN), _ld(P3 + (g + 7) * U3 + r3, m3, EVEN))


@triton.jit
def unit_dot(FMT: tl.constexpr, W, xq, xd, xs, u3, um3, ASM: tl.constexpr, EVEN: tl.constexpr):
    """W: unit_weights's fields of units u3 -> (BK, BN, 1) fp32 sums of W x over each unit. xq: int32 words
    of the quantized x row (loaded (BK, 1, 4), the same for every thread), xd its block scales, xs its
    16-value sums."""
    j = tl.arange(0, 4)[None, None, :]
    if FMT == 0:  # Q8_0: w = d q
        s = _dp4a(W[0], _ld(xq + 8 * u3 + j, um3, EVEN), tl.zeros_like(W[0]), ASM)
        s = _dp4a(W[1], _ld(xq + 8 * u3 + 4 + j, um3, EVEN), s, ASM)
        return tl.sum(s, 2, keep_dims=True).to(tl.float32) * (W[2].to(tl.float32) * _ld(xd + u3, um3, EVEN))
    elif FMT == 1:  # Q4_0: low nibbles values 0-15, high 16-31; w = d (q - 8)
        w = W[0]
        s = _dp4a(w & M4, _ld(xq + 8 * u3 + j, um3, EVEN), tl.zeros_like(w), ASM)
        s = tl.sum(_dp4a((w >> 4) & M4, _ld(xq + 8 * u3 + 4 + j, um3, EVEN), s, ASM), 2, keep_dims=True)
        sx = _ld(xs + 2 * u3, um3, EVEN) + _ld(xs + 2 * u3 + 1, um3, EVEN)
        return (s - 8 * sx).to(tl.float32) * (W[1].to(tl.float32) * _ld(xd + u3, um3, EVEN))
    elif FMT == 2:  # Q4_K chunk u: w = d sc q - dmin mn per 32-value sub-block (2u: low nibbles)
        s_lo = tl.zeros_like(W[0])
        s_hi = s_lo
        for h in tl.static_range(2):
            w = W[h]
            s_lo = _dp4a(w & M4, _ld(xq + 16 * u3 + 4 * h + j, um3, EVEN), s_lo, ASM)
            s_hi = _dp4a((w >> 4) & M4, _ld(xq + 16 * u3 + 8 + 4 * h + j, um3, EVEN), s_hi, ASM)
        d, dmin = W[2].to(tl.float32), W[3].to(tl.float32)
        y = tl.zeros(d.shape, tl.float32)
        for h in tl.static_range(2):
            s = tl.sum(s_lo if h == 0 else s_hi, 2, keep_dims=True)
            sb = 2 * u3 + h
            sc, mn = W[4 + 2 * h].to(tl.int32), W[5 + 2 * h].to(tl.int32)
            sx = _ld(xs + 2 * sb, um3, EVEN) + _ld(xs + 2 * sb + 1, um3, EVEN)
            part = d * (s * sc).to(tl.float32) - dmin * (sx * mn).to(tl.float32)
            y += part * _ld(xd + sb, um3, EVEN)
        return y
    elif FMT == 4:  # MXFP4: low nibbles values 0-15, high 16-31; w = 2^(e - 128) value(q)
        w = W[0]
        if ASM:
            v_lo, v_hi = e2m1_lookup(w)
        else:
            v_lo, v_hi = e2m1_bytes(w & M4), e2m1_bytes((w >> 4) & M4)
        s = _dp4a(v_lo, _ld(xq + 8 * u3 + j, um3, EVEN), tl.zeros_like(w), ASM)
        s = tl.sum(_dp4a(v_hi, _ld(xq + 8 * u3 + 4 + j, um3, EVEN), s, ASM), 2, keep_dims=True)
        e = W[1].to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        return s.to(tl.float32) * (d * _ld(xd + u3, um3, EVEN))
    elif FMT == 5 or FMT == 6:
        # IQ4_NL: w = d KVALUES[q]; IQ4_XS: w = (d (scale - 32)) KVALUES[q], scale sub-block u's 6 bits
        # (low 4: nibble u % 2 of its scales_l byte, high 2: bits 2 (u % 4).. of its scales_h byte).
        # Low nibbles values 0-15, high 16-31.
        w = W[0]
        x_lo, x_hi = _ld(xq + 8 * u3 + j, um3, EVEN), _ld(xq + 8 * u3 + 4 + j, um3, EVEN)
        if ASM:
            v_lo, v_hi = table16_lookup(w, IQ4_PTX)
            s = tl.sum(_dp4a(v_hi, x_hi, _dp4a(v_lo, x_lo, tl.zeros_like(w), ASM), ASM), 2, keep_dims=True)
        else:
            s = (table16_dot(w, x_lo, 0, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3)
                 + table16_dot(w, x_hi, 4, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3))
        d = W[1].to(tl.float32)
        if FMT == 6:
            sc = ((W[3].to(tl.int32) >> (4 * (u3 % 2))) & 15) | (((W[2].to(tl.int32) >> (2 * (u3 % 4))) & 3) << 4)
            d = d * (sc - 32).to(tl.float32)  # exact: an fp16 times a 6-bit integer
        return s.to(tl.float32) * (d * _ld(xd + u3, um3, EVEN))
    else:  # Q6_K half u: w = d sc (q - 32)
        d = W[6].to(tl.float32)
        y = tl.zeros(d.shape, tl.float32)
        for k in tl.static_range(2):  # k: the 16-value group of each quarter
            ql_a, ql_b, qh = W[3 * k], W[3 * k + 1], W[3 * k + 2]
            for t in tl.static_range(4):  # quarter t: values 32t + 16k + 4j of the half
                if t == 0:
                    q = (ql_a & M4) | ((qh << 4) & M30)
                elif t == 1:
                    q = (ql_b & M4) | ((qh << 2) & M30)
                elif t == 2:
                    q = ((ql_a >> 4) & M4) | (qh & M30)
                else:
                    q = ((ql_b >> 4) & M4) | ((qh >> 2) & M30)
                a = tl.sum(_dp4a(q, _ld(xq + 32 * u3 + 8 * t + 4 * k + j, um3, EVEN), tl.zeros_like(q), ASM), 2,
                           keep_dims=True)
                g = 8 * u3 + 2 * t + k
                sc = W[7 + 2 * t + k].to(tl.int32)
                y += (sc * (a - 32 * _ld(xs + g, um3, EVEN))).to(tl.float32) * _ld(xd + 4 * u3 + t, um3, EVEN)
        return d * y


def weight_args(w: QWeight) -> tuple[list[torch.Tensor], list[int], int]:
    """Block-major w -> the five field tensors (word fields viewed as int32, unused ones repeating the
    first), their unit strides (elements) and the row step."""
    assert w.blocks, "the integer-dot kernels take block-major weights (QWeight.to_blocks)"
    ptrs = [w.parts[name].view(torch.int32) if name in WORDS else w.parts[name] if name else None
            for name in FIELDS[w.qtype]]
    ptrs = [p if p is not None else ptrs[0] for p in ptrs]
    per_row = [p.shape[2] for p in ptrs]
    steps = {p.stride(1) // c for p, c in zip(ptrs, per_row)}
    assert all(p.stride(2) == 1 for p in ptrs) and len(steps) == 1, "fields need one row step, contiguous units"
    return ptrs, [p.stride(0) for p in ptrs], steps.pop()
