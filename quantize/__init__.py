"""GGUF block formats: encoders (quantize_tensor), torch decoders (dequantize_torch), gguf's decoding (dequantize).

Each type's facts, encoder and decoder are its Format in one table, FORMATS (quantize/formats/).
"""

from .blocks import quantize_tensor
from .decode import dequantize_torch
from .formats import BLOCK_SIZES, FORMATS, SUPPORTED_TYPES, UnsupportedTypeError, bits_per_weight, dequantize

__all__ = [
    "BLOCK_SIZES",
    "FORMATS",
    "SUPPORTED_TYPES",
    "UnsupportedTypeError",
    "bits_per_weight",
    "dequantize",
    "dequantize_torch",
    "quantize_tensor",
]
