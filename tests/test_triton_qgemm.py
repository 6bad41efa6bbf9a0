"""The fused quantized prompt GEMM (kernels/triton_qgemm.py) under Triton's interpreter, against its oracle:
x @ dequantize_torch(W).T in float64 (the gguf-exact decoded values), for every type it covers, both
orientations, one and two K steps a loop iteration, ragged M and N (partial tiles), a K that is not a
multiple of the loop's step (Q8_0 / Q4_0 / IQ4_NL / MXFP4), row views of a fused weight, and a bias.

Tolerance (tests/qgemm_oracle.py), per output element: 2^-7 (sum_k |x_k w_k| + |y|) + 2^-12 sum_k |x_k w_k|
+ 1e-6. The kernel rounds each decoded weight to bf16 (as the dense decode + cuBLAS path does): an error
below one bf16 ulp, 2^-7 of |w_k| (the interpreter truncates where the GPU rounds to nearest, half of
that); it sums in fp32 (K 2^-24 of sum |x_k w_k|) and rounds y to bf16 (< 2^-7 |y|). A decoded value or
column off by one block breaks it by orders of magnitude. On the GPU, tests/gpu/test_gpu_qgemm.py."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_gemv", "triton_dequant", "triton_qgemm"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import qgemm_oracle  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_qgemm  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.synthetic import RANDOM_BLOCK_TYPES, RandomBlocks  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS]
SMALL = triton_qgemm.INTERPRET_CONFIG


def weight(qtype, n: int, k: int, seed: int = 3) -> tuple[torch.Tensor, QWeight]:
    """Random valid blocks (every bit pattern of the quants and small scales; MXFP4: quantized randn
    rows, its exponent bytes span too wide a range for random ones) -> (reference values, block-major)."""
    gen = torch.Generator().manual_seed(seed)
    if qtype in RANDOM_BLOCK_TYPES:
        raw = RandomBlocks("cpu", gen).get(n, k, qtype)
    else:
        raw = torch.from_numpy(quantize_tensor(torch.randn(n, k, generator=gen), qtype))
    return dequantize_torch(raw, qtype).double(), QWeight.from_raw(raw, qtype).to_blocks()


def x_rows(m: int, k: int, seed: int = 4) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_close(got, x, ref, bias=None):
    qgemm_oracle.assert_close(got, x, ref, bias, unit=2**-7, floor=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_qgemm_matches_the_decoded_product(qtype):
    k = 480 if qtype in (Q.Q8_0, Q.Q4_0, Q.IQ4_NL, Q.MXFP4) else 512  # 480: the last step holds 3.75 blocks of 4
    ref, w = weight(qtype, 72, k)  # N 72, M 37: partial tiles of both
    x = x_rows(37, k)
    assert_close(triton_qgemm.qgemm(x, w, config=SMALL), x, ref)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("cfg", [triton_qgemm.Config(bm=16, bn=16, steps=2, stages=1, w_first=False),
                                 triton_qgemm.Config(bm=32, bn=16, steps=2, stages=1, group=1)],
                         ids=["x_first_2steps", "w_first_2steps"])
def test_orientations_and_steps(qtype, cfg):
    k = 512 if qtype == Q.Q4_K else 416  # Q8_0 416: a second step of the last iteration beyond K
    ref, w = weight(qtype, 40, k, seed=5)
    x = x_rows(21, k, seed=6)
    assert_close(triton_qgemm.qgemm(x, w, config=cfg), x, ref)


def test_bias_and_row_views():
    """A fused weight's row range (QWeight.rows: strided fields) with a bias gives those rows' products."""
    ref, w = weight(Q.Q6_K, 96, 256, seed=7)
    x = x_rows(16, 256, seed=8)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = triton_qgemm.qgemm(x, w.rows(8, 56, 2), bias)
    assert_close(got, x, ref[8:56:2], bias)


def test_covers_block_major_types_only():
    _, w = weight(Q.Q4_K, 8, 256)
    assert triton_qgemm.covers(w) and not triton_qgemm.covers(w.to_rows())
    _, w5 = weight(Q.Q5_K, 8, 256)
    assert not triton_qgemm.covers(w5.to_blocks())
