"""The families beyond the Llama layer on CUDA (CudaRuntime's family path: kernels/triton_rope.py, the
attention variants, gelu GLUs, scaled embeddings, post norms, soft-caps), on random weights of real
widths built directly (synthetic.synthetic_state; no GGUF writer needed), against the same weights on
the CPU in fp32; the bounds of test_gpu_logits.py. Greedy graph steps give decode + argmax's ids, and a
verify pass gives plain steps' logits bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from .gpu_helpers import (check_greedy_graph_and_verify, check_logits, check_speculative_equals_plain,
                          random_ids, take_dense_values)

PROMPT, STEPS = 40, 8


def shapes():
    from localllm.config import ModelConfig

    base = ModelConfig(arch="gemma3", n_layers=4, dim=2560, ffn_dim=10240, n_heads=8, n_kv_heads=4, head_dim=256,
                       vocab_size=32000, context_length=4096, norm_eps=1e-6, rope_theta=1e6)
    gemma3 = replace(base, qk_norm=True, embed_scale=2560**0.5, activation="gelu_tanh", post_norms=True,
                     attn_scale=256**-0.5, sliding_window=16, sliding_layers=(True, True, False, True),
                     rope_theta_local=1e4, tied_output=True)
    gemma2 = replace(gemma3, arch="gemma2", qk_norm=False, attn_softcap=50.0, final_softcap=30.0,
                     attn_scale=224**-0.5, rope_theta_local=None, rope_theta=1e4)
    phi4 = ModelConfig(arch="phi3", n_layers=4, dim=3072, ffn_dim=8192, n_heads=24, n_kv_heads=8, head_dim=128,
                       vocab_size=32000, context_length=4096, norm_eps=1e-5, rope_theta=1e4, rotary_dim=96,
                       rope_attn_factor=1.19, rope_layers=(True, True, False, True))
    sinks = ModelConfig(arch="gpt-oss", n_layers=4, dim=2880, ffn_dim=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                        vocab_size=32000, context_length=4096, norm_eps=1e-5, rope_theta=15e4, qkv_bias=True,
                        attn_out_bias=True, attn_sinks=True, sliding_window=16, sliding_layers=(True, False) * 2)
    return {"gemma3": gemma3, "gemma2": gemma2, "phi4": phi4, "sinks": sinks}


def runtimes(name: str, wtype: str):
    """(CudaRuntime bf16, CPU fp32 dense reference) of the same random weights."""
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    cfg = shapes()[name]
    state, _ = synthetic_state(cfg, wtype, "cpu", seed=3)
    gpu = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    assert isinstance(gpu, CudaRuntime)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    take_dense_values(ref.model, gpu.model)
    return gpu, ref


@pytest.mark.parametrize("wtype", ["bf16", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi4", "sinks"])
@torch.inference_mode()
def test_family_logits_match_cpu_fp32(name, wtype):
    check_logits(*runtimes(name, wtype), PROMPT, STEPS)


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi4", "sinks"])
@torch.inference_mode()
def test_family_greedy_graph_and_verify(name, steps=24):
    """greedy_step (graph) == decode + argmax, and a verify pass of 6 ids == 6 plain steps bit for bit."""
    check_greedy_graph_and_verify(runtimes(name, "Q4_K_M")[0], PROMPT, steps)


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi4", "sinks"])
@torch.inference_mode()
def test_family_greedy_speculative_equals_plain(name, n=40):
    """Prompt lookup on a repetitive prompt (a block of 48 random ids three times): verify passes give
    plain greedy decoding's ids (sliding windows of 16 are crossed)."""
    gpu, _ = runtimes(name, "Q4_K_M")
    check_speculative_equals_plain(gpu, random_ids(gpu.cfg.vocab_size, 48, seed=7) * 3, n)
