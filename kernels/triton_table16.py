"""4-bit weight codes -> their int8 values, for the integer-dot products (kernels/triton_units.py):
MXFP4's codes (E2M1 doubled, quantize/mxfp4.KVALUES) and IQ4_NL / IQ4_XS's (ggml's kvalues_iq4nl,
quantize/iq4.KVALUES) become their int8 table values by byte permutes before the dot products. On the
GPU a 16-entry table lookup in PTX (TABLE16_PTX); under TRITON_INTERPRET arithmetic within each byte
(e2m1_bytes) or a lookup in the table's words (table16_dot): the same values (tests/test_triton_q8.py
checks both against gguf's tables).
"""

from __future__ import annotations

import triton
import triton.language as tl

from localllm.quantize import iq4, mxfp4

B0, B01, B012 = tl.constexpr(0x01010101), tl.constexpr(0x03030303), tl.constexpr(0x07070707)  # per-byte bits


@triton.jit
def e2m1_bytes(c):
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
def table16_dot(w, x, SHIFT: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                 T3: tl.constexpr):
    """The interpreter's form of dp4a(table16_lookup(w)[SHIFT // 4], x) summed over the last axis: words
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
# word's 8 codes against ~36 for e2m1_bytes on both halves: the MXFP4 products were bound by this
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
def table16_lookup(w, PTX: tl.constexpr):
    """A word of 8 codes (each byte: a low-nibble and a high-nibble code) -> (int8 values of the low
    nibbles, of the high nibbles) from the table PTX was made for (table16_ptx)."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def e2m1_lookup(w):
    """A word of 8 MXFP4 codes -> (int8 values of the low nibbles, of the high nibbles):
    e2m1_bytes(w & 0x0F0F0F0F), e2m1_bytes((w >> 4) & 0x0F0F0F0F)."""
    return table16_lookup(w, E2M1_PTX)
