"""Block-format references. Decoding delegates to the `gguf` package, which is the oracle.

Each format's values must equal `gguf.quants.dequantize` exactly; kernels are checked against this.
"""

from __future__ import annotations

import gguf
import numpy as np

from localllm.errors import LocalLLMError

# Tensor types the runtime reads (issue: core runtime).
SUPPORTED_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in (
        "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
    )
)


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF tensor data (rows, bytes per row) -> float32 (rows, cols), the gguf package's values."""
    if qtype not in SUPPORTED_TYPES:
        raise LocalLLMError(f"unsupported tensor type {qtype.name}")
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.asarray(data, dtype=np.float32)
    return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
