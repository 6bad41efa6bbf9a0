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
from ..type_facts import BLOCK_SIZES, SUPPORTED_TYPES, UnsupportedTypeError, bits_per_weight, check_type
from .layout import Field, Format, IntDot

FORMATS: dict[gguf.GGMLQuantizationType, Format] = {
    f.qtype: f for f in float_types.FORMATS + legacy_types.FORMATS + k_types.FORMATS + mx_types.FORMATS + iq_types.FORMATS
}


# The type facts (SUPPORTED_TYPES, BLOCK_SIZES, bits_per_weight) live in quantize/type_facts.py, torch-free;
# FORMATS must describe exactly those types, with the gguf package's sizes.
if set(FORMATS) != SUPPORTED_TYPES or any(BLOCK_SIZES[t] != (f.block, f.nbytes) for t, f in FORMATS.items()):
    raise ImportError("quantize/formats' FORMATS and quantize/type_facts.py disagree")


def format_of(qtype: gguf.GGMLQuantizationType) -> Format:
    """FORMATS[qtype], or UnsupportedTypeError."""
    check_type(qtype)
    return FORMATS[qtype]


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
