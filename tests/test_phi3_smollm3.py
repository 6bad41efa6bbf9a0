"""Phi-3 / Phi-4 (`phi3`) and SmolLM3 (`smollm3`): our fp32 logits against transformers' on tiny
random-weight checkpoints (tiny_models.PHI_CASES) as HF folders and as GGUF (F32, Q8_0).

Transformers' GGUF loader cannot express these files (its phi3 mapping drops the LongRoPE tensors, the
rotated dims and the window; it has no smollm3), so for GGUF the oracle is transformers on a safetensors
folder holding the very numbers of the GGUF file: the folder itself for F32, the Q8_0 round trip of every
2-D tensor (gguf.quants) for Q8_0 (Q8_0 blocks run along a row, so the converter's row permutation of
q/k and the split of fused rows commute with it). Our GGUF load also equals our safetensors load.

LongRoPE: transformers picks the long factors when the sequence exceeds the original context, we (as
llama.cpp) when the KV cache does; with a cache exactly as long as the prompt the two agree, and the
tests run both sides that way (8 tokens: short set; 16 tokens: long set; original context 8).
"""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from localllm.gguf_file import open_gguf
from localllm.load import load_model
from localllm.cache import make_cache
from localllm.validate import check_gguf, check_hf_folder
from phi_checkpoints import (BATCH, CASES, FORMATS, GGUF_CASES, T, Files, assert_close, assert_differs, hf_config,
                             hf_logits, our_logits, random_tokens)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(tmp_path_factory.mktemp("phi_models"))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(BATCH, T, 4321)


# ---- logits against transformers: every case, format, and both LongRoPE sets


@pytest.mark.parametrize("n", [8, T], ids=["short-set", "long-set"])
@pytest.mark.parametrize("case,fmt", [(c, f) for c in CASES for f in FORMATS if c in GGUF_CASES or f == "safetensors"])
def test_logits_match_transformers(files, tokens, case, fmt, n):
    x = tokens[:, :n]
    assert_close(our_logits(files.path(case, fmt), x), hf_logits(files.oracle_folder(case, fmt), x))


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_equals_safetensors(files, tokens, case):
    """The same weights as GGUF F32 (fused names, rope_factors tensors, permuted smollm3 q/k) and as a HF
    folder (config.json's LongRoPE lists) load to the same model."""
    assert_close(our_logits(files.gguf(case), tokens), our_logits(files.hf(case), tokens), tol=1e-5)


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_and_hf_configs_agree(files, case):
    fields = ("arch", "n_layers", "head_dim", "tied_output", "rotary_dim", "sliding_window", "sliding_layers",
              "rope_layers", "rope_original_context", "context_length")
    a, b = check_gguf(open_gguf(files.gguf(case))), check_hf_folder(files.hf(case))[0]
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert a.rope_attn_factor == pytest.approx(b.rope_attn_factor, rel=1e-6)


def test_gguf_nope_step(files, tokens):
    """llama.cpp's SmolLM3 GGUF has no NoPE key: every 4th layer is NoPE (its n_no_rope_layer_step), so a
    GGUF converted from a NoPE-every-2nd folder runs (as in llama.cpp) a different model than the folder."""
    cfg = check_gguf(open_gguf(files.gguf("smollm3_nope2")))
    assert cfg.rope_layers == (True, True, True, False)
    assert check_hf_folder(files.hf("smollm3_nope2"))[0].rope_layers == (True, False, True, False)
    assert_differs(our_logits(files.gguf("smollm3_nope2"), tokens), our_logits(files.hf("smollm3_nope2"), tokens))


# ---- each feature changes the logits (so the comparisons above test it)


def test_longrope_set_follows_the_cache_capacity(files, tokens):
    """8 tokens in a cache of 8 use the short factors, in a cache of 16 the long ones (llama.cpp's rule:
    the context in use), and the two differ; transformers' short-set logits are the first."""
    x = tokens[:, :8]
    short, long = our_logits(files.hf("phi3"), x, capacity=8), our_logits(files.hf("phi3"), x, capacity=16)
    assert_differs(short, long)
    assert_close(short, hf_logits(files.hf("phi3"), x))
    # the long set with a cache of 16: the first 8 rows of the full 16-token pass (causal attention)
    assert_close(long, our_logits(files.hf("phi3"), tokens, capacity=16)[:, :8], tol=1e-5)


def test_decoding_step_by_step_equals_one_pass(files, tokens):
    """Prefill 8 then decode one token at a time into a cache of 16: every step keeps the long set (the
    keys cached first stay valid), the window and the partial rotation -> the one-pass logits."""
    for case in ("phi3", "phi4mini", "smollm3"):
        lm = load_model(str(files.gguf(case)), "cpu", torch.float32)
        with torch.inference_mode():
            full = lm.model(tokens, make_cache(lm.config, T, batch=BATCH), 0)
            cache = make_cache(lm.config, T, batch=BATCH)
            steps = [lm.model(tokens[:, :8], cache, 0)]
            steps += [lm.model(tokens[:, i:i + 1], cache, i) for i in range(8, T)]
        assert_close(torch.cat(steps, dim=1), full, tol=1e-4)


def test_longrope_factors_matter(files, tokens):
    """Without LongRoPE (plain rope, attention factor 1) transformers gives other logits."""
    cfg = hf_config(files, "phi3")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"],
                           "partial_rotary_factor": 1.0}
    assert_differs(our_logits(files.hf("phi3"), tokens), hf_logits(files.hf("phi3"), tokens, cfg))


def test_attention_factor_matters(files, tokens):
    cfg = hf_config(files, "phi3")
    cfg.rope_parameters = dict(cfg.rope_parameters, attention_factor=1.0)
    ours = our_logits(files.hf("phi3"), tokens)
    assert ours.shape == hf_logits(files.hf("phi3"), tokens, cfg).shape
    assert_differs(ours, hf_logits(files.hf("phi3"), tokens, cfg))


def test_sliding_window_matters(files, tokens):
    assert tm.PHI_CASES["phi3"].sliding_window < T
    cfg = hf_config(files, "phi3", sliding_window=None)
    assert_differs(our_logits(files.hf("phi3"), tokens), hf_logits(files.hf("phi3"), tokens, cfg))


def test_partial_rotary_matters(files, tokens):
    """Phi-4-mini rotates 12 of 16 dims; rotating all 16 (factor lists padded with ones) differs."""
    cfg = hf_config(files, "phi4mini")
    rp = cfg.rope_parameters
    cfg.rope_parameters = dict(rp, partial_rotary_factor=1.0, short_factor=rp["short_factor"] + [1.0, 1.0],
                               long_factor=rp["long_factor"] + [1.0, 1.0])
    assert_differs(our_logits(files.hf("phi4mini"), tokens), hf_logits(files.hf("phi4mini"), tokens, cfg))


@pytest.mark.parametrize("case", ["smollm3", "smollm3_nope2"])
def test_nope_layers_matter(files, tokens, case):
    cfg = hf_config(files, case, no_rope_layers=[1] * tm.PHI_CASES[case].n_layers)
    assert_differs(our_logits(files.hf(case), tokens), hf_logits(files.hf(case), tokens, cfg))
