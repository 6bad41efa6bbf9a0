"""F32, F16, BF16: one value per "block", stored little-endian."""

from __future__ import annotations

import gguf
import torch

from .. import simple
from .layout import Field, Format

Q = gguf.GGMLQuantizationType


def decode_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def decode_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def decode_bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an fp32: widen the int16 and shift it up.
    return (b.contiguous().view(torch.int16).int() << 16).view(torch.float32)


FORMATS = (
    Format(Q.F32, 1, 4, (Field("w", 0, 4, torch.float32),), simple.encode_f32, decode_f32, dense=True),
    Format(Q.F16, 1, 2, (Field("w", 0, 2, torch.float16),), simple.encode_f16, decode_f16, dense=True),
    Format(Q.BF16, 1, 2, (Field("w", 0, 2, torch.bfloat16),), simple.encode_bf16, decode_bf16, dense=True),
)
