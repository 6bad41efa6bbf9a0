"""Dense linear layer dispatch: y = x @ w.T + b, choosing the fastest exact path per device and shape.

Measured on the 2-core AVX-512 CPU (docs/PERFORMANCE.md): oneDNN's fp16 matrix-vector product streams
weights at ~22 GB/s (twice bf16, and fp32 at ~12 GB), but its fp16 matrix-matrix product is
~5x slower than fp32. So fp16 weights serve decode (one row) directly and are widened to fp32 for
prefill, where the matmul is compute-bound and the widening costs little.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., K), w: (N, K), b: (N,) or None -> (..., N) in x's dtype."""
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and w.dtype == torch.float16 and rows > 1:
        y = F.linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(x.dtype)
    return F.linear(x, w, b)
