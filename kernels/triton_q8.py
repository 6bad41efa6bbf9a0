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

Units: a program takes BN rows and walks K in units (Q8_0/Q4_0/MXFP4/IQ4_NL: a 32-value block; IQ4_XS:
a 32-value sub-block; Q4_K: a 64-value chunk of a super-block, whose low nibbles are sub-block 2u and
high nibbles 2u + 1; Q6_K: a 128-value half of a super-block). MXFP4's and IQ4's 4-bit codes become
their int8 table values (E2M1 doubled; ggml's kvalues_iq4nl) by byte permutes before the dot products.
The weights are block-major (QWeight.to_blocks): the threads of a warp take consecutive rows of the
same units, so their 16-byte word loads form one contiguous run and the x words they need are the same
(a broadcast). Against a row-major layout, where every thread fetched its own x words, this took an 8B
gate/up Q4_0 product from about half of copy bandwidth to over four fifths (docs/PERFORMANCE.md).
Under TRITON_INTERPRET (CPU tests) dp4a, an inline PTX instruction, is emulated by shifts (and IQ4's
table lookup by _table16_dot): the integer sums are the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.quantize import iq4, mxfp4
from localllm.quantize.formats import FORMATS

from .qweight import INT_DOT_TYPES, Q, QWeight
from .triton_base import INTERPRET, PDL, load_even as _ld, pdl_trigger, pdl_wait
from .triton_epilogue import epilogue, from_fixed_jit, gate_act, part_out, plan, split_finish
from .triton_gemv import row_rstd
from .triton_mma import gemv_mma, takes as mma_takes

# Weight fields per type (P0..P4; word fields viewed as int32) and values per unit: each type's
# Format.int_dot (quantize/formats).
FIELDS = {t: FORMATS[t].int_dot.args for t in INT_DOT_TYPES}
WORDS = ("qs", "ql", "qh")
FMT = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_K: 2, Q.Q6_K: 3, Q.MXFP4: 4, Q.IQ4_NL: 5, Q.IQ4_XS: 6}
UNIT = {t: FORMATS[t].int_dot.unit for t in INT_DOT_TYPES}
TYPES = INT_DOT_TYPES
assert set(FMT) == TYPES
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
M4, M30 = tl.constexpr(0x0F0F0F0F), tl.constexpr(0x30303030)  # nibble and Q6_K high-bit masks
B0, B01, B012 = tl.constexpr(0x01010101), tl.constexpr(0x03030303), tl.constexpr(0x07070707)  # per-byte bits


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
def _quant_act_kernel(x_ptr, nw_ptr, act_ptr, q_ptr, d_ptr, s_ptr, K, x_stride, eps, NORM: tl.constexpr,
                      GLU: tl.constexpr, BLOCKS: tl.constexpr, RSTD_BLOCK: tl.constexpr, WHOLE: tl.constexpr,
                      PDL: tl.constexpr, GELU: tl.constexpr = False):
    """Row m, 32-value blocks [BLOCKS * j, BLOCKS * (j + 1)) of x (grid: (M, blocks / BLOCKS)) -> q, d, s
    as quantize.act.quantize_act of x; NORM: of x * rstd(x) * norm weight, in fp32 (WHOLE: the program
    holds the whole row and takes rstd from the values it loaded, one pass over x instead of two,
    about a third faster); GLU: x is (M, 2K)
    fp32 sums of interleaved (gate, up) rows, the values are silu(gate) * up rounded like model.py's
    modules in the activation dtype, and the sums are cleared (zeros) for the next accumulation.
    The next kernel (a product, loading weights before its wait) is let be scheduled at the start:
    doing so only once x's loads were issued was slower (docs/PERFORMANCE.md)."""
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bm = b < K // 32
    cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
    pdl_trigger(PDL)
    if NORM:  # the norm weight is never written: loaded before the wait
        nw = tl.load(nw_ptr + cols, mask=bm[:, None], other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if GLU:
        src = x_ptr + m * x_stride + 2 * cols
        v = _glu_values(src, bm[:, None], act_ptr.dtype.element_ty, GELU)
    else:
        v = from_fixed_jit(tl.load(x_ptr + m * x_stride + cols, mask=bm[:, None], other=0))
    if NORM:
        if WHOLE:
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, 1), 0) / K + eps)
        else:
            rstd = row_rstd(x_ptr + m * x_stride, K, eps, RSTD_BLOCK)
        v = v * rstd * nw
    store_blocks(v, b, bm, q_ptr + m * K, d_ptr + m * (K // 32), s_ptr + m * (K // 16), BLOCKS)


@triton.jit
def _glu_values(src, mask, ACT: tl.constexpr, GELU: tl.constexpr = False):
    """silu(gate) * up of the interleaved (gate, up) sums at src, src + 1 (fp32, or int64 fixed point)
    where mask, every op rounded to ACT as model.py's modules round it; the sums are cleared (zeros)
    for the next accumulation. Loads bypass L1 (.cg): other programs' atomics wrote the sums."""
    gate = from_fixed_jit(tl.load(src, mask=mask, other=0, cache_modifier=".cg")).to(ACT).to(tl.float32)
    up = from_fixed_jit(tl.load(src + 1, mask=mask, other=0, cache_modifier=".cg")).to(ACT).to(tl.float32)
    tl.store(src, tl.zeros(gate.shape, src.dtype.element_ty), mask=mask)
    tl.store(src + 1, tl.zeros(up.shape, src.dtype.element_ty), mask=mask)
    silu = gate_act(gate, GELU).to(ACT).to(tl.float32)
    return (silu * up).to(ACT).to(tl.float32)


@triton.jit
def store_blocks(v, b, bm, q_row, d_row, s_row, BLOCKS: tl.constexpr):
    """v (BLOCKS, 32) fp32 values of 32-value blocks b of one row (those where bm) -> its q, d, s
    (quantize.act's rule)."""
    d = tl.div_rn(tl.max(tl.abs(v), 1), 127.0)
    inv = tl.where(d == 0, 0.0, tl.div_rn(1.0, tl.where(d == 0, 1.0, d)))
    t = v * inv[:, None]
    a = tl.abs(t)  # roundf(t), exactly as quantize.simple.round_away
    f = tl.floor(a)
    q = (f + tl.floor(2 * (a - f))).to(tl.int32)
    q = tl.where(t < 0, -q, q)
    cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
    tl.store(q_row + cols, q.to(tl.int8), mask=bm[:, None])
    tl.store(d_row + b, d, mask=bm)
    lo = tl.arange(0, 32)[None, :] < 16  # the 16-value sums, as two masked row sums (no reshape: no
    tl.store(s_row + 2 * b, tl.sum(tl.where(lo, q, 0), 1), mask=bm)  # layout change through shared memory)
    tl.store(s_row + 2 * b + 1, tl.sum(tl.where(lo, 0, q), 1), mask=bm)


def act_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (q int8 (m, k), d fp32 (m, k / 32), s int32 (m, k / 16)) for a quantized activation."""
    return (torch.empty((m, k), dtype=torch.int8, device=device),
            torch.empty((m, k // 32), dtype=torch.float32, device=device),
            torch.empty((m, k // 16), dtype=torch.int32, device=device))


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
def _e2m1_bytes(c):
    """int32 words of four MXFP4 codes (a byte each, 0..15) -> words of their int8 values (E2M1 doubled:
    0 1 2 3 4 6 8 12, negative for codes >= 8, code 8 +0; quantize/mxfp4.KVALUES), computed within each
    byte (no carries across): for the magnitude m = c & 7, m + (m >= 4 ? m & 3 : 0) + (m == 7 ? 2 : 0);
    a nonzero value with the sign bit negated as (v ^ 0xFF) + 1."""
    m = c & B012
    big = ((m >> 2) & B0) * 255  # 0xFF where m >= 4
    seven = m & (m >> 1) & (m >> 2) & B0
    mag = m + (m & B01 & big) + (seven << 1)
    nonzero = (mag | (mag >> 1) | (mag >> 2) | (mag >> 3)) & B0
    neg = ((c >> 3) & nonzero) * 255
    return (mag ^ neg) + (neg & B0)


@triton.jit
def _table16_values(q, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr):
    """4-bit codes q (int32 0..15) -> their int8 values (int32): byte q of the 16-byte table whose
    little-endian int32 words are T0..T3 (table16_words), sign-extended."""
    word = tl.where(q < 8, tl.where(q < 4, T0, T1), tl.where(q < 12, T2, T3))
    return (word << (24 - 8 * (q & 3))) >> 24


@triton.jit
def _table16_dot(w, x, SHIFT: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                 T3: tl.constexpr):
    """The interpreter's form of dp4a(_table16_lookup(w)[SHIFT // 4], x) summed over the last axis: words
    w (BK, BN, 4) of codes (nibbles SHIFT + 8k, k = 0..3, of each word) and x (BK, 1, 4) of int8s ->
    (BK, BN, 1) int32 sums of value(code k) x byte k. The bytes take a fourth axis, so the interpreter
    runs a few ops on larger arrays instead of ~40 on small ones (the same integer sums)."""
    k = 8 * tl.arange(0, 4)
    v = _table16_values((w[:, :, :, None] >> (k + SHIFT)) & 15, T0, T1, T2, T3)
    xb = (x[:, :, :, None] << (24 - k)) >> 24
    return tl.sum(tl.sum(v * xb, 3), 2, keep_dims=True)


def table16_words(values) -> tuple[int, int, int, int]:
    """A 16-entry int8 table (code -> value) -> its four little-endian words, as signed int32."""
    words = [sum((v & 0xFF) << (8 * i) for i, v in enumerate(values[4 * k:4 * k + 4])) for k in range(4)]
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


# A table lookup by byte permutes (PTX prmt: each 4-bit selector picks one of 8 bytes of two registers;
# its bit 3 would replicate the sign, so selectors are masked to 3 bits): values of codes 0-7 from one
# 8-byte table (registers p0, p1: table16_words 0, 1), of codes 8-15 from another (n0, n1: words 2, 3),
# and bit 3 of each code picks between the two results. MXFP4's table: about 15 instructions for a
# word's 8 codes against ~36 for _e2m1_bytes on both halves: the MXFP4 products were bound by this
# arithmetic (bench/moe_products.py). Same values (tests/gpu: the products vs the decoded reference;
# test_triton_q8 runs this PTX in a Python model of its instructions); llama.cpp's CUDA
# get_int_from_table_16 works the same way, for IQ4_NL's table too.
TABLE16_PTX = """{{
        .reg .b32 m, sel, p0, p1, n0, n1, l, h, t0, t1, c;
        mov.b32 p0, {0}; mov.b32 p1, {1}; mov.b32 n0, {2}; mov.b32 n1, {3};
        and.b32 m, $2, 0x77777777;
        and.b32 sel, $2, 0x88888888;
        shr.b32 sel, sel, 1;
        or.b32 sel, sel, 0x32103210;
        prmt.b32 l, p0, p1, m;
        prmt.b32 h, n0, n1, m;
        prmt.b32 t0, l, h, sel;
        shr.b32 m, m, 16;
        shr.b32 sel, sel, 16;
        prmt.b32 l, p0, p1, m;
        prmt.b32 h, n0, n1, m;
        prmt.b32 t1, l, h, sel;
        mov.b32 c, 0x6420;
        prmt.b32 $0, t0, t1, c;
        mov.b32 c, 0x7531;
        prmt.b32 $1, t0, t1, c;
        }}"""


def table16_ptx(values) -> str:
    """TABLE16_PTX for a 16-entry int8 table (code -> value)."""
    return TABLE16_PTX.format(*(f"0x{w & 0xFFFFFFFF:08X}" for w in table16_words(values)))


E2M1_PTX = tl.constexpr(table16_ptx(mxfp4.KVALUES))
IQ4_PTX = tl.constexpr(table16_ptx(iq4.KVALUES))
IQ4_WORDS = table16_words(iq4.KVALUES)
IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3 = (tl.constexpr(w) for w in IQ4_WORDS)


@triton.jit
def _table16_lookup(w, PTX: tl.constexpr):
    """A word of 8 codes (each byte: a low-nibble and a high-nibble code) -> (int8 values of the low
    nibbles, of the high nibbles) from the table PTX was made for (table16_ptx)."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _e2m1_lookup(w):
    """A word of 8 MXFP4 codes -> (int8 values of the low nibbles, of the high nibbles):
    _e2m1_bytes(w & M4), _e2m1_bytes((w >> 4) & M4)."""
    return _table16_lookup(w, E2M1_PTX)


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
            v_lo, v_hi = _e2m1_lookup(w)
        else:
            v_lo, v_hi = _e2m1_bytes(w & M4), _e2m1_bytes((w >> 4) & M4)
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
            v_lo, v_hi = _table16_lookup(w, IQ4_PTX)
            s = tl.sum(_dp4a(v_hi, x_hi, _dp4a(v_lo, x_lo, tl.zeros_like(w), ASM), ASM), 2, keep_dims=True)
        else:
            s = (_table16_dot(w, x_lo, 0, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3)
                 + _table16_dot(w, x_hi, 4, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3))
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


WHOLE_ROW_BLOCKS = 256  # norm rows of up to this many 32-value blocks take one program (K <= 8192)
WHOLE_ROW_WARPS = 8


def quantize_act(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 glu_dtype: torch.dtype | None = None, blocks: int = 16,
                 gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q int8 (M, K), d fp32 (M, K / 32), s int32 (M, K / 16)): quantize.act.quantize_act
    of x, or of RMSNorm(x) (x * rstd * weight in fp32) with norm_weight. glu_dtype: x is instead the
    (M, 2K) sums of interleaved gate/up rows (gemv_q8 into a zeroed buffer; fp32, or int64 fixed
    point: triton_epilogue.FIXED_ONE), the values are silu(gate) * up rounded to glu_dtype as the
    modules round them (gelu: gelu_tanh(gate) * up), and x is zeroed as it is read."""
    x = x if glu_dtype is not None else x.contiguous()
    m, k = x.shape[0], x.shape[1] // (2 if glu_dtype is not None else 1)
    assert glu_dtype is None or (x.dtype in (torch.float32, torch.int64) and x.stride(1) == 1)
    q, d, s = act_buffers(m, k, x.device)
    act_ref = torch.empty(1, dtype=glu_dtype or torch.float32, device=x.device)
    blocks, warps = 64 if INTERPRET else blocks, 4
    if norm_weight is not None and k // 32 <= WHOLE_ROW_BLOCKS:  # one program a row (WHOLE)
        blocks, warps = triton.next_power_of_2(k // 32), WHOLE_ROW_WARPS
    grid = (m, triton.cdiv(k // 32, blocks))
    _quant_act_kernel[grid](x, norm_weight if norm_weight is not None else x, act_ref, q, d, s, k, x.stride(0), eps,
                            NORM=norm_weight is not None, GLU=glu_dtype is not None, BLOCKS=blocks,
                            RSTD_BLOCK=min(triton.next_power_of_2(k), 8192), WHOLE=blocks * 32 >= k,
                            PDL=PDL, GELU=gelu, num_warps=warps, launch_pdl=PDL)
    return q, d, s


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
        num_warps=warps, launch_pdl=PDL,
    )
    return out
