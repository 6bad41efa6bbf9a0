"""Block-format references. Decoding delegates to the `gguf` package, which is the oracle.

Each format's values must equal `gguf.quants.dequantize` exactly; kernels are checked against this.
(`quantize/` imports nothing from `localllm/`: data flows one way, see STYLE.md.)
"""

from __future__ import annotations

import gguf
import numpy as np


class UnsupportedTypeError(ValueError):
    """A tensor type outside SUPPORTED_TYPES."""


# Tensor types the runtime reads (issue: core runtime).
SUPPORTED_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in (
        "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
    )
)

# type -> (values per block, bytes per block), from gguf's own table.
BLOCK_SIZES = {t: gguf.GGML_QUANT_SIZES[t] for t in SUPPORTED_TYPES}


def check_type(qtype: gguf.GGMLQuantizationType) -> None:
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTypeError(f"unsupported tensor type {qtype.name}")


def bits_per_weight(qtype: gguf.GGMLQuantizationType) -> float:
    """Stored bits per value, block scales included (Q4_K: 4.5, Q6_K: 6.5625)."""
    check_type(qtype)
    block, nbytes = BLOCK_SIZES[qtype]
    return 8 * nbytes / block


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF tensor data (rows, bytes per row) -> float32 (rows, cols), the gguf package's values.

    F32/F16 data may also come typed, as GGUFReader gives it (rows, cols).
    """
    check_type(qtype)
    if qtype == gguf.GGMLQuantizationType.F32 and data.dtype != np.uint8:
        return np.asarray(data, dtype=np.float32)
    return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
