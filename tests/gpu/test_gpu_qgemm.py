"""kernels/triton_qgemm.py on the GPU: the fused quantized prompt GEMM against x @ dequantize_torch(W).T in
float64, for every type it covers, bf16 and fp16 activations, ragged M and N, a bias, row views, and the
configurations bench/qgemm_sweep.py sweeps (each that fits the card's shared memory).

Tolerance (tests/qgemm_oracle.py): 2^-8 (sum_k |x_k w_k| + |y|) + 2^-12 sum_k |x_k w_k| + 1e-5 per output
element: each decoded weight and y rounded to nearest in x's dtype (at most 2^-8 of the value in bf16, the
coarser), fp32 sums (tests/test_triton_qgemm.py gives the interpreter 2^-7: it truncates)."""

from __future__ import annotations

import gguf
import pytest
import torch
from qgemm_oracle import assert_close

from localllm.quantize import dequantize_torch, quantize_tensor

pytestmark = pytest.mark.cuda
Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS]


def weight(qtype, n: int, k: int):
    from localllm.kernels.qweight import QWeight

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    w[1, : k // 2] *= 40  # scales far apart inside one row
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    return dequantize_torch(raw, qtype).double().cuda(), QWeight.from_raw(raw.cuda(), qtype).to_blocks()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_qgemm_matches_the_decoded_product(qtype, dtype):
    # imported here, not at collection: a CPU run's Triton tests need triton imported under its interpreter
    from localllm.kernels import triton_qgemm

    k = 768 if qtype in (Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_NL) else 1024
    ref, w = weight(qtype, 200, k)
    x = torch.randn(300, k, device="cuda", dtype=dtype)
    bias = torch.randn(200, device="cuda", dtype=dtype)
    assert_close(triton_qgemm.qgemm(x, w, bias), x, ref, bias)
    assert_close(triton_qgemm.qgemm(x[:37], w.rows(3, 190, 7)), x[:37], ref[3:190:7])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_every_swept_config(qtype):
    """bench/qgemm_sweep.py's configurations give the same products (those that launch)."""
    import sys
    from pathlib import Path

    from triton.runtime.errors import OutOfResources

    from localllm.kernels import triton_qgemm

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from qgemm_sweep import SWEEP

    ref, w = weight(qtype, 384, 1024)
    x = torch.randn(520, 1024, device="cuda", dtype=torch.bfloat16)
    launched = 0
    for cfg in SWEEP:
        try:
            got = triton_qgemm.qgemm(x, w, config=cfg)
        except OutOfResources:
            continue
        assert_close(got, x, ref)
        launched += 1
    assert launched >= len(SWEEP) // 2
