"""The 32-value formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: each one's bit layout (drawn above its decoder),
encoder (quantize/simple.py) and torch decoder. Byte offsets are within one block; "q[e]" is the quant
of value e of the block; fp16 fields are little-endian.
"""

from __future__ import annotations

import gguf
import torch

from .. import simple
from .bits import fp16_field, high_bits_32, nibbles
from .layout import Field, Format, IntDot

Q = gguf.GGMLQuantizationType
F16 = torch.float16


# ---- Q8_0: 34 bytes, 32 values
#   0..1  d (fp16)
#   2..33 q[0..31] (int8)          x = q * d

def decode_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * fp16_field(b, 0)


Q8_0 = Format(
    Q.Q8_0, 32, 34, (Field("d", 0, 2, F16), Field("qs", 2, 32)), simple.encode_q8_0, decode_q8_0,
    gemv=("qs", "d"), int_dot=IntDot(32, {"qs": 32, "d": 1}, ("qs", "d", None, None, None)),
)


# ---- Q4_0: 18 bytes, 32 values
#   0..1  d (fp16)
#   2..17 qs[j] = q[j] | q[j+16] << 4     x = d * (q - 8)

def decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return fp16_field(b, 0) * q.float()


Q4_0 = Format(
    Q.Q4_0, 32, 18, (Field("d", 0, 2, F16), Field("qs", 2, 16)), simple.encode_q4_0, decode_q4_0,
    gemv=("qs", "d"), int_dot=IntDot(32, {"qs": 16, "d": 1}, ("qs", "d", None, None, None)),
)


# ---- Q4_1: 20 bytes, 32 values
#   0..1  d (fp16), 2..3 m (fp16)
#   4..19 qs[j] = q[j] | q[j+16] << 4     x = d * q + m

def decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 4:]).reshape(-1, 32).float()
    return fp16_field(b, 0) * q + fp16_field(b, 2)


Q4_1 = Format(
    Q.Q4_1, 32, 20, (Field("d", 0, 2, F16), Field("m", 2, 2, F16), Field("qs", 4, 16)),
    simple.encode_q4_1, decode_q4_1, gemv=("qs", "d", "m"),
)


# ---- Q5_0: 22 bytes, 32 values
#   0..1  d (fp16)
#   2..5  qh (uint32 LE): bit e = bit 4 of q[e]
#   6..21 qs[j] = low4(q[j]) | low4(q[j+16]) << 4     x = d * (q - 16)

def decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 6:]).reshape(-1, 32) | (high_bits_32(b[:, 2:6]) << 4)
    return fp16_field(b, 0) * (q.to(torch.int8) - 16).float()


Q5_0 = Format(
    Q.Q5_0, 32, 22, (Field("d", 0, 2, F16), Field("qh", 2, 4), Field("qs", 6, 16)),
    simple.encode_q5_0, decode_q5_0,
)


# ---- Q5_1: 24 bytes, 32 values
#   0..1 d (fp16), 2..3 m (fp16), 4..7 qh (as Q5_0), 8..23 qs (as Q5_0)     x = d * q + m

def decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 8:]).reshape(-1, 32) | (high_bits_32(b[:, 4:8]) << 4)
    return fp16_field(b, 0) * q.float() + fp16_field(b, 2)


Q5_1 = Format(
    Q.Q5_1, 32, 24, (Field("d", 0, 2, F16), Field("m", 2, 2, F16), Field("qh", 4, 4), Field("qs", 8, 16)),
    simple.encode_q5_1, decode_q5_1,
)

FORMATS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
