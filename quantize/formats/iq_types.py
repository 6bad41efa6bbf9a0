"""IQ4_NL and IQ4_XS (non-linear 4-bit: each code indexes KVALUES, ggml's kvalues_iq4nl): their bit
layouts, encoders (quantize/iq4.py, which take the imatrix itself, as llama.cpp's quantize_iq4_nl /
quantize_iq4_xs) and torch decoders, as gguf-py's quants.IQ4_NL / IQ4_XS and ggml's
dequantize_row_iq4_nl / dequantize_row_iq4_xs read them. Byte offsets are within one block.
gemv: kernels/triton_gemv.py's float decode (the table looked up from two int64 words); int_dot:
kernels/triton_q8.py's, the codes' int8 values by byte permutes (as MXFP4's), a 32-value (sub-)block a
unit; CPU: kernels/cpu_quant.h's Fmt<IQ4_NL> / Fmt<IQ4_XS>.
"""

from __future__ import annotations

import gguf
import torch

from .. import iq4
from .bits import fp16_field, nibbles
from .layout import Field, Format, IntDot

Q = gguf.GGMLQuantizationType
F16 = torch.float16


def _table(device: torch.device) -> torch.Tensor:
    return torch.tensor(iq4.KVALUES, dtype=torch.float32, device=device)


# ---- IQ4_NL: 18 bytes, 32 values
#   0..1   d (fp16)
#   2..17  qs[j] = q[j] | q[j+16] << 4            x = d * KVALUES[q]

def decode_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:]).reshape(-1, 32).long()
    return fp16_field(b, 0) * _table(b.device)[q]


IQ4_NL = Format(
    Q.IQ4_NL, 32, 18, (Field("d", 0, 2, F16), Field("qs", 2, 16)), iq4.encode_iq4_nl, decode_iq4_nl,
    imatrix=True, gemv=("qs", "d"), int_dot=IntDot(32, {"qs": 16, "d": 1}, ("qs", "d", None, None, None)),
)


# ---- IQ4_XS: 136 bytes, 256 values in 8 sub-blocks s of 32
#   0..1    d (fp16)
#   2..3    scales_h (uint16 LE): bits 2s..2s+1 = the high 2 bits of sub-block s's 6-bit scale
#   4..7    scales_l[s / 2]: the low 4 bits of scale s (s even: low nibble, odd: high nibble)
#   8..135  qs: 16 bytes per sub-block, byte j = q[32s + j] | q[32s + j + 16] << 4
#                                                x = (d * (scale_s - 32)) * KVALUES[q]

def decode_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    sh = b[:, 2].int() | (b[:, 3].int() << 8)
    high = (sh[:, None] >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    low = nibbles(b[:, 4:8]).transpose(1, 2).reshape(-1, 8).int()  # s = 2 * byte + nibble
    scale = ((low | (high << 4)) - 32).float()
    dl = (fp16_field(b, 0) * scale).unsqueeze(-1)  # (B, 8, 1)
    q = nibbles(b[:, 8:].reshape(-1, 8, 16)).reshape(-1, 8, 32).long()
    return (dl * _table(b.device)[q]).reshape(-1, 256)


IQ4_XS = Format(
    Q.IQ4_XS, 256, 136,
    (Field("d", 0, 2, F16), Field("scales_h", 2, 2), Field("scales_l", 4, 4), Field("qs", 8, 128)),
    iq4.encode_iq4_xs, decode_iq4_xs, imatrix=True, gemv=("qs", "d", "scales_h", "scales_l"),
    # a unit is sub-block s of super-block b (unit 8b + s): scales_h byte 2b + s // 4, scales_l byte
    # 4b + s // 2 hold its scale's bits (block-major one byte a row each: unit u reads bytes u // 4, u // 2)
    int_dot=IntDot(32, {"qs": 16, "d": 1, "scales_h": 1, "scales_l": 1}, ("qs", "d", "scales_h", "scales_l", None)),
)

FORMATS = (IQ4_NL, IQ4_XS)
