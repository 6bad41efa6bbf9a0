"""The decode step's kernels for the families beyond the Llama layer (kernels/triton_rope.py, the
attention variants of kernels/triton_attention.py, gelu GLUs, scaled embeddings, post norms: the
family path of backends/cuda_graph.GraphDecoder) against the torch reference (model.py, rope.py,
attention.py), on the CPU under Triton's interpreter like tests/test_triton_kernels.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from test_triton_kernels import TINY, check_decode_steps, check_verify_rows, rel  # noqa: E402  (re-decorates first)
from localllm.attention import attend, attention_mask  # noqa: E402
from localllm.backends import runtime_class  # noqa: E402
from localllm.backends.cuda import CudaEagerRuntime, CudaRuntime, covers  # noqa: E402
from localllm.kernels import triton_attention  # noqa: E402
from localllm.kernels.triton_rope import rope_store_family  # noqa: E402
from localllm.rope import rope_rotate, rope_table  # noqa: E402

# gemma-like: scaled embedding, gelu, post norms, scale, soft-caps, sliding layers with their own base
GEMMA = replace(TINY, n_layers=3, embed_scale=16.0, activation="gelu_tanh", post_norms=True, attn_scale=0.1,
                attn_softcap=5.0, final_softcap=3.0, sliding_window=3, sliding_layers=(True, False, True),
                rope_theta_local=100.0)
# phi-like partial rotary with an attention factor, a NoPE layer (SmolLM3), every layer sliding
PHI = replace(TINY, n_layers=3, rotary_dim=32, rope_attn_factor=1.25, rope_layers=(True, False, True),
              sliding_window=4, sliding_layers=(True, True, True))
# gpt-oss-like attention: sinks, attn_output bias, alternating windows
SINKS = replace(TINY, attn_sinks=True, attn_out_bias=True, sliding_window=3, sliding_layers=(True, False))
FAMILIES = {"gemma": GEMMA, "phi": PHI, "sinks": SINKS}


def test_the_cuda_backend_covers_these_families_and_not_gemma4_experts():
    """(Mixtral-style experts are covered: tests/test_triton_moe_decode.py; Gemma 4's beside a dense
    MLP are not.)"""
    for cfg in FAMILIES.values():
        assert covers(cfg) and runtime_class("cuda", cfg) is CudaRuntime
    moe = replace(TINY, n_experts=4, n_experts_used=2, expert_ffn_dim=64, moe_with_mlp=True)
    assert not covers(moe) and runtime_class("cuda", moe) is CudaEagerRuntime


@pytest.mark.parametrize("rotary,factor,nope", [(64, 1.0, False), (32, 1.25, False), (32, 1.0, True)])
def test_rope_store_family_matches_rope_rotate(rotary, factor, nope):
    """q rotated and the cache's k rotated / v written at pos, as rope.rope_rotate with rope_table's
    angles; an int64 accumulator is left zero."""
    H, HKV, D, pos = 4, 2, 64, 5
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, (H + 2 * HKV) * D, generator=g)
    kc, vc = torch.zeros(HKV, 8, D), torch.zeros(HKV, 8, D)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    p = torch.tensor([pos], dtype=torch.int32)
    acc = (qkv.double() * 2.0**32).to(torch.int64)
    acc0 = acc.clone()
    q = rope_store_family(acc, kc, vc, p, None if nope else inv_freq, H, HKV, D, rotary, factor, clear=True)
    assert not acc.any()
    x = (acc0.double() / 2.0**32).float()  # the values the accumulator held
    qs, ks, vs = x.split([H * D, HKV * D, HKV * D], -1)
    cos, sin = rope_table(torch.tensor([pos]), 10000.0, rotary, None, factor)
    def rot(t, heads):
        t = t.view(1, heads, 1, D)
        return t[0, :, 0] if nope else rope_rotate(t, cos, sin)[0, :, 0]
    assert rel(q, rot(qs, H)) < 1e-6
    assert rel(kc[:, pos], rot(ks, HKV)) < 1e-6 and torch.equal(vc[:, pos], vs.view(HKV, D))


@pytest.mark.parametrize("variant", ["window", "all"])
def test_attention_variants_match_attend(variant):
    """decode_attention with a scale, soft-cap, window and sinks against attention.attend on the same
    cache rows (T = 2 tokens: a verify pass's rows, each at its own position)."""
    H, HKV, D, S, pos, T = 4, 2, 64, 80, 70, 2  # S > one 64-row chunk: windows cross chunks
    g = torch.Generator().manual_seed(4)
    q = torch.randn(T * H, D, generator=g)
    kc, vc = torch.randn(HKV, S, D, generator=g), torch.randn(HKV, S, D, generator=g)
    sinks = torch.randn(H, generator=g)
    kw = dict(scale=0.2, softcap=2.0 if variant in ("softcap", "all") else None,
              window=5 if variant in ("window", "all") else None, sinks=sinks if variant in ("sinks", "all") else None)
    got = triton_attention.decode_attention(q, kc, vc, torch.tensor([pos], dtype=torch.int32), HKV, tokens=T, **kw)
    cfg = replace(TINY, attn_scale=kw["scale"], attn_softcap=kw["softcap"])
    positions = torch.arange(pos, pos + T)
    mask = attention_mask(positions, pos + T, kw["window"])
    qs = q.view(T, H, D).transpose(0, 1)[None]
    want = attend(cfg, qs, kc[None, :, :pos + T], vc[None, :, :pos + T],
                  mask if mask is not None else torch.ones(T, pos + T, dtype=torch.bool).tril(pos), kw["sinks"])
    assert rel(got, want[0].transpose(0, 1).reshape(T, H * D)) < 1e-5


@pytest.mark.parametrize("family,wtype", [("gemma", "Q8_0"), ("gemma", "f32"), ("phi", "Q8_0"), ("sinks", "f32")])
def test_family_decode_step_matches_model_forward(family, wtype, monkeypatch):
    """GraphDecoder's family path (eager here) gives the fp32 reference model's logits over steps that
    pass the sliding window, the reference quantizing integer-product inputs as the kernels do."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    check_decode_steps(FAMILIES[family], wtype)


@pytest.mark.parametrize("family", ["gemma", "sinks"])
def test_family_verify_rows_equal_single_steps(family, monkeypatch):
    """A verify pass of 3 tokens gives each row's logits bit for bit as one-token steps (speculative
    decoding's greedy ids are plain decoding's)."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    check_verify_rows(FAMILIES[family])
