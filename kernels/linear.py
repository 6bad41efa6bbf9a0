"""Linear layer dispatch: y = x @ w.T + b, choosing the fastest exact path per device, shape and weight kind.

Dense weights (torch tensors):
  On an AVX-512 CPU oneDNN's fp16 matrix-vector product streams weights faster than bf16 and fp32,
  but its fp16 matrix-matrix product is several times slower than fp32 (docs/PERFORMANCE.md). So fp16
  weights serve decode (one row) directly and are widened to fp32 for prefill, where the matmul is
  compute-bound and the widening costs little. CUDA: cuBLAS.
Quantized weights as the file's blocks (kernels.cpu.BlockQWeight, CPU and MPS): kernels/cpu.py.
Quantized weights (kernels.qweight.QWeight, CUDA):
  few rows (decode): Q8_0/Q4_0/Q4_K/Q6_K/MXFP4/IQ4_NL/IQ4_XS take integer dot products against x
  quantized to int8 (kernels/triton_q8.py); the other kernel types (Q4_1, Q5_K) the fused dequantize +
  matrix-vector Triton kernel (kernels/triton_gemv.py);
  many rows (prefill): dequantize to the activation dtype with Triton (block-major weights by
  kernels/triton_dequant.py), then a tensor-core matmul.
  Types without a kernel (Q5_0, Q5_1, Q2_K, Q3_K) are decoded by the torch reference, then multiplied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.quantize.decode import dequantize_torch

from .cpu import BlockQWeight
from .cpu import qlinear as cpu_qlinear
from .cpu import qlinear_rows as cpu_qlinear_rows
from .qweight import INT_DOT_TYPES, QWeight

# At most this many rows of x go through the matrix-vector kernel; more are a matmul.
GEMV_MAX_ROWS = 4


def linear(x: torch.Tensor, w: torch.Tensor | QWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., K), w: (N, K) or a QWeight of shape (N, K), b: (N,) or None -> (..., N) in x's dtype."""
    if isinstance(w, QWeight):
        return qlinear(x, w, b)
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and w.dtype == torch.float16 and rows > 1:
        y = F.linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(x.dtype)
    return F.linear(x, w, b)


def linear_rows(x: torch.Tensor, w: torch.Tensor | QWeight, n0: int, n1: int,
                b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ w[n0:n1].T + b -> (..., n1 - n0): a row range of a weight, read in place (one
    expert's rows of a stacked (E * F, K) expert tensor, localllm/moe.py); never the whole weight.
    Dense: a view; BlockQWeight: kernels/cpu.py row_view; QWeight: row views of its fields."""
    if isinstance(w, BlockQWeight):
        return cpu_qlinear_rows(x, w, n0, n1, b)
    if isinstance(w, QWeight):
        return qlinear(x, w.rows(n0, n1), b)
    return linear(x, w[n0:n1], b)


def qlinear(x: torch.Tensor, w: QWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, BlockQWeight):  # the file's blocks on CPU (C++ kernels) or MPS (torch decoding)
        return cpu_qlinear(x, w, b)
    rows = x.numel() // x.shape[-1]
    if w.has_kernel and rows <= GEMV_MAX_ROWS and x.device.type == "cuda":
        if w.qtype in INT_DOT_TYPES:
            from .triton_q8 import gemv_q8
            from .triton_quant_act import quantize_act

            y = gemv_q8(quantize_act(x.reshape(rows, -1)), w, bias=b, act_dtype=x.dtype)
            return y.reshape(*x.shape[:-1], w.shape[0])
        from .triton_gemv import gemv

        y = gemv(x.reshape(rows, -1), w, bias=b, act_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])
    return dequant_product(x, w, b)


def dequant_product(x: torch.Tensor, w: QWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ w.T + b through a dense copy: w decoded to x's dtype (or w.dense, the same values
    decoded once and kept), then F.linear (cuBLAS on CUDA). Public so that bench/qgemm_sweep.py can time
    it against the fused kernels/triton_qgemm.qgemm."""
    if w.dense is not None and w.dense.dtype == x.dtype:
        return F.linear(x, w.dense, b)
    return F.linear(x, dequantize_qweight(w, x.dtype), b)


def dequantize_qweight(w: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) dense values: a BlockQWeight decodes its own blocks; for a QWeight Triton's decoder for
    kernel types, the torch reference for the rest."""
    if isinstance(w, BlockQWeight):
        return w.dequantize(dtype)
    if "raw" in w.parts:
        return dequantize_torch(w.parts["raw"], w.qtype).to(dtype)
    from .triton_dequant import covers, dequantize as dequantize_blocks

    if covers(w):  # block-major: read in place (no row-major copy first)
        return dequantize_blocks(w, dtype)
    from .triton_gemv import dequantize

    return dequantize(w.to_rows(), dtype)


def fused_linear(
    x: torch.Tensor,
    w: torch.Tensor | QWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    glu: bool = False,
    act_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    split: int | None = 1,
    inplace: bool = False,
    xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,
    chain: int = 0,
) -> torch.Tensor:
    """A decode step's projection with its neighbours: x (1, K) ->
    [residual +] W @ RMSNorm(x) (norm=(weight, eps)) + bias, or with glu (rows of w interleaved
    gate/up) silu(gate) * up. The Triton kernel does it in one pass (kernels/triton_gemv.gemv, which
    also takes split and inplace; kernels.triton_q8.gemv_q8 for INT_DOT_TYPES, with x quantized by
    quantize_act, norm fused, unless `xq` brings that quantized x already); quantized types without
    a kernel take the same torch ops as model.py. counters: split products' (kernels/triton_epilogue.split_buffers).
    x and an in-place residual may be int64 fixed-point accumulators (triton_epilogue.FIXED_ONE: the
    decode step's residual stream), the product then added to it unrounded. chain: gemv_q8's (integer-dot
    weights only)."""
    nw, eps = norm if norm is not None else (None, 0.0)
    if isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES:
        from .triton_q8 import gemv_q8
        from .triton_quant_act import quantize_act

        return gemv_q8(xq or quantize_act(x, nw, eps), w, bias=bias, residual=residual, glu=glu, act_dtype=act_dtype,
                       out_dtype=out_dtype, split=split, inplace=inplace, counters=counters, chain=chain)
    assert chain == 0, "chained products take integer-dot weights"
    if not isinstance(w, QWeight) or w.has_kernel:
        from .triton_gemv import gemv

        return gemv(x, w, bias=bias, residual=residual, norm_weight=nw, eps=eps, glu=glu, act_dtype=act_dtype,
                    out_dtype=out_dtype, split=split, inplace=inplace, counters=counters)
    from .triton_epilogue import from_fixed, to_fixed

    if norm is not None:
        xf = from_fixed(x)
        x = norm[0] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm[1])).to(norm[0].dtype)
    y = linear(from_fixed(x).to(act_dtype), w, bias)
    if glu:
        y = F.silu(y[..., 0::2]) * y[..., 1::2]
    if residual is not None and inplace:
        return residual.add_(to_fixed(y) if residual.dtype == torch.int64 else y)
    y = y if residual is None else residual + y
    return y if out_dtype is None else y.to(out_dtype)


def cublas_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    inplace: bool = False,
    **_,
) -> torch.Tensor:
    """fused_linear's contract (x and an in-place residual may be int64 fixed-point accumulators) for a
    dense weight w (N, K) of act_dtype through cuBLAS: the decode steps of many rows, where the
    batch-invariant kernels' per-row work costs more than the weights' bytes (backends/cuda_graph.py's
    dense steps). x (M, K) -> RMSNorm (norm=(weight, eps)) in act_dtype, y = x @ w.T + bias rounded to
    act_dtype as model.py's Linear rounds it, then added unrounded into the residual (fixed point:
    kernels/triton_decode.add_fixed) or returned in out_dtype. (The other keywords of fused_linear,
    split and counters, have nothing to split here.)"""
    from .triton_decode import add_fixed
    from .triton_epilogue import from_fixed
    from .triton_prefill import rmsnorm_rows

    if norm is not None:
        h = rmsnorm_rows(x, *norm).to(act_dtype)
    else:
        h = (from_fixed(x) if x.dtype == torch.int64 else x).to(act_dtype)
    y = F.linear(h, w, None if bias is None else bias.to(act_dtype))
    if residual is None:
        return y if out_dtype is None else y.to(out_dtype)
    if not inplace:
        residual = residual.clone()
    return add_fixed(residual, y) if residual.dtype == torch.int64 else residual.add_(y)
