"""kernels/triton_norm_fused.py (the decode step's q/k norms with rope and the cache writes; Gemma's post
norms with the residual add) against the compositions they replace in backends/cuda_graph.GraphDecoder,
bit for bit, and the decode step of q/k-norm configs (Gemma 3, Qwen3) against the torch forward; on the
CPU under Triton's interpreter like tests/test_triton_families.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from test_triton_kernels import TINY, check_decode_steps, check_verify_rows, rel  # noqa: E402  (re-decorates first)
from test_triton_families import GEMMA  # noqa: E402
from localllm.backends.cuda import covers  # noqa: E402
from localllm.kernels.triton_attention import rope_store  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed, to_fixed  # noqa: E402
from localllm.kernels.triton_norm_fused import add_normed, norm_rope_store  # noqa: E402
from localllm.kernels.triton_prefill import rmsnorm_rows  # noqa: E402
from localllm.kernels.triton_rope import rope_store_family  # noqa: E402

GEMMA3 = replace(GEMMA, qk_norm=True, attn_softcap=None, final_softcap=None)  # Gemma 3: q/k norms, no soft-caps
QWEN3 = replace(TINY, qk_norm=True)  # the Llama layer with q/k norms (Qwen3 dense)


def accumulator(rows: int, width: int, seed: int) -> torch.Tensor:
    """A q|k|v accumulator's int64 fixed-point sums of values of a few units."""
    g = torch.Generator().manual_seed(seed)
    return to_fixed(3 * torch.randn(rows, width, generator=g))


def composition(acc, kc, vc, pos, inv_freq, qw, kw, eps, H, HKV, D, rotary, factor, llama):
    """GraphDecoder's q/k-norm path before the fused kernel: from_fixed, split, the RMSNorm modules
    (CudaRuntime's ops: rmsnorm_rows), cat, zero_, then rope_store_family (rope_store: the Llama layer)."""
    rows = acc.shape[0]
    q, k, v = from_fixed(acc).split([H * D, HKV * D, HKV * D], -1)
    q = rmsnorm_rows(q.reshape(-1, D), qw, eps).reshape(rows, -1)
    k = rmsnorm_rows(k.reshape(-1, D), kw, eps).reshape(rows, -1)
    qkv = torch.cat((q, k, v), -1)
    acc.zero_()
    if llama:
        return rope_store(qkv.contiguous(), kc, vc, pos, inv_freq, H, HKV, D)
    return rope_store_family(qkv.contiguous(), kc, vc, pos, inv_freq, H, HKV, D, rotary, factor)


@pytest.mark.parametrize("D,rotary,factor,nope,llama,wdtype", [
    (32, 32, 1.0, False, False, torch.float32),
    (64, 64, 1.0, False, True, torch.bfloat16),  # Qwen3: the Llama layer's rope_store
    (64, 32, 1.25, False, False, torch.bfloat16),  # partial rotary with an attention factor
    (64, 64, 1.0, True, False, torch.bfloat16),  # NoPE
    (256, 256, 1.0, False, False, torch.bfloat16),  # Gemma 3's heads
])
def test_norm_rope_store_equals_the_composition(D, rotary, factor, nope, llama, wdtype):
    """Gemma 3-like heads (8 q, 4 kv), 2 sequences of 2 tokens: q, the caches' rows (bf16 caches:
    the runtime's) and the cleared accumulator equal the composition's bit for bit."""
    H, HKV, B, T, S = 8, 4, 2, 2, 8
    acc = accumulator(B * T, (H + 2 * HKV) * D, seed=D + rotary)
    g = torch.Generator().manual_seed(5)
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=g)).to(wdtype) for _ in range(2))
    inv_freq = None if nope else 1.0 / (1e4 ** (torch.arange(0, rotary, 2).float() / rotary))
    pos = torch.tensor([5], dtype=torch.int32)
    cdtype = torch.bfloat16 if wdtype == torch.bfloat16 else torch.float32
    caches = [(torch.zeros(B, HKV, S, D, dtype=cdtype), torch.zeros(B, HKV, S, D, dtype=cdtype)) for _ in range(2)]
    ref_acc = acc.clone()
    want = composition(ref_acc, *caches[0], pos, inv_freq, qw, kw, 1e-6, H, HKV, D, rotary, factor, llama)
    got = norm_rope_store(acc, *caches[1], pos, inv_freq, qw, kw, 1e-6, H, HKV, D, rotary, factor)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert caches[1][0][:, :, 5:7].abs().sum() > 0 and not acc.any()


def test_norm_rope_store_normalises_each_head():
    """The oracle itself, not the composition: q head = rope(model.rmsnorm(head)) in fp32."""
    from localllm.model import rmsnorm
    from localllm.rope import rope_rotate, rope_table

    H, HKV, D = 2, 1, 32
    acc = accumulator(1, (H + 2 * HKV) * D, seed=9)
    x = from_fixed(acc)
    qw = torch.full((D,), 0.5)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, D, 2).float() / D))
    kc, vc = torch.zeros(HKV, 4, D), torch.zeros(HKV, 4, D)
    q = norm_rope_store(acc, kc, vc, torch.tensor([3], dtype=torch.int32), inv_freq, qw, qw, 1e-6, H, HKV, D, D)
    cos, sin = rope_table(torch.tensor([3]), 1e4, D, None, 1.0)
    want = rope_rotate(rmsnorm(x[:, :H * D].view(1, H, 1, D), qw, 1e-6), cos, sin)[0, :, 0]
    assert rel(q, want) < 1e-6 and torch.equal(vc[:, 3], x[:, (H + HKV) * D:].view(HKV, D))


@pytest.mark.parametrize("C,dtype,fixed", [(256, torch.float32, False), (320, torch.bfloat16, False),
                                           (256, torch.float32, True), (320, torch.bfloat16, True)])
def test_add_normed_equals_the_composition(C, dtype, fixed):
    """x += to_fixed(rmsnorm_rows(h)) in one kernel, bit for bit (C 320: a masked block); h as a
    product's int64 accumulator (fixed): its values rounded to the activation dtype first, as the
    product's output was, and the accumulator left zero. (The accumulator's values are bf16 values
    here: Triton's interpreter rounds fp32 -> bf16 toward zero, CUDA and torch to nearest even, so
    the rounding itself is tests/gpu/test_gpu_norm_fused.py's.)"""
    g = torch.Generator().manual_seed(C)
    x = to_fixed(torch.randn(3, C, generator=g))
    h = 4 * torch.randn(3, C, generator=g)
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(dtype)
    if fixed:
        h = to_fixed(h.to(dtype).float())
        want = x + to_fixed(rmsnorm_rows(from_fixed(h).to(dtype), w, 1e-6))
    else:
        h = h.to(dtype)
        want = x + to_fixed(rmsnorm_rows(h, w, 1e-6))
    got = add_normed(x, h, w, 1e-6, dtype)
    assert got is x and torch.equal(got, want)
    assert not fixed or not h.any()


def test_the_qk_norm_configs_take_the_graph_path():
    assert covers(GEMMA3) and covers(QWEN3) and QWEN3.llama_layer and not GEMMA3.llama_layer


@pytest.mark.parametrize("name,wtype", [("gemma3", "Q8_0"), ("gemma3", "f32"), ("qwen3", "Q4_K_M"), ("qwen3", "f32")])
def test_qk_norm_decode_step_matches_model_forward(name, wtype, monkeypatch):
    """GraphDecoder (eager here) with q/k norms gives the fp32 reference model's logits."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    dec = check_decode_steps({"gemma3": GEMMA3, "qwen3": QWEN3}[name], wtype)
    assert not dec.qkv_acc.any()


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_qk_norm_verify_rows_equal_single_steps(name, monkeypatch):
    """A verify pass of 3 tokens gives each row's logits bit for bit as one-token steps."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    check_verify_rows({"gemma3": GEMMA3, "qwen3": QWEN3}[name])


@pytest.mark.parametrize("C", [256, 320])
def test_add_normed_quantizes_the_next_products_input(C):
    """With quantize: x as without it, and the next product's int8 input as quantize_act(x, weight,
    eps) gives it, bit for bit."""
    from localllm.kernels.triton_quant_act import quantize_act

    g = torch.Generator().manual_seed(C + 1)
    x = to_fixed(torch.randn(2, C, generator=g))
    h = to_fixed(3 * torch.randn(2, C, generator=g))
    w, nw = (1 + 0.2 * torch.randn(2, C, generator=g)).unbind(0)
    want_x = add_normed(x.clone(), h.clone(), w, 1e-6)
    got_x, xq = add_normed(x, h, w, 1e-6, quantize=(nw, 1e-5))
    assert torch.equal(got_x, want_x) and not h.any()
    for got, want in zip(xq, quantize_act(want_x, nw, 1e-5)):
        assert torch.equal(got, want)
