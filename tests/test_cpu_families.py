"""The C++ one-call decoder (kernels/cpu_decode.cpp) on the layer fields of issue 19's dense families,
against the torch forward of model.py (the reference: rope.py, attention.py), on tiny random models
built from configs directly (synthetic.synthetic_state: Q8_0 / Q4_0 blocks, embedding included).

- each field switched on alone: logits of every C++ step equal the dense forward's (the inputs of
  quantized products rounded as the kernels round them: test_cpu_kernels.hooked_reference), and the
  cache rows match;
- one tiny model per family shape (Gemma 2, Gemma 3, Phi-3 partial rotary, SmolLM3 NoPE): greedy ids
  over 64 tokens equal the reference's;
- the tiny Gemma 2 / Gemma 3 GGUF files of tiny_models.py (Q8_0), loaded as a user loads them: the C++
  steps against the dense load's forward;
- backends.runtime_class: CpuRuntime (the C++ decoder) for these configs and MoE (tests/test_cpu_moe.py).
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from localllm.backends import runtime_class
from localllm.backends.cpu import CpuEagerRuntime, CpuRuntime, build_decoder, cpp_covers
from localllm.cache import make_cache
from localllm.config import ModelConfig
from localllm.generate import generate
from localllm.load import build_model, load_model
from localllm.runtime import Runtime
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings
from localllm.synthetic import quantize_embedding, synthetic_state
from test_cpu_kernels import hooked_reference, rel

BASE = ModelConfig(arch="llama", n_layers=4, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=32,
                   vocab_size=256, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
SLIDING = dict(sliding_window=3, sliding_layers=(True, False, True, False))
# One field (with what it needs) per case; values large enough that each changes the logits.
FEATURES = {
    "embed_scale": dict(embed_scale=8.0),
    "post_norms": dict(post_norms=True),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "attn_scale": dict(attn_scale=0.4),
    "attn_softcap": dict(attn_softcap=1.5, attn_scale=1.0),
    "final_softcap": dict(final_softcap=1.5),
    "attn_out_bias": dict(attn_out_bias=True),
    "attn_sinks": dict(attn_sinks=True),
    "sliding_window": SLIDING,
    "rope_theta_local": dict(SLIDING, rope_theta_local=100.0, rope_theta=1e6),
    "nope_layers": dict(rope_layers=(True, False, True, False)),
    "rotary_dim": dict(rotary_dim=16),
    "rope_attn_factor": dict(rope_attn_factor=0.7),
}


# Largest logit error / largest logit. These 4-layer random models carry ~1e-4 of noise (rounding flips
# of the int16 grid): the torch forward on the same blocks is as far from the reference as the C++
# steps are (measured 2.5e-5, 4.7e-5, 9e-5 for 1, 2, 4 layers); a wrong field costs 1e-2 or more.
TOL = 3e-4


def family(dim: int, layers: int, **fields) -> ModelConfig:
    return replace(BASE, n_layers=layers, dim=dim, ffn_dim=2 * dim, **fields)


# Tiny shapes of each dense family (the fields their loaders set; heads of 32 dims). Untied output: a
# random tied model repeats its prompt's last token (its own embedding wins), which would test nothing.
FAMILIES = {
    "gemma2": family(64, 4, arch="gemma2", embed_scale=8.0, activation="gelu_tanh", post_norms=True,
                     attn_scale=32**-0.5, attn_softcap=4.0, final_softcap=3.0, sliding_window=8,
                     sliding_layers=(True, False) * 2),
    "gemma3": family(64, 6, arch="gemma3", embed_scale=8.0, activation="gelu_tanh", post_norms=True, qk_norm=True,
                     attn_scale=32**-0.5, sliding_window=8, sliding_layers=(True,) * 5 + (False,),
                     rope_theta=1e6, rope_theta_local=10000.0),
    "phi3": family(96, 4, arch="phi3", n_heads=3, n_kv_heads=3, rotary_dim=24, rope_attn_factor=1.19),
    "smollm3": family(64, 4, arch="smollm3", rope_layers=(True, True, True, False)),
}


def models(cfg: ModelConfig, wtype: str) -> tuple[Runtime, Runtime]:
    """(the CPU backend's runtime on the blocks, the portable runtime on dense fp32 decoded weights
    whose products see their input rounded as the kernels round it), from the same random weights."""
    state = quantize_embedding(synthetic_state(cfg, wtype, "cpu", seed=7)[0], wtype)
    fast = build_model(cfg, dict(state), "cpu", torch.float32)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False, backend=Runtime)
    hooked_reference(ref.model, fast.model)
    return fast, ref


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_decode_step_matches_reference_with_each_field(feature, wtype):
    """A prompt through the torch forward (C++ products), then every later token one C++ call each:
    logits and cache rows as the reference forward's, at positions past the window too."""
    cfg = replace(BASE, **FEATURES[feature])
    assert not cfg.llama_layer and cpp_covers(cfg)
    rt, ref = models(cfg, wtype)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    cache, ref_cache = rt.new_cache(14), make_cache(cfg, 14)
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(cache) is not None
    with torch.inference_mode():
        rt.prefill(cache, tokens[:, :4].tolist(), 0)
        ref.model(tokens[:, :4], ref_cache, 0)
        for i in range(4, 12):
            got, want = rt.decode(cache, tokens[:, i])[:, None], ref.model(tokens[:, i:i + 1], ref_cache, i)
            assert rel(got, want) < TOL, f"step {i}"
    assert rel(cache.k[:, :, :, :12], ref_cache.k[:, :, :, :12]) < TOL
    assert rel(cache.v[:, :, :, :12], ref_cache.v[:, :, :, :12]) < TOL


def test_each_field_changes_the_logits():
    """The cases above are not vacuous: each field's reference logits differ from the Llama layer's."""
    tokens = torch.randint(0, BASE.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        base = models(BASE, "Q8_0")[1].model(tokens, make_cache(BASE, 8), 0)
        for feature, fields in FEATURES.items():
            cfg = replace(BASE, **fields)
            assert rel(models(cfg, "Q8_0")[1].model(tokens, make_cache(cfg, 8), 0), base) > 1e-3, feature


def greedy(rt: Runtime, ids: list[int], n: int) -> list[int]:
    cache = rt.new_cache(len(ids) + n + 1)
    return list(generate(rt, cache, ids, Sampler(SamplingSettings(temperature=0)), n))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_64_equals_reference(name):
    cfg = FAMILIES[name]
    rt, ref = models(cfg, "Q4_0")
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(rt.new_cache(80)) is not None
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    got = greedy(rt, ids, 64)
    assert got == greedy(ref, ids, 64)
    assert len(set(got)) > 4  # not one token repeated: the steps' logits differ


def test_runtime_class_picks_the_cpp_decoder_where_it_covers_the_config():
    assert runtime_class("cpu", None) is CpuRuntime and runtime_class("cpu", BASE) is CpuRuntime
    for cfg in FAMILIES.values():
        assert runtime_class("cpu", cfg) is CpuRuntime
    moe = replace(BASE, n_experts=4, n_experts_used=2, expert_ffn_dim=64)  # tests/test_cpu_moe.py
    assert cpp_covers(moe) and runtime_class("cpu", moe) is CpuRuntime
    oai = replace(BASE, activation="swiglu_oai", swiglu_limit=7.0)  # the clamped GLU off the experts
    assert not cpp_covers(oai) and runtime_class("cpu", oai) is CpuEagerRuntime



def test_a_parameter_the_decoder_would_not_read_keeps_the_torch_forward():
    """A tensor the C++ decoder does not know (a later family's) never goes silently unused."""
    rt = models(BASE, "Q8_0")[0]
    assert build_decoder(rt.model) is not None
    rt.model.blk[1].register_parameter("extra_norm", torch.nn.Parameter(torch.ones(BASE.dim)))
    assert build_decoder(rt.model) is None


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "phi3", "phi4mini", "smollm3"])
def test_family_gguf_decode_steps_match_reference(tiny, case):
    """A family's GGUF file through the loader (config from its metadata, Gemma norms as stored, Phi-3's
    fused tensors split, LongRoPE's long set for a cache of 12 > 8 positions): one C++ call per token
    gives the dense load's logits, past the sliding windows of 5."""
    path = str(tiny.gguf(case, gguf.GGMLQuantizationType.Q8_0))
    rt = load_model(path, "cpu").runtime
    ref = load_model(path, "cpu", torch.float32, keep_quantized=False).model
    assert not rt.cfg.llama_layer
    hooked_reference(ref, rt.model)
    tokens = torch.randint(0, rt.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    cache, ref_cache = rt.new_cache(12), make_cache(rt.cfg, 12)
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(cache) is not None
    with torch.inference_mode():
        rt.prefill(cache, tokens[:, :3].tolist(), 0)
        ref(tokens[:, :3], ref_cache, 0)
        for i in range(3, 12):
            got, want = rt.decode(cache, tokens[:, i])[:, None], ref(tokens[:, i:i + 1], ref_cache, i)
            assert rel(got, want) < TOL, f"step {i}"
