"""Weight bytes widened to the int8 values kernels/triton_mma.py's dots take: Q4_0 / Q4_K nibbles and Q6_K's
6-bit values (Q4_0's minus 8, Q6_K's minus 32), on the GPU by inline PTX on 4 bytes a register (every
operation stays inside its byte), under the interpreter elementwise (the same values:
tests/test_triton_mma.py runs the PTX in tests/ptx_model.py's model of its instructions).
"""

from __future__ import annotations

import triton
import triton.language as tl

# LLVM widens each uint8 alone (a byte extract, shift, mask and repack each: ~3.5 SASS instructions a
# byte in the first tensor-core kernel); these take 1-3 a word of 4 (Triton's pack=4).
NIB_LO = tl.constexpr("and.b32 $0, $1, 0x0F0F0F0F;")
NIB_HI = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }")
# Q4_0: bytes $1 -> their low nibbles where mask $2 is 0x00, high ones where it is 0xFF, minus 8 (each
# byte: (v + 128 - 8) ^ 128, no borrow across bytes)
Q4_0_PTX = tl.constexpr("{ .reg .b32 l, h; and.b32 l, $1, 0x0F0F0F0F; shr.b32 h, $1, 4; and.b32 h, h, 0x0F0F0F0F;"
                        " xor.b32 h, h, l; and.b32 h, h, $2; xor.b32 h, h, l; or.b32 h, h, 0x80808080;"
                        " sub.u32 h, h, 0x08080808; xor.b32 $0, h, 0x80808080; }")
AND = tl.constexpr("and.b32 $0, $1, $2;")
# Q6_K quarter t: (the nibble 4 (t // 2) of ql $1 | bits 2t, 2t + 1 of qh $2 at 4, 5) - 32
Q6_PTX = "{{ .reg .b32 a, h; shr.b32 a, $1, {0}; and.b32 a, a, 0x0F0F0F0F; shr.b32 h, $2, {1}; and.b32 h, h, 0x03030303;" \
         " shl.b32 h, h, 4; or.b32 a, a, h; or.b32 a, a, 0x80808080; sub.u32 a, a, 0x20202020; xor.b32 $0, a, 0x80808080; }}"
Q6_T0, Q6_T1, Q6_T2, Q6_T3 = (tl.constexpr(Q6_PTX.format(4 * (t // 2), 2 * t)) for t in range(4))


@triton.jit
def packed(ASM_STR: tl.constexpr, a, b):
    """int8 result of PTX ASM_STR on 4 bytes a register of a (and b, where used)."""
    if b is None:
        return tl.inline_asm_elementwise(ASM_STR, "=r,r", [a], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(ASM_STR, "=r,r,r", [a, b], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def nibbles(b, H: tl.constexpr, ASM: tl.constexpr):
    """uint8 bytes b -> their low (H = 0) or high (1) nibbles as int8."""
    if ASM:
        if H == 0:
            return packed(NIB_LO, b, None)
        else:
            return packed(NIB_HI, b, None)
    else:
        return ((b >> (4 * H)) & 15).to(tl.int8)


@triton.jit
def q6_values(ql, qh, keep, T: tl.constexpr, ASM: tl.constexpr):
    """Q6_K quarter T's 6-bit values minus 32 (int8 -32..31) from its ql and qh bytes, where keep (0xFF /
    0x00 bytes; zeros elsewhere)."""
    if ASM:
        if T == 0:
            q = packed(Q6_T0, ql, qh)
        elif T == 1:
            q = packed(Q6_T1, ql, qh)
        elif T == 2:
            q = packed(Q6_T2, ql, qh)
        else:
            q = packed(Q6_T3, ql, qh)
        return packed(AND, q, keep)
    else:
        q = ((ql.to(tl.int32) >> (4 * (T // 2))) & 15) | (((qh.to(tl.int32) >> (2 * T)) & 3) << 4)
        return ((q - 32) & keep.to(tl.int32)).to(tl.int8)
