"""kernels/triton_norm_fused.py on CUDA: the fused q/k-norm + rope + cache kernel and the post-norm add
against the compositions they replaced (bit for bit under the interpreter: tests/test_triton_norm_fused.py;
here the compiled reductions may sum in another order: within one rounding of the norm's output), and
the Llama layer with q/k norms (Qwen3 dense; Gemma 3 is tests/gpu/test_gpu_families.py's) against the
CPU fp32 model, greedy graph steps and verify rows, with test_gpu_families.py's bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from .gpu_helpers import check_greedy_graph_and_verify, check_logits, take_dense_values

PROMPT, STEPS = 40, 8


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for a few values a bf16 rounding of the norm apart (the norm's fp32 sum of squares
    in another order can move a rounding)."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    assert diff.max() <= 2.0**-6 * want.abs().max(), diff.max().item()
    assert (diff > 0).float().mean() < 0.02, (diff > 0).float().mean().item()


@pytest.mark.parametrize("H,HKV,D,rotary", [(8, 4, 256, 256), (16, 8, 128, 128), (24, 8, 128, 96)])
def test_norm_rope_store_matches_the_composition(H, HKV, D, rotary):
    from localllm.kernels.triton_epilogue import from_fixed, to_fixed
    from localllm.kernels.triton_norm_fused import norm_rope_store
    from localllm.kernels.triton_prefill import rmsnorm_rows
    from localllm.kernels.triton_rope import rope_store_family

    dev, B, S, p = "cuda", 2, 64, 37
    g = torch.Generator(device=dev).manual_seed(1)
    acc = to_fixed(3 * torch.randn(B, (H + 2 * HKV) * D, generator=g, device=dev))
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=g, device=dev)).bfloat16() for _ in range(2))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary, 2, device=dev).float() / rotary))
    pos = torch.tensor([p], dtype=torch.int32, device=dev)
    caches = [[torch.zeros(B, HKV, S, D, dtype=torch.bfloat16, device=dev) for _ in range(2)] for _ in range(2)]
    q, k, v = from_fixed(acc).split([H * D, HKV * D, HKV * D], -1)
    qkv = torch.cat((rmsnorm_rows(q.reshape(-1, D), qw, 1e-6).reshape(B, -1),
                     rmsnorm_rows(k.reshape(-1, D), kw, 1e-6).reshape(B, -1), v), -1)
    want = rope_store_family(qkv, *caches[0], pos, inv_freq, H, HKV, D, rotary, 1.25)
    got = norm_rope_store(acc, *caches[1], pos, inv_freq, qw, kw, 1e-6, H, HKV, D, rotary, 1.25)
    assert not acc.any()
    close_in_bf16(got, want)
    close_in_bf16(caches[1][0][:, :, p], caches[0][0][:, :, p])
    assert torch.equal(caches[1][1], caches[0][1])


@pytest.mark.parametrize("fixed", [False, True])
def test_add_normed_matches_the_composition(fixed):
    """x += to_fixed(rmsnorm_rows(h)); fixed: h a product's int64 accumulator, rounded to bf16 as the
    product's output is (torch's rounding: to nearest even), and left zero."""
    from localllm.kernels.triton_epilogue import from_fixed, to_fixed
    from localllm.kernels.triton_norm_fused import add_normed
    from localllm.kernels.triton_prefill import rmsnorm_rows

    g = torch.Generator(device="cuda").manual_seed(2)
    x = to_fixed(torch.randn(3, 2560, generator=g, device="cuda"))
    h = 4 * torch.randn(3, 2560, generator=g, device="cuda")
    w = (1 + 0.2 * torch.randn(2560, generator=g, device="cuda")).bfloat16()
    h = to_fixed(h) if fixed else h.bfloat16()
    want = from_fixed(x + to_fixed(rmsnorm_rows(from_fixed(h).bfloat16() if fixed else h, w, 1e-6)))
    got = from_fixed(add_normed(x.clone(), h, w, 1e-6, torch.bfloat16))
    close_in_bf16(got, want)
    assert not fixed or not h.any()


def test_add_normed_quantizes_like_quantize_act():
    """add_normed's quantize: the next product's int8 input as quantize_act(x) gives it (its norm's
    sum in another order may move a value by one step)."""
    from localllm.kernels.triton_epilogue import from_fixed, to_fixed
    from localllm.kernels.triton_norm_fused import add_normed
    from localllm.kernels.triton_quant_act import quantize_act

    g = torch.Generator(device="cuda").manual_seed(3)
    x = to_fixed(torch.randn(3, 2560, generator=g, device="cuda"))
    h = to_fixed(4 * torch.randn(3, 2560, generator=g, device="cuda"))
    w, nw = (1 + 0.2 * torch.randn(2, 2560, generator=g, device="cuda")).bfloat16().unbind(0)
    want_x = add_normed(x.clone(), h.clone(), w, 1e-6, torch.bfloat16)
    got_x, (q, d, s) = add_normed(x, h, w, 1e-6, torch.bfloat16, quantize=(nw, 1e-6))
    close_in_bf16(from_fixed(got_x), from_fixed(want_x))
    wq, wd, ws = quantize_act(got_x, nw, 1e-6)
    assert (q.int() - wq.int()).abs().max() <= 1 and torch.allclose(d, wd, rtol=1e-6, atol=0)
    assert (s - ws).abs().max() <= 16


def runtimes(wtype: str):
    """(CudaRuntime bf16, CPU fp32 dense reference) of a Qwen3 shape's random weights (4 layers)."""
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.registry import shape_preset
    from localllm.synthetic import synthetic_state

    cfg = replace(shape_preset("qwen3-0.6b"), n_layers=4, vocab_size=32000)
    assert cfg.qk_norm and cfg.llama_layer
    state, _ = synthetic_state(cfg, wtype, "cpu", seed=3)
    gpu = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    assert isinstance(gpu, CudaRuntime)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    take_dense_values(ref.model, gpu.model)
    return gpu, ref


@pytest.mark.parametrize("wtype", ["bf16", "Q4_K_M"])
@torch.inference_mode()
def test_qwen3_logits_match_cpu_fp32(wtype):
    check_logits(*runtimes(wtype), PROMPT, STEPS)


@torch.inference_mode()
def test_qwen3_greedy_graph_and_verify(steps=24):
    """greedy_step (graph) == decode + argmax, and a verify pass of 6 ids == 6 plain steps bit for bit."""
    check_greedy_graph_and_verify(runtimes("Q4_K_M")[0], PROMPT, steps)
