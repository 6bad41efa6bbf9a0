"""Torch decoders of the GGUF block formats: the reference that kernels are checked against.

`dequantize_torch(data, qtype)` gives exactly the float32 values of `gguf.quants.dequantize`: each
decoder repeats gguf-py's arithmetic in the same order (d*sc first, then *q, then -m), so every value
is bit-identical, on any device. Each format's bit layout is drawn above its decoder. Byte offsets
are within one block; "q[e]" is the quant of value e of the block; fp16 fields are little-endian.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from .formats import BLOCK_SIZES, check_type

Q = gguf.GGMLQuantizationType
QK_K = 256


def dequantize_torch(data: np.ndarray | torch.Tensor, qtype: Q) -> torch.Tensor:
    """Raw GGUF data (rows, bytes per row), uint8 (or F32/F16 typed) -> float32 (rows, cols)."""
    check_type(qtype)
    raw = torch.as_tensor(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().view(torch.uint8)
    rows = raw.shape[0] if raw.dim() > 1 else 1
    block, nbytes = BLOCK_SIZES[qtype]
    blocks = raw.reshape(-1, nbytes)
    values = DECODERS[qtype](blocks)
    return values.reshape(rows, -1)


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(B, 1) float32 of the fp16 at this byte offset of each block."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) bytes -> (B, ..., 2, n): low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def bit_planes(bytes_: torch.Tensor, nbits: int) -> torch.Tensor:
    """(B, n) bytes -> (B, 8 // nbits, n): field k of every byte, k = 0 at the low bits."""
    shifts = torch.arange(0, 8, nbits, device=bytes_.device, dtype=torch.uint8)
    return (bytes_.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << nbits) - 1)


# ---- F32, F16, BF16: one value per "block"

def decode_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def decode_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def decode_bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an fp32: widen the int16 and shift it up.
    return (b.contiguous().view(torch.int16).int() << 16).view(torch.float32)


# ---- Q8_0: 34 bytes, 32 values
#   0..1  d (fp16)
#   2..33 q[0..31] (int8)          x = q * d

def decode_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * fp16_field(b, 0)


# ---- Q4_0: 18 bytes, 32 values
#   0..1  d (fp16)
#   2..17 qs[j] = q[j] | q[j+16] << 4     x = d * (q - 8)

def decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return fp16_field(b, 0) * q.float()


# ---- Q4_1: 20 bytes, 32 values
#   0..1  d (fp16), 2..3 m (fp16)
#   4..19 qs[j] = q[j] | q[j+16] << 4     x = d * q + m

def decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 4:]).reshape(-1, 32).float()
    return fp16_field(b, 0) * q + fp16_field(b, 2)


def high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """(B, 4) little-endian uint32 -> (B, 32): bit e is the 5th bit of q[e]."""
    return bit_planes(qh, 1).transpose(1, 2).reshape(-1, 32)


# ---- Q5_0: 22 bytes, 32 values
#   0..1  d (fp16)
#   2..5  qh (uint32 LE): bit e = bit 4 of q[e]
#   6..21 qs[j] = low4(q[j]) | low4(q[j+16]) << 4     x = d * (q - 16)

def decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 6:]).reshape(-1, 32) | (high_bits_32(b[:, 2:6]) << 4)
    return fp16_field(b, 0) * (q.to(torch.int8) - 16).float()


# ---- Q5_1: 24 bytes, 32 values
#   0..1 d (fp16), 2..3 m (fp16), 4..7 qh (as Q5_0), 8..23 qs (as Q5_0)     x = d * q + m

def decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 8:]).reshape(-1, 32) | (high_bits_32(b[:, 4:8]) << 4)
    return fp16_field(b, 0) * q.float() + fp16_field(b, 2)


# ---- Q2_K: 84 bytes, 256 values in 16 sub-blocks of 16
#   0..15  scales[s] = sc[s] | m[s] << 4            (4-bit scale and 4-bit min of sub-block s)
#  16..79  qs: two halves h of 32 bytes; byte l of half h holds q[128h + 32k + l] at bits 2k..2k+1
#  80..81  d (fp16), 82..83 dmin (fp16)             x = (d * sc) * q - (dmin * m)

def two_bit_quants(qs: torch.Tensor) -> torch.Tensor:
    """(B, 64) bytes -> (B, 256) 2-bit fields in value order (Q2_K and Q3_K low bits)."""
    halves = qs.reshape(-1, 2, 32)
    return bit_planes(halves.reshape(-1, 32), 2).reshape(-1, 256)


def decode_q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[:, :16]
    dl = (fp16_field(b, 80) * (sc & 0xF).float()).unsqueeze(-1)
    ml = (fp16_field(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = two_bit_quants(b[:, 16:80]).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1, QK_K)


# ---- Q3_K: 110 bytes, 256 values in 16 sub-blocks of 16
#   0..31   hmask: byte e % 32, bit e // 32 = bit 2 of q[e]  (set: q >= 4)
#  32..95   qs: low 2 bits of q, laid out as Q2_K
#  96..107  scales, 16 6-bit values s (stored s + 32) in this pattern:
#             0: IIIIAAAA ... 7: PPPPHHHH   (low nibbles: A..H = s0..s7, I..P = s8..s15)
#             8: MMIIEEAA ... 11: PPLLHHDD  (top 2 bits: byte 8 + s % 4, bits 2 * (s // 4))
# 108..109  d (fp16)                                   x = (d * (s - 32)) * (q - 4)

def unpack_q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """(B, 12) bytes -> (B, 16) int 6-bit scales minus 32."""
    low = nibbles(sc[:, :8]).reshape(-1, 16)
    high = bit_planes(sc[:, 8:], 2).reshape(-1, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def decode_q3_k(b: torch.Tensor) -> torch.Tensor:
    dl = (fp16_field(b, 108) * unpack_q3_scales(b[:, 96:108]).float()).unsqueeze(-1)
    low = two_bit_quants(b[:, 32:96])
    high = bit_planes(b[:, :32], 1).reshape(-1, 256)
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return (dl * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


# ---- Q4_K: 144 bytes, 256 values in 8 sub-blocks of 32
#   0..1   d (fp16), 2..3 dmin (fp16)
#   4..15  scales: 8 6-bit scales sc (A..H) and 8 6-bit mins m (a..h):
#            0: EEAAAAAA   4: eeaaaaaa   8: eeeeEEEE
#            1: FFBBBBBB   5: ffbbbbbb   9: ffffFFFF
#            2: GGCCCCCC   6: ggcccccc  10: ggggGGGG
#            3: HHDDDDDD   7: hhdddddd  11: hhhhHHHH
#  16..143 qs: four chunks c of 32 bytes; byte l holds q[64c + l] | q[64c + 32 + l] << 4
#                                                       x = (d * sc) * q - (dmin * m)

def unpack_k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 12) bytes -> (B, 8) scales, (B, 8) mins (Q4_K and Q5_K)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def k_scale_terms(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = unpack_k_scales(b[:, 4:16])
    d = (fp16_field(b, 0) * sc.float()).unsqueeze(-1)
    dm = (fp16_field(b, 2) * m.float()).unsqueeze(-1)
    return d, dm


def decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = k_scale_terms(b)
    q = nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, QK_K)


# ---- Q5_K: 176 bytes, 256 values in 8 sub-blocks of 32
#   0..15   d, dmin, scales as Q4_K
#  16..47   qh: byte e % 32, bit e // 32 = bit 4 of q[e]
#  48..175  qs: low 4 bits of q, laid out as Q4_K     x = (d * sc) * q - (dmin * m)

def decode_q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = k_scale_terms(b)
    low = nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 256)
    high = bit_planes(b[:, 16:48], 1).reshape(-1, 256)
    q = (low | (high << 4)).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, QK_K)


# ---- Q6_K: 210 bytes, 256 values in 16 sub-blocks of 16
#    0..127  ql: two halves h of 64 bytes; byte l (< 32) holds low4(q[128h + l]) | low4(q[128h + 64 + l]) << 4,
#            byte 32 + l holds low4(q[128h + 32 + l]) | low4(q[128h + 96 + l]) << 4
#  128..191  qh: two halves of 32 bytes; byte l holds the top 2 bits of q[128h + 32k + l] at bits 2k..2k+1
#  192..207  scales (int8), one per sub-block
#  208..209  d (fp16)                                  x = (d * scale) * (q - 32)

def decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    d = (fp16_field(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    # nibbles: (B, half, byte group, side, 32); value order is 32k + l with k = 2 * side + group
    low = nibbles(b[:, :128].reshape(-1, 2, 2, 32)).transpose(-3, -2).reshape(-1, 256)
    high = bit_planes(b[:, 128:192].reshape(-1, 32), 2).reshape(-1, 256)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


DECODERS = {
    Q.F32: decode_f32,
    Q.F16: decode_f16,
    Q.BF16: decode_bf16,
    Q.Q8_0: decode_q8_0,
    Q.Q4_0: decode_q4_0,
    Q.Q4_1: decode_q4_1,
    Q.Q5_0: decode_q5_0,
    Q.Q5_1: decode_q5_1,
    Q.Q2_K: decode_q2_k,
    Q.Q3_K: decode_q3_k,
    Q.Q4_K: decode_q4_k,
    Q.Q5_K: decode_q5_k,
    Q.Q6_K: decode_q6_k,
}
