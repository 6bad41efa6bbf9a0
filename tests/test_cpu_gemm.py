"""The dense prompt GEMM (kernels/cpu_gemm.cpp, issue 20): x (T, K) fp32 @ w.T for F32 / F16 / BF16 rows.

Oracle: the same product in fp64 on the stored values (torch's conversion of the F16 / BF16 rows, which is
exact). Shapes reach every edge of the blocking: T not a multiple of the 6-row micro-kernel, N not a
multiple of the 16-row panel, K past one 256-value register sum and past one 2048-value panel slice
(a slice that is not a multiple of 256), and two threads.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from localllm.kernels.cpu import BlockQWeight, load_extension, pack_for_cpu, qlinear
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@pytest.fixture(scope="module")
def ext():
    ext = load_extension(DEFAULT_CPU.cache_dir)
    assert ext is not None, "the C++ CPU kernels did not build"
    return ext


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("qtype", list(DTYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("T, N, K, threads", [(1, 5, 32, 1), (13, 37, 608, 2), (70, 16, 2400, 1), (7, 200, 96, 2)])
def test_dense_gemm_matches_fp64(ext, qtype, T, N, K, threads):
    g = torch.Generator().manual_seed(T * N + K)
    w = torch.randn(N, K, generator=g).to(DTYPES[qtype])
    x = torch.randn(T, K, generator=g)
    raw = w.view(torch.uint8).reshape(N, -1).contiguous()
    y = ext.dense_gemm(x, raw, int(qtype), N, K, threads)
    ref = x.double() @ w.double().T
    assert y.shape == (T, N) and rel(y, ref) < 2e-6


@pytest.mark.parametrize("qtype", list(DTYPES), ids=lambda t: t.name)
def test_long_prompts_take_the_gemm_through_qlinear(ext, qtype):
    """qlinear past QMATVEC_MAX_ROWS on a loaded (packed) dense weight, with a bias and a 3-D x."""
    g = torch.Generator().manual_seed(int(qtype))
    N, K = 45, 320
    w = torch.randn(N, K, generator=g).to(DTYPES[qtype])
    packed = pack_for_cpu(BlockQWeight.from_blocks(w.view(torch.uint8).reshape(N, -1), qtype, torch.float32), ext)
    x, b = torch.randn(1, 100, K, generator=g), torch.randn(N, generator=g)
    y = qlinear(x, packed, b)
    assert y.shape == (1, 100, N) and rel(y, x.double() @ w.double().T + b.double()) < 2e-6
