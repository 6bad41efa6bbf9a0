"""The K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-value super-blocks): each one's bit layout (drawn
above its decoder), encoder (quantize/kquants.py, which takes the imatrix itself) and torch decoder.
Byte offsets are within one block; "q[e]" is the quant of value e of the block; fp16 fields are
little-endian.
"""

from __future__ import annotations

import gguf
import torch

from .. import kquants
from .bits import bit_planes, fp16_field, k_scales_planar, nibbles, two_bit_quants, unpack_k_scales, unpack_q3_scales
from .layout import Field, Format, IntDot

Q = gguf.GGMLQuantizationType
QK_K = 256
F16 = torch.float16


# ---- Q2_K: 84 bytes, 256 values in 16 sub-blocks of 16
#   0..15  scales[s] = sc[s] | m[s] << 4            (4-bit scale and 4-bit min of sub-block s)
#  16..79  qs: two halves h of 32 bytes; byte l of half h holds q[128h + 32k + l] at bits 2k..2k+1
#  80..81  d (fp16), 82..83 dmin (fp16)             x = (d * sc) * q - (dmin * m)

def decode_q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[:, :16]
    dl = (fp16_field(b, 80) * (sc & 0xF).float()).unsqueeze(-1)
    ml = (fp16_field(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = two_bit_quants(b[:, 16:80]).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1, QK_K)


Q2_K = Format(
    Q.Q2_K, QK_K, 84,
    (Field("scales", 0, 16), Field("qs", 16, 64), Field("d", 80, 2, F16), Field("dmin", 82, 2, F16)),
    kquants.encode_q2_k, decode_q2_k, imatrix=True,
)


# ---- Q3_K: 110 bytes, 256 values in 16 sub-blocks of 16
#   0..31   hmask: byte e % 32, bit e // 32 = bit 2 of q[e]  (set: q >= 4)
#  32..95   qs: low 2 bits of q, laid out as Q2_K
#  96..107  scales, 16 6-bit values s (stored s + 32) in this pattern:
#             0: IIIIAAAA ... 7: PPPPHHHH   (low nibbles: A..H = s0..s7, I..P = s8..s15)
#             8: MMIIEEAA ... 11: PPLLHHDD  (top 2 bits: byte 8 + s % 4, bits 2 * (s // 4))
# 108..109  d (fp16)                                   x = (d * (s - 32)) * (q - 4)

def decode_q3_k(b: torch.Tensor) -> torch.Tensor:
    dl = (fp16_field(b, 108) * unpack_q3_scales(b[:, 96:108]).float()).unsqueeze(-1)
    low = two_bit_quants(b[:, 32:96])
    high = bit_planes(b[:, :32], 1).reshape(-1, 256)
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return (dl * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


Q3_K = Format(
    Q.Q3_K, QK_K, 110,
    (Field("hmask", 0, 32), Field("qs", 32, 64), Field("scales", 96, 12), Field("d", 108, 2, F16)),
    kquants.encode_q3_k, decode_q3_k, imatrix=True,
)


# ---- Q4_K: 144 bytes, 256 values in 8 sub-blocks of 32
#   0..1   d (fp16), 2..3 dmin (fp16)
#   4..15  scales: 8 6-bit scales sc (A..H) and 8 6-bit mins m (a..h):
#            0: EEAAAAAA   4: eeaaaaaa   8: eeeeEEEE
#            1: FFBBBBBB   5: ffbbbbbb   9: ffffFFFF
#            2: GGCCCCCC   6: ggcccccc  10: ggggGGGG
#            3: HHDDDDDD   7: hhdddddd  11: hhhhHHHH
#  16..143 qs: four chunks c of 32 bytes; byte l holds q[64c + l] | q[64c + 32 + l] << 4
#                                                       x = (d * sc) * q - (dmin * m)
# Planar (QWeight), the scales are widened to one byte each: sc, mn (N, K/32), 16 instead of 12
# scale bytes per 256 values (4.625 instead of 4.5 bits per weight).

def k_scale_terms(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = unpack_k_scales(b[:, 4:16])
    d = (fp16_field(b, 0) * sc.float()).unsqueeze(-1)
    dm = (fp16_field(b, 2) * m.float()).unsqueeze(-1)
    return d, dm


def decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = k_scale_terms(b)
    q = nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, QK_K)


K_HEAD = (Field("d", 0, 2, F16), Field("dmin", 2, 2, F16), Field("scales", 4, 12, unpack=k_scales_planar))

Q4_K = Format(
    Q.Q4_K, QK_K, 144, K_HEAD + (Field("qs", 16, 128),), kquants.encode_q4_k, decode_q4_k, imatrix=True,
    gemv=("qs", "d", "dmin", "sc", "mn"),
    int_dot=IntDot(64, {"qs": 32, "d": 1, "dmin": 1, "sc": 1, "mn": 1}, ("qs", "d", "dmin", "sc", "mn")),
)


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


Q5_K = Format(
    Q.Q5_K, QK_K, 176, K_HEAD + (Field("qh", 16, 32), Field("qs", 48, 128)), kquants.encode_q5_k, decode_q5_k,
    imatrix=True, gemv=("qs", "d", "dmin", "sc", "mn", "qh"),
)


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


Q6_K = Format(
    Q.Q6_K, QK_K, 210,
    (Field("ql", 0, 128), Field("qh", 128, 64), Field("sc", 192, 16, torch.int8), Field("d", 208, 2, F16)),
    kquants.encode_q6_k, decode_q6_k, imatrix=True, gemv=("ql", "d", None, "sc", None, "qh"),
    int_dot=IntDot(128, {"ql": 64, "qh": 32, "sc": 1, "d": 1}, ("ql", "d", "qh", "sc", None)),
)

FORMATS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
