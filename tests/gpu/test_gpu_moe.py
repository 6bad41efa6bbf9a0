"""Mixture-of-experts models on CUDA against the CPU fp32 reference of the same file (tests/test_moe.py
checks that one against transformers): CudaRuntime (prompts: the torch forward, each expert's product on
its row view, kernels.linear.linear_rows; decode: the graph step's device routing and expert kernels,
backends/cuda_moe.py).

The tiny MoE models of tiny_models.MOE_CASES as GGUF: F32 (CUDA fp32: the same math, bound 1e-3), and
Q8_0 / Q4_K / MXFP4 experts in bf16 (the bounds of test_gpu_logits.py: quantized activations and bf16
rounding, not a wrong expert: a wrong routing or row range gives errors near 1). Q4_K: 256 wide (its
super-blocks), experts only; the router stays fp32 on the GPU (llama.cpp's F32 router).
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

import tiny_models as tm
from tiny_gguf import gguf_tensors, write_gguf
from tiny_tokenizer import vocab_size

from .gpu_helpers import random_ids, rel, round_inputs_as_int_dot, take_dense_values

Q = gguf.GGMLQuantizationType
PROMPT, STEPS = 10, 5


def mxfp4_experts(spec) -> dict:
    """GGUF name -> (raw, MXFP4) for every expert tensor (llama.cpp's gpt-oss files hold them so)."""
    return {n: (gguf.quants.quantize(d.reshape(-1, d.shape[-1]), Q.MXFP4).reshape(*d.shape[:-1], -1), Q.MXFP4)
            for n, d in gguf_tensors(spec).items() if "_exps.weight" in n}


def q4k_experts(spec) -> dict:
    """GGUF name -> (raw, Q4_K) for every expert tensor, the rest F32."""
    from localllm.quantize import quantize_tensor

    return {n: (quantize_tensor(torch.from_numpy(d.reshape(-1, d.shape[-1]).copy()), Q.Q4_K).reshape(*d.shape[:-1], -1),
                Q.Q4_K) for n, d in gguf_tensors(spec).items() if "_exps.weight" in n}


@pytest.mark.parametrize("wtype,dtype,bound", [("F32", torch.float32, 1e-3), ("Q8_0", torch.bfloat16, 5e-2),
                                               ("Q4_K", torch.bfloat16, 5e-2), ("MXFP4", torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("case", list(tm.MOE_CASES))
@torch.inference_mode()
def test_cuda_moe_logits_match_cpu_fp32(tmp_path, case, wtype, dtype, bound):
    from localllm.load import load_model

    from localllm.backends.cuda import CudaRuntime

    spec = tm.MOE_CASES[case]
    path = tmp_path / f"{case}-{wtype}.gguf"
    if wtype == "MXFP4":
        write_gguf(spec, path, raw=mxfp4_experts(spec))
    elif wtype == "Q4_K":
        spec = replace(spec, dim=256, ffn_dim=256, expert_ffn_dim=256)  # (Mixtral: ffn_dim is the experts')
        write_gguf(spec, path, raw=q4k_experts(spec))
    else:
        write_gguf(spec, path, Q[wtype])
    gpu = load_model(str(path), "cuda", dtype).runtime
    assert isinstance(gpu, CudaRuntime)
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    take_dense_values(ref.model, gpu.model)  # the GPU's bf16 router, norms, biases, sinks: the same choices
    ids = random_ids(vocab_size(), PROMPT + STEPS, seed=2)
    want, got = logits(ref, ids), logits(gpu, ids)
    bounds = [bound] * len(want)
    if dtype != torch.float32:  # and no tighter than the CPU's own bf16 forward of these weights allows
        cpu = load_model(str(path), "cpu", dtype, keep_quantized=False).runtime  # (test_gpu_gemma4's rule)
        take_dense_values(cpu.model, gpu.model)
        round_inputs_as_int_dot(cpu.model)  # the integer-dot kernels quantize their inputs
        bounds = [max(bound, 2 * rel(c, w)) for c, w in zip(logits(cpu, ids), want)]
    errs = [rel(g, w) for g, w in zip(got, want)]
    assert all(e < b for e, b in zip(errs, bounds)), (errs, bounds)


def logits(rt, ids: list[int]) -> list[torch.Tensor]:
    """The prompt's last logits (prefill), then one decode step's per id after it (k experts' rows per
    layer), fp32 on the CPU."""
    cache = rt.new_cache(32)
    out = [rt.prefill(cache, [ids[:PROMPT]], 0)[0].float().cpu()]
    for t in ids[PROMPT:]:
        out.append(rt.decode(cache, torch.tensor([t], device=rt.device))[0].float().cpu())
    return out
