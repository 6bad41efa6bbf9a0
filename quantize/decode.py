"""Torch decoding of GGUF tensors: the reference that kernels are checked against.

`dequantize_torch(data, qtype)` gives exactly the float32 values of `gguf.quants.dequantize`: each
type's decoder (quantize/formats/*_types.py, its bit layout drawn above it) repeats gguf-py's
arithmetic in the same order (d*sc first, then *q, then -m), so every value is bit-identical, on any
device.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from .formats import BLOCK_SIZES, FORMATS, format_of
from .formats.bits import unpack_k_scales

Q = gguf.GGMLQuantizationType

# type -> (B, bytes per block) uint8 -> (B, values per block) float32 (each Format's decode).
DECODERS = {t: f.decode for t, f in FORMATS.items()}

__all__ = ["BLOCK_SIZES", "DECODERS", "dequantize_torch", "unpack_k_scales"]


def dequantize_torch(data: np.ndarray | torch.Tensor, qtype: Q) -> torch.Tensor:
    """Raw GGUF data (rows, bytes per row), uint8 (or F32/F16 typed) -> float32 (rows, cols)."""
    fmt = format_of(qtype)
    raw = torch.as_tensor(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().view(torch.uint8)
    rows = raw.shape[0] if raw.dim() > 1 else 1
    blocks = raw.reshape(-1, fmt.nbytes)
    values = fmt.decode(blocks)
    return values.reshape(rows, -1)
