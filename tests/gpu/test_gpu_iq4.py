"""IQ4_NL / IQ4_XS weights on CUDA (kernels/triton_gemv.py decode_tile's table lookup, through the fused
matvec, prefill and the decode graph) against the same weights on the CPU in fp32 (the C++ kernels'
values, equal to gguf's): test_gpu_logits.py's bounds, and the greedy graph and verify pass equal to
plain decode steps. (tests/gpu/test_gpu_kernels.py also runs both types through every product kernel:
they are KERNEL_TYPES.)"""

from __future__ import annotations

import pytest
import torch
from .gpu_helpers import check_greedy_graph_and_verify, check_logits, take_dense_values


@pytest.mark.parametrize("case", [("smollm2-135m", "IQ4_NL", None), ("llama-3.2-1b", "IQ4_XS", 4)],
                         ids=lambda c: c[1])
@torch.inference_mode()
def test_iq4_logits_and_greedy_graph(synthetic_files, case):
    from localllm.load import load_model

    preset, wtype, layers = case
    path = synthetic_files.gguf(preset, wtype, layers)
    gpu = load_model(str(path), "cuda", torch.bfloat16).runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    assert take_dense_values(ref.model, gpu.model) > 0
    check_logits(gpu, ref, prompt=14, steps=6)
    check_greedy_graph_and_verify(gpu, prompt_len=9)
