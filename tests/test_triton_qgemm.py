"""The fused quantized prompt GEMM (kernels/triton_qgemm.py) under Triton's interpreter, against its
reference: x @ dequantize_torch(W).T (the gguf-exact decoded values; only fp32 summation order differs),
for every block-major type, with partial row / column tiles, a K that is not a multiple of the 128-value
step (Q8_0 / Q4_0), row views of a fused weight, and a bias. On the GPU, tests/gpu/test_gpu_qgemm.py."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_qgemm"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_qgemm  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def weight(qtype, n: int, k: int, seed: int = 3) -> tuple[torch.Tensor, QWeight]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[1, : k // 2] *= 40  # scales far apart inside one row
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    return dequantize_torch(raw, qtype), QWeight.from_raw(raw, qtype).to_blocks()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_qgemm_matches_decoded_matmul(qtype):
    k = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 480  # 480: the last step holds 3.75 of 4 blocks
    ref, w = weight(qtype, 40, k)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(4))
    b = torch.randn(40, generator=torch.Generator().manual_seed(5))
    got = triton_qgemm.qgemm(x, w, b)
    want = x @ ref.T + b
    assert got.shape == want.shape and rel(got, want) < 1e-6


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda t: t.name)
def test_row_views_read_only_their_rows(qtype):
    """A fused weight's row range (QWeight.rows: strided fields) gives those rows' products."""
    ref, w = weight(qtype, 64, 256, seed=6)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    got = triton_qgemm.qgemm(x, w.rows(8, 48, 2))
    assert rel(got, x @ ref[8:48:2].T) < 1e-6


def test_covers_only_block_major_kernel_types():
    _, w = weight(Q.Q4_K, 8, 256)
    assert triton_qgemm.covers(w) and not triton_qgemm.covers(w.to_rows())
    raw = torch.from_numpy(quantize_tensor(torch.randn(8, 256), Q.Q5_K))
    assert not triton_qgemm.covers(QWeight.from_raw(raw, Q.Q5_K).to_blocks())
