"""Mixture-of-experts decode inside CudaRuntime's CUDA graph (backends/cuda_moe.py, kernels/triton_moe.py)
at real widths: Qwen3-30B-A3B's (128 experts, top 8, 768 wide), gpt-oss-20b's (32 experts, top 4,
clamped SwiGLU, biases, sinks) and Mixtral's layer shapes (few layers, random weights: synthetic
.synthetic_state), against the same weights on the CPU in fp32 (the bounds of test_gpu_families.py);
greedy graph steps == decode + argmax, a verify pass == plain steps bit for bit, greedy speculative
decoding == plain greedy decoding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from .gpu_helpers import (check_greedy_graph_and_verify, check_logits, check_speculative_equals_plain,
                          random_ids, take_dense_values)

PROMPT, STEPS = 40, 8


def shapes():
    from localllm.config import ModelConfig

    # real widths and top-k; fewer experts and layers than the released models: the CPU fp32 reference
    # holds every expert dense (Qwen3's 128 x 3 layers were 7 GB and minutes to build)
    qwen3moe = ModelConfig(arch="qwen3moe", n_layers=2, dim=2048, ffn_dim=6144, n_heads=32, n_kv_heads=4,
                           head_dim=128, vocab_size=32000, context_length=4096, norm_eps=1e-6, rope_theta=1e6,
                           qk_norm=True, n_experts=32, n_experts_used=8, expert_ffn_dim=768)
    gptoss = ModelConfig(arch="gpt-oss", n_layers=2, dim=2880, ffn_dim=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                         vocab_size=32000, context_length=4096, norm_eps=1e-5, rope_theta=15e4, qkv_bias=True,
                         attn_out_bias=True, attn_sinks=True, sliding_window=16, sliding_layers=(True, False),
                         n_experts=8, n_experts_used=4, expert_ffn_dim=2880, activation="swiglu_oai",
                         swiglu_limit=7.0, moe_bias=True, moe_gating="topk_softmax")
    mixtral = ModelConfig(arch="llama", n_layers=2, dim=1024, ffn_dim=3584, n_heads=16, n_kv_heads=4, head_dim=64,
                          vocab_size=32000, context_length=4096, norm_eps=1e-5, rope_theta=1e6,
                          n_experts=8, n_experts_used=2, expert_ffn_dim=3584)
    return {"qwen3moe": qwen3moe, "gptoss": gptoss, "mixtral": mixtral}


def runtimes(name: str, wtype: str):
    """(CudaRuntime bf16, CPU fp32 dense reference) of the same random weights; wtype MXFP4: experts
    MXFP4, the rest Q8_0."""
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    cfg = shapes()[name]
    state, _ = synthetic_state(cfg, "Q8_0" if wtype == "MXFP4" else wtype, "cpu", seed=3)
    if wtype == "MXFP4":
        import gguf
        from moe_states import experts_as

        state = experts_as(state, gguf.GGMLQuantizationType.MXFP4)
    gpu = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    assert isinstance(gpu, CudaRuntime)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    take_dense_values(ref.model, gpu.model)
    return gpu, ref


@pytest.mark.parametrize("name,wtype", [("qwen3moe", "Q4_K_M"), ("qwen3moe", "Q8_0"), ("qwen3moe", "bf16"),
                                        ("gptoss", "MXFP4"), ("gptoss", "Q8_0"), ("mixtral", "Q4_K_M")])
@torch.inference_mode()
def test_moe_logits_match_cpu_fp32(name, wtype):
    check_logits(*runtimes(name, wtype), PROMPT, STEPS)


@pytest.mark.parametrize("name,wtype", [("qwen3moe", "Q4_K_M"), ("gptoss", "MXFP4"), ("mixtral", "bf16")])
@torch.inference_mode()
def test_moe_greedy_graph_and_verify(name, wtype, steps=24):
    """greedy_step (graph) == decode + argmax, and a verify pass of 6 ids == 6 plain steps bit for bit."""
    check_greedy_graph_and_verify(runtimes(name, wtype)[0], PROMPT, steps)


@pytest.mark.parametrize("name,wtype", [("qwen3moe", "Q4_K_M"), ("gptoss", "MXFP4")])
@torch.inference_mode()
def test_moe_greedy_speculative_equals_plain(name, wtype, n=40):
    """Prompt lookup on a repetitive prompt drafts up to 5 ids a round (verify passes of several rows)."""
    rt, _ = runtimes(name, wtype)
    check_speculative_equals_plain(rt, random_ids(rt.cfg.vocab_size, 32, seed=2) * 4, n)


def test_moe_shapes_take_the_graph_runtime():
    from localllm.backends import runtime_class
    from localllm.backends.cuda import CudaRuntime

    for cfg in shapes().values():
        assert runtime_class("cuda", cfg) is CudaRuntime
    assert runtime_class("cuda", replace(shapes()["mixtral"], expert_ffn_dim=3600)) is not CudaRuntime
