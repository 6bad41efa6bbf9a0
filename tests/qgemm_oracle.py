"""The fused quantized GEMM's oracle (tests/test_triton_qgemm.py under the interpreter, tests/gpu/test_gpu_qgemm.py):
x @ W.T in float64 on the gguf-exact decoded values, within a bound per output element that follows from
rounding each decoded weight and the result to x's dtype (the tests' docstrings derive `unit`)."""

from __future__ import annotations

import torch


def assert_close(got: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, bias: torch.Tensor | None = None,
                 unit: float = 2**-8, floor: float = 1e-5) -> None:
    """got (M, N) in x's dtype against x (M, K) @ ref (N, K).T (+ bias), elementwise: |error| <=
    unit (sum_k |x_k w_k| + |y|) + 2^-12 sum_k |x_k w_k| + floor. unit: the relative error of rounding a
    value to x's dtype, once for each weight and once for y; 2^-12: fp32 summation (K 2^-24, K <= 4096)
    and second-order terms."""
    xd = x.double()
    want = xd @ ref.double().T + (0 if bias is None else bias.double())
    sums = xd.abs() @ ref.double().abs().T
    bound = unit * (sums + want.abs()) + 2**-12 * sums + floor
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{(err / bound).max().item():.2f} x the bound"
