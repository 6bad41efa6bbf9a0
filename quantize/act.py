"""Activation quantization for integer dot products (the reference kernels/triton_q8.py must match).

x (M, K) is cut into 32-value blocks and quantized by Q8_0's rule (quantize_row_q8_0_ref: d = amax / 127,
q = roundf(x / d)); the int8 values, the fp32 scales and the sums of q over 16-value halves (which turn
`sum (q_w - offset) q_x` into `sum q_w q_x - offset * sum q_x`) are what the products take. llama.cpp's
CUDA matrix-vector products quantize activations the same way (its q8_1 also keeps block sums).
"""

from __future__ import annotations

import torch

from .simple import inverse, round_away


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K), K % 32 == 0 -> q int8 (M, K), d fp32 (M, K / 32), s int32 (M, K / 16) (sums of q)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = round_away(blocks * inverse(d))
    return q.to(torch.int8).reshape(m, k), d.reshape(m, -1), q.reshape(m, k // 16, 16).sum(-1).int()


def dequantize_act(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The values the integer products see: q * d, (M, K) fp32."""
    m, k = q.shape
    return (q.float().reshape(m, k // 32, 32) * d.reshape(m, -1, 1)).reshape(m, k)
