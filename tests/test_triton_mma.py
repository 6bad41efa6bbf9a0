"""The tensor-core products (kernels/triton_mma.py) under Triton's interpreter: for each type, against
the fp64 product of gguf's dequantization of the weights with the int8 activations' values (the
oracle), and bit for bit against the dp4a kernel (triton_q8.gemv_q8 with mma=False) over the same
rows, and against each row computed alone (one row: the dp4a kernel): a row's bits do not depend on
the bucket. The epilogues the decode step uses: an int64 fixed-point accumulator split over K, and an
unsplit fp32 / bf16 output with bias and residual. tests/gpu/test_gpu_mma.py repeats the bit checks
on the GPU (real tensor cores and FMA contraction).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_mma", "triton_q8"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_mma, triton_q8  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed, to_fixed  # noqa: E402
from localllm.quantize import quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402

Q = gguf.GGMLQuantizationType
N, K = 40, 512  # 40 rows: a partial weight tile


@functools.cache
def make_weight(qtype: Q) -> tuple[np.ndarray, QWeight]:
    """(gguf's dequantized values (N, K) fp64, the block-major QWeight)."""
    g = torch.Generator().manual_seed(11)
    raw = quantize_tensor(torch.randn(N, K, generator=g), qtype)
    ref = gguf.quants.dequantize(np.asarray(raw), qtype).astype(np.float64).reshape(N, K)
    return ref, QWeight.from_raw(torch.from_numpy(raw), qtype).to_blocks()


@pytest.fixture(scope="module", params=sorted(triton_mma.MMA_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def weight(request):
    return make_weight(request.param)


def act(rows: int, seed: int):
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)) * 2
    x[1, 32:64] = 0.0  # an all-zero block
    xa = quantize_act(x)
    return xa, dequantize_act(xa[0], xa[1]).double().numpy()


def rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_threshold_is_one_constant():
    assert triton_mma.MMA_ROWS == 16


def test_accumulator_split_k_matches_oracle_and_dp4a_bits(weight):
    """The decode step's use: += into an int64 fixed-point accumulator, K split in 2 (atomics); 20 rows
    (a partial row tile)."""
    ref, qw = weight
    rows = 20
    xa, xv = act(rows, rows)
    g = torch.Generator().manual_seed(3)
    res, b = to_fixed(torch.randn(rows, N, generator=g)), torch.randn(N, generator=g)  # (Qwen's q|k|v bias)
    got, want = res.clone(), res.clone()
    triton_q8.gemv_q8(xa, qw, bias=b, residual=got, inplace=True, split=2, act_dtype=torch.float32)
    triton_q8.gemv_q8(xa, qw, bias=b, residual=want, inplace=True, split=2, act_dtype=torch.float32, mma=False)
    assert torch.equal(got, want)
    assert rel(from_fixed(got - res).numpy(), xv @ ref.T + b.double().numpy()) < 1e-6
    for r in (0, rows - 1):  # each row alone (the dp4a kernel of one row): the same bits
        alone = res[r:r + 1].clone()
        triton_q8.gemv_q8(tuple(t[r:r + 1] for t in xa), qw, bias=b, residual=alone, inplace=True, split=2,
                          act_dtype=torch.float32)
        assert torch.equal(alone, got[r:r + 1])


def test_output_with_bias_and_residual(weight):
    """An unsplit fp32 output (the head's logits) with bias and residual, the sum rounded to bf16 first
    (triton_epilogue.epilogue's order)."""
    ref, qw = weight
    xa, xv = act(16, 5)
    g = torch.Generator().manual_seed(4)
    b, res = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
    kw = dict(bias=b, residual=res, act_dtype=torch.bfloat16, out_dtype=torch.float32)
    got = triton_q8.gemv_q8(xa, qw, **kw)
    assert got.dtype == torch.float32 and torch.equal(got, triton_q8.gemv_q8(xa, qw, mma=False, **kw))
    assert rel((got - res).numpy(), xv @ ref.T + b.double().numpy()) < 1e-2  # bf16 rounding


def test_rows_are_independent(weight):
    """Rows 0..15 of a 32-row product equal the same rows in a 16-row one with other rows around."""
    ref, qw = weight
    xa, _ = act(32, 7)
    full = triton_q8.gemv_q8(xa, qw, act_dtype=torch.float32)
    other, _ = act(16, 8)
    mixed = tuple(torch.cat([a[:8], o[:8]]) for a, o in zip(xa, other))
    part = triton_q8.gemv_q8(mixed, qw, act_dtype=torch.float32)
    assert torch.equal(part[:8], full[:8])
