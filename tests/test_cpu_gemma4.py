"""Gemma 4's dense layer in the C++ one-call decoder (kernels/cpu_decode.cpp, backends/cpu_gemma4.py)
against the torch forward of model.py (itself checked against transformers: test_gemma4.py), on the tiny
GGUF files of tiny_gemma4.py as llama.cpp's converter writes them, quantized:

- every C++ step's logits equal the dense load's forward (inputs of quantized products rounded as the
  kernels round them: test_cpu_kernels.hooked_reference), past the sliding window, and the cache rows
  the C++ steps write equal the forward's: the 31B-style dense file (k_eq_v, global kv heads, own head
  dim and proportional partial rope on full layers, soft cap) and the E2B-style one (per-layer
  embeddings, KV sharing, double-wide MLP), Q8_0 and Q4_K_M;
- each Gemma 4 field matters: with it removed the reference moves far more than the tolerance;
- greedy ids over 64 tokens equal the reference's on quantized files;
- backends.runtime_class: CpuRuntime for dense Gemma 4, CpuEagerRuntime for 26B-A4B's experts.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import tiny_gemma4 as g4
from tiny_spec import Q
from cli_helpers import invoke_quantize
from localllm.backends import runtime_class
from localllm.backends.cpu import CpuEagerRuntime, CpuRuntime
from localllm.cache import make_cache
from localllm.generate import generate
from localllm.load import load_model
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings
from test_cpu_kernels import hooked_reference, rel

# Largest logit error / largest logit. The int16 rounding of the products' inputs flips a grid step
# here and there; Gemma 4's layer scalars and the soft cap of 2 carry it further than test_cpu_families'
# models: the torch forward on the same blocks is as far from the reference as the C++ steps are
# (measured up to 7.4e-4 and 7.2e-4 on the dense file, 3.6e-4 and 3.4e-4 on the E2B-style one; on the
# Q4_K_M dense256 file, whose score-1 attention over heads of 64 / 128 is sharper, 6.0e-3 and 4.6e-3).
TOL = 2e-3
CASE_TOL = {"dense256": 1e-2}
# Per-layer-embedding width 32 (the C++ products take rows of 32-value groups; E2B's is 256). Untied
# outputs: a random tied model repeats its prompt's last token, which would test little.
SPECS = {
    "dense": replace(g4.CASES["dense"], tied=False),
    "e2b": replace(g4.CASES["e2b"], ple_dim=32, tied=False),
    # rows of 256 values so that Q4_K_M quantizes the products (smaller ones fall back to other types)
    "dense256": replace(g4.CASES["dense"], dim=256, ffn_dim=256, n_heads=4, head_dim=64, global_head_dim=128,
                        tied=False, seed=21),
    "e2b256": replace(g4.CASES["e2b"], dim=256, ffn_dim=256, n_heads=4, head_dim=64, global_head_dim=64,
                      ple_dim=256, tied=False, seed=22),
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(case, type) -> the GGUF path: Q8_0 written as the converter writes it, Q4_K_M by `localllm
    quantize` from the F32 file."""
    root, made = tmp_path_factory.mktemp("cpu_gemma4"), {}

    def get(case: str, qtype: str):
        if (case, qtype) not in made:
            spec = SPECS[case]
            folder = g4.write_hf_folder(spec, root / case / "hf")
            if qtype == "Q8_0":
                made[case, qtype] = g4.write_gguf(spec, folder, root / case / "Q8_0.gguf", Q.Q8_0)
            else:
                f32 = g4.write_gguf(spec, folder, root / case / "F32.gguf")
                out = root / case / f"{qtype}.gguf"
                result = invoke_quantize(f32, out, "--type", qtype)
                assert result.exit_code == 0, result.stderr
                made[case, qtype] = out
        return made[case, qtype]
    return get


def pair(path):
    """(the CPU backend's runtime on the file's blocks, the dense fp32 load whose products see their
    input rounded as the kernels round it)."""
    rt = load_model(str(path), "cpu").runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    hooked_reference(ref.model, rt.model)
    return rt, ref


def tokens_for(cfg, n: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def cpp_steps(rt, tokens: torch.Tensor, prompt: int = 3):
    """Logits (1, n - prompt, V) of one C++ call per token after a prompt through the torch forward, and
    the cache."""
    cache = rt.new_cache(tokens.shape[1])
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(cache) is not None
    rt.prefill(cache, tokens[:, :prompt].tolist(), 0)
    out = [rt.decode(cache, tokens[:, i])[:, None] for i in range(prompt, tokens.shape[1])]
    return torch.cat(out, 1), cache


@torch.inference_mode()
def ref_forward(model, tokens: torch.Tensor, prompt: int = 3):
    """The reference's logits at the same positions (one forward pass; its cache)."""
    cache = make_cache(model.cfg, tokens.shape[1])
    return model(tokens, cache, 0)[:, prompt:], cache


@pytest.mark.parametrize("case,qtype", [("dense", "Q8_0"), ("e2b", "Q8_0"), ("dense256", "Q4_K_M"),
                                        ("e2b256", "Q4_K_M")])
def test_decode_steps_match_reference(gguf_file, case, qtype):
    rt, ref = pair(gguf_file(case, qtype))
    cfg = rt.cfg
    assert not cfg.uniform_kv and (cfg.per_layer_dim > 0) == case.startswith("e2b")
    tokens = tokens_for(cfg)  # 12 positions: past the window of 5
    got, cache = cpp_steps(rt, tokens)
    want, ref_cache = ref_forward(ref.model, tokens)
    tol = CASE_TOL.get(case, TOL)
    for i in range(got.shape[1]):
        assert rel(got[:, i], want[:, i]) < tol, f"step {i}"
    for layer in range(cfg.n_layers - cfg.n_kv_shared_layers):  # the layers that own a cache
        for name in ("k", "v"):
            a, b = getattr(cache, name)[layer], getattr(ref_cache, name)[layer]
            assert rel(a[:, :, :12], b[:, :, :12]) < tol, (layer, name)


def _set_cfg(model, **changes):
    new = replace(model.cfg, **changes)
    for m in model.modules():
        if hasattr(m, "cfg"):
            m.cfg = new


def _fill(model, suffix: str, value: float):
    names = [n for n, _ in model.named_parameters() if n.endswith(suffix)]
    assert names, suffix
    with torch.no_grad():
        for n in names:
            model.get_parameter(n).fill_(value)


# field -> (case, edit of the reference model that removes it)
FIELDS = {
    "value_norm": ("dense", lambda m: _set_cfg(m, attn_v_norm=False)),
    "attn_scale_1": ("dense", lambda m: _set_cfg(m, attn_scale=None)),
    "sliding_window": ("dense", lambda m: _set_cfg(m, sliding_window=10**6)),
    "local_rope_theta": ("dense", lambda m: _set_cfg(m, rope_theta_local=1e6)),
    "proportional_rope": ("dense", lambda m: m.rope_freqs.fill_(1.0)),
    "final_softcap": ("dense", lambda m: _set_cfg(m, final_softcap=None)),
    "layer_output_scale": ("dense", lambda m: _fill(m, "layer_output_scale.weight", 1.0)),
    "per_layer_projection": ("e2b", lambda m: _fill(m, ".proj.weight", 0.0)),
    "per_layer_proj_norm": ("e2b", lambda m: _fill(m, "per_layer_proj_norm.weight", 1.0)),
    "per_layer_token_part": ("e2b", lambda m: m.per_layer_token_embd.weight.fill_(0.0)),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_each_field_moves_the_reference(gguf_file, field):
    """The matches above are not vacuous: the C++ steps are within TOL of the reference, which moves by
    far more than TOL without each Gemma 4 field (k_eq_v, KV sharing, per-layer shapes and the
    double-wide MLP change the weights' shapes: no decoder that ignored them would run)."""
    case, edit = FIELDS[field]
    rt, ref = pair(gguf_file(case, "Q8_0"))
    tokens = tokens_for(rt.cfg)
    got = cpp_steps(rt, tokens)[0]
    model = copy.deepcopy(ref.model)
    with torch.no_grad():
        edit(model)
    hooked_reference(model, rt.model)
    assert rel(ref_forward(ref.model, tokens)[0], got) < TOL
    assert rel(ref_forward(model, tokens)[0], got) > 10 * TOL, field


def greedy(rt, ids: list[int], n: int) -> list[int]:
    cache = rt.new_cache(len(ids) + n + 1)
    return list(generate(rt, cache, ids, Sampler(SamplingSettings(temperature=0)), n))


@pytest.mark.parametrize("case,qtype", [("dense", "Q8_0"), ("e2b", "Q8_0"), ("e2b256", "Q4_K_M")])
def test_greedy_64_equals_reference(gguf_file, case, qtype):
    rt, ref = pair(gguf_file(case, qtype))
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(rt.new_cache(80)) is not None
    ids = tokens_for(rt.cfg, 7, seed=5)[0].tolist()
    want = greedy(ref, ids, 64)
    assert len(set(want)) > 4  # not one token repeated: the steps' logits differ
    # each step on the reference's ids: the C++ decoder's choice is the reference's, except where the
    # reference's top two are within summation-order noise (a near tie, which random tiny models have)
    got_l, ref_l = forced_logits(rt, ids, want), forced_logits(ref, ids, want)
    picks = got_l.argmax(-1)
    assert torch.equal(ref_l.argmax(-1), torch.tensor(want))
    gap = ref_l.gather(-1, torch.tensor(want)[:, None]) - ref_l.gather(-1, picks[:, None])
    spread = ref_l.amax(-1, keepdim=True) - ref_l.amin(-1, keepdim=True)
    flips = (picks != torch.tensor(want)).nonzero().flatten().tolist()
    assert len(flips) <= 1 and all(gap[i] < 1e-5 * spread[i] for i in flips), (flips, gap[flips], spread[flips])
    if not flips:  # and then the free-running decode is the reference's too
        assert greedy(rt, ids, 64) == want


def forced_logits(rt, ids: list[int], follow: list[int]) -> torch.Tensor:
    """Logits (len(follow), V) of each step after ids, fed the ids `follow` (teacher forcing)."""
    cache = rt.new_cache(len(ids) + len(follow) + 1)
    out = [rt.prefill(cache, [ids])[0].float().clone()]
    for t in follow[:-1]:
        out.append(rt.decode(cache, torch.tensor([t]))[0].float().clone())
    return torch.stack(out)


def test_runtime_class(gguf_file):
    cfg = load_model(str(gguf_file("e2b", "Q8_0")), "cpu").runtime.cfg
    assert runtime_class("cpu", cfg) is CpuRuntime
    assert runtime_class("cpu", replace(cfg, moe_with_mlp=True, n_experts=4, n_experts_used=2,
                                        expert_ffn_dim=32)) is CpuEagerRuntime


def test_bench_gemma4_file_runs_the_cpp_decoder(tmp_path, monkeypatch):
    """bench/gemma4_file.py's synthetic file (its shape, narrower) reads back as the config it was written
    from and decodes through the C++ decoder with the reference forward's logits."""
    import sys
    from pathlib import Path

    import localllm.synthetic as synthetic

    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 16)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from family_files import VOCAB
    from gemma4_file import gemma4_shape, write_gemma4_gguf
    from localllm.commands.quantize_cmd import read_gguf_metadata

    tok = read_gguf_metadata(VOCAB, keep=lambda key: key.startswith("tokenizer."))
    cfg = replace(gemma4_shape(len(tok["tokenizer.ggml.tokens"].value)), dim=128, ffn_dim=256, per_layer_dim=32,
                  embed_scale=128**0.5)
    path = write_gemma4_gguf(cfg, "Q8_0", tmp_path / "gemma4-Q8_0.gguf", tok)
    rt, ref = pair(path)
    # (read back: eps as the file's fp32, the proportional rope as rope_freqs' divisors)
    assert rt.cfg == replace(cfg, norm_eps=rt.cfg.norm_eps, rope_partial_global=rt.cfg.rope_partial_global)
    assert torch.equal(rt.model.rope_freqs, torch.tensor([1.0] * 32 + [1e30] * 96)) and "gemma4_file" in sys.modules
    tokens = tokens_for(rt.cfg, 6)
    got, want = cpp_steps(rt, tokens)[0], ref_forward(ref.model, tokens)[0]
    assert rel(got, want) < TOL
