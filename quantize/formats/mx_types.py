"""MXFP4 (OCP microscaling FP4; gpt-oss's expert weights): its bit layout, encoder (quantize/mxfp4.py)
and torch decoder, as gguf-py's quants.MXFP4 and ggml's dequantize_row_mxfp4 read it.
"""

from __future__ import annotations

import gguf
import torch

from .. import mxfp4
from .bits import nibbles
from .layout import Field, Format, IntDot

Q = gguf.GGMLQuantizationType


# ---- MXFP4: 17 bytes, 32 values
#   0      e (E8M0: a power-of-two exponent byte), d = 2^(e - 128) (mxfp4.e8m0_half: half of 2^(e-127),
#          as the values below are E2M1 doubled)
#   1..16  qs[j] = q[j] | q[j+16] << 4, q an E2M1 code: bit 3 sign, bits 0..2 magnitude
#                                       x = d * KVALUES[q], KVALUES = 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12
# (d * KVALUES[q] is one float32 product, as gguf computes it: every value exact.)

def decode_mxfp4(b: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(mxfp4.KVALUES, dtype=torch.float32, device=b.device)
    q = nibbles(b[:, 1:]).reshape(-1, 32).long()
    return mxfp4.e8m0_half(b[:, :1]) * table[q]


# gemv: kernels/triton_gemv.py's float decode; int_dot: kernels/triton_q8.py's, the codes' int8 values
# computed within each byte of a word (_e2m1_bytes), a 32-value block a unit as Q4_0's.
MXFP4 = Format(
    Q.MXFP4, 32, 17, (Field("e", 0, 1), Field("qs", 1, 16)), mxfp4.encode_mxfp4, decode_mxfp4,
    gemv=("qs", "e"), int_dot=IntDot(32, {"qs": 16, "e": 1}, ("qs", "e", None, None, None)),
)

FORMATS = (MXFP4,)
