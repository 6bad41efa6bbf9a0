"""kernels/triton_dequant.py on the GPU: block-major weights decode to quantize.dequantize_torch's values,
rounded to nearest bf16 / fp16 (the interpreter truncates, so tests/test_triton_dequant.py can only bound
its bf16 values), and a prompt product through kernels.linear equals the decoded matmul."""

from __future__ import annotations

import gguf
import pytest
import torch

from localllm.quantize import dequantize_torch, quantize_tensor

pytestmark = pytest.mark.cuda
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_block_major_decoder_equals_reference(qtype, dtype):
    # imported here, not at collection: a CPU run's Triton tests need triton imported under its interpreter
    from localllm.kernels import linear, triton_dequant
    from localllm.kernels.qweight import QWeight

    w = torch.randn(200, 768 if qtype in (Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_NL) else 1024, generator=torch.Generator().manual_seed(1))
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    ref = dequantize_torch(raw, qtype).cuda()
    qw = QWeight.from_raw(raw.cuda(), qtype).to_blocks()
    assert torch.equal(triton_dequant.dequantize(qw, dtype), ref.to(dtype))
    assert torch.equal(triton_dequant.dequantize(qw.rows(3, 190, 7), dtype), ref[3:190:7].to(dtype))
    x = torch.randn(64, w.shape[1], device="cuda", dtype=dtype)
    assert torch.equal(linear.qlinear(x, qw), torch.nn.functional.linear(x, ref.to(dtype)))
