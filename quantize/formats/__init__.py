"""The GGUF tensor types localllm reads and writes, each described in one place: `FORMATS`.

One `Format` per type (quantize/formats/layout.py) holds its block geometry, byte layout (fields,
the planar split and block-major repack the kernels use), its encoder and its torch decoder, in the
spirit of gguf-py's quants.py (a class per type in one table). The types live in float_types.py,
legacy_types.py (32-value blocks), k_types.py (256-value K-quants), mx_types.py (MXFP4) and
iq_types.py (IQ4_NL, IQ4_XS); quantize/ (encode, decode),
kernels/ (qweight, triton_gemv, triton_q8, cpu) and the loaders all read FORMATS, and derive their
type sets from it.

Decoding for the gguf files' own values delegates to the `gguf` package, which is the oracle: each
format's torch decoder must equal `gguf.quants.dequantize` exactly, and kernels are checked against it.
(`quantize/` imports nothing from `localllm/`: data flows one way, see STYLE.md.)
"""

from __future__ import annotations

import gguf
import numpy as np

from . import float_types, iq_types, k_types, legacy_types, mx_types
from .layout import Field, Format, IntDot

FORMATS: dict[gguf.GGMLQuantizationType, Format] = {
    f.qtype: f for f in float_types.FORMATS + legacy_types.FORMATS + k_types.FORMATS + mx_types.FORMATS + iq_types.FORMATS
}


class UnsupportedTypeError(ValueError):
    """A tensor type outside SUPPORTED_TYPES."""


# Tensor types the runtime reads (issue: core runtime).
SUPPORTED_TYPES = frozenset(FORMATS)

# type -> (values per block, bytes per block).
BLOCK_SIZES = {t: (f.block, f.nbytes) for t, f in FORMATS.items()}


def check_type(qtype: gguf.GGMLQuantizationType) -> None:
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTypeError(f"unsupported tensor type {qtype.name}")


def format_of(qtype: gguf.GGMLQuantizationType) -> Format:
    """FORMATS[qtype], or UnsupportedTypeError."""
    check_type(qtype)
    return FORMATS[qtype]


def bits_per_weight(qtype: gguf.GGMLQuantizationType) -> float:
    """Stored bits per value, block scales included (Q4_K: 4.5, Q6_K: 6.5625)."""
    return format_of(qtype).bits


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF tensor data (rows, bytes per row) -> float32 (rows, cols), the gguf package's values.

    F32/F16 data may also come typed, as GGUFReader gives it (rows, cols).
    """
    check_type(qtype)
    if qtype == gguf.GGMLQuantizationType.F32 and data.dtype != np.uint8:
        return np.asarray(data, dtype=np.float32)
    return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)


__all__ = [
    "BLOCK_SIZES",
    "FORMATS",
    "SUPPORTED_TYPES",
    "Field",
    "Format",
    "IntDot",
    "UnsupportedTypeError",
    "bits_per_weight",
    "check_type",
    "dequantize",
    "format_of",
]
