"""Gemma 2 and Gemma 3 (text): our fp32 logits against transformers' on tiny random-weight models
(tiny_models.FAMILY_CASES), written as llama.cpp's converter writes GGUF (F32, Q8_0) and as
safetensors folders (Gemma2ForCausalLM, Gemma3ForCausalLM, and Gemma3ForConditionalGeneration, whose
vision tower the text model skips).

Transformers' GGUF loader reads neither the soft-caps nor Gemma 3's rope settings, so it loads our GGUF
files with the identical safetensors folder's config (`config=`), dequantizing (and un-offsetting
the norms of) the GGUF tensors itself; our GGUF load must also equal our safetensors load of the same
weights. Each Gemma feature (sliding window, soft-caps, local rope base, linear rope scaling,
query_pre_attn_scalar) is checked to change transformers' logits, so these comparisons test it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tiny_spec import Q
import tiny_tokenizer
from test_model_vs_transformers import our_logits
from tiny_models import assert_close
from localllm.cache import make_cache
from localllm.config_gguf import config_from_gguf
from localllm.config_hf import config_from_hf
from localllm.errors import LocalLLMError
from localllm.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-3
BATCH, T = 2, 16  # T > the tiny models' window of 5
GGUF_FORMATS = ["gguf-F32", "gguf-Q8_0"]
CASE_FORMATS = [("gemma2", f) for f in [*GGUF_FORMATS, "safetensors"]] + [("gemma2_qscale", "safetensors")] + \
    [("gemma3", f) for f in [*GGUF_FORMATS, "safetensors"]] + [("gemma3_bf16", "safetensors"), ("gemma3_mm", "safetensors")]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, tiny_tokenizer.vocab_size(), (BATCH, T), generator=g)


def checkpoint(tiny, case: str, fmt: str):
    """-> (path we load, transformers from_pretrained args)."""
    folder = tiny.hf(case)
    if fmt == "safetensors":
        return folder, {"pretrained_model_name_or_path": str(folder)}
    path = tiny.gguf(case, Q[fmt.removeprefix("gguf-")])
    return path, {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name,
                  "config": AutoConfig.from_pretrained(str(folder))}


@torch.inference_mode()
def hf_logits(kwargs: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(**kwargs, dtype=torch.float32, attn_implementation="eager").eval()
    return model(tokens).logits.float()



@pytest.mark.parametrize("case,fmt", CASE_FORMATS)
def test_logits_match_transformers(tiny, tokens, case, fmt):
    path, kwargs = checkpoint(tiny, case, fmt)
    assert_close(our_logits(path, tokens), hf_logits(kwargs, tokens))


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gguf_equals_safetensors(tiny, tokens, case):
    """GGUF F32 (norms + 1, GGUF names, metadata as llama.cpp reads it) and the HF folder of the same
    weights load to the same model."""
    assert_close(our_logits(tiny.gguf(case), tokens), our_logits(tiny.hf(case), tokens), tol=1e-5)


def test_multimodal_checkpoint_is_the_text_model(tiny, tokens):
    """The Gemma3ForConditionalGeneration folder loads the same text model as the Gemma3ForCausalLM one."""
    assert_close(our_logits(tiny.hf("gemma3_mm"), tokens), our_logits(tiny.hf("gemma3"), tokens), tol=1e-5)


def test_multimodal_in_model_names(tiny, tokens, tmp_path):
    """save_pretrained writes language_model.model.*, vision_tower.*, multi_modal_projector.* (the
    checkpoint names); checkpoints saved by transformers 4.52-4.57 hold the in-model names
    model.language_model.*, model.vision_tower.*, ..., and some a stored lm_head.weight: same model."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    shutil.copytree(tiny.hf("gemma3_mm"), folder)
    state = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in state) and "lm_head.weight" not in state
    renamed = {}
    for k, v in state.items():
        k = k.replace("language_model.model.", "language_model.", 1)
        renamed["model." + k] = v
    renamed["lm_head.weight"] = renamed["model.language_model.embed_tokens.weight"].clone()
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_close(our_logits(folder, tokens), our_logits(tiny.hf("gemma3"), tokens), tol=1e-5)
    assert_close(our_logits(folder, tokens), hf_logits({"pretrained_model_name_or_path": str(folder)}, tokens))


@pytest.mark.parametrize("case,key", [("gemma3_mm", "model.audio_tower.weight"), ("gemma3_mm", "audio_tower.weight"),
                                      ("gemma2", "blk.0.attn_q.weight"), ("gemma2", "model.layers.4.mlp.up_proj.weight")])
def test_unknown_tensor_is_refused(tiny, tmp_path, case, key):
    """Only the vision tower's and projector's prefixes are skipped; a GGUF name (TensorNameMap maps
    those to themselves) or a layer past the config's is unknown."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "odd"
    shutil.copytree(tiny.hf(case), folder)
    state = load_file(str(folder / "model.safetensors"))
    state[key] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LocalLLMError, match=f"unknown tensor '{key}'"):
        load_model(str(folder), "cpu", torch.float32)


# ---- each Gemma feature changes transformers' logits (so the comparisons above test it)

def _changed(tiny, tokens, case: str, edit) -> float:
    """Max |ours - transformers with config edited|, on the case's safetensors folder."""
    path, kwargs = checkpoint(tiny, case, "safetensors")
    cfg = AutoConfig.from_pretrained(str(path))
    edit(cfg.get_text_config())
    return (our_logits(path, tokens) - hf_logits(dict(kwargs, config=cfg), tokens)).abs().max().item()


def _set(**values):
    def edit(cfg):
        for k, v in values.items():
            setattr(cfg, k, v)
    return edit


def _rope(part: str, **values):
    """rope_parameters[part] replaced by {"rope_type": "default", **values}."""
    def edit(cfg):
        cfg.rope_parameters[part] = {"rope_type": "default", **values}
    return edit


@pytest.mark.parametrize("case,edit", [
    ("gemma2", _set(sliding_window=T)),
    ("gemma2", _set(attn_logit_softcapping=None)),
    ("gemma2", _set(final_logit_softcapping=None)),
    ("gemma2_qscale", _set(query_pre_attn_scalar=32)),
    ("gemma3", _set(sliding_window=T)),
    ("gemma3", _rope("sliding_attention", rope_theta=1e6)),
    ("gemma3", _rope("full_attention", rope_theta=1e6)),
], ids=["gemma2-window", "gemma2-attn-softcap", "gemma2-final-softcap", "gemma2-query-scalar", "gemma3-window",
        "gemma3-local-rope-base", "gemma3-linear-rope-scaling"])
def test_feature_matters(tiny, tokens, case, edit):
    assert _changed(tiny, tokens, case, edit) > 0.1  # measured: 0.26 to 4.6


# ---- config: llama.cpp's reading of GGUF metadata, transformers' of config.json

def _gguf_meta(arch: str, n_layers: int, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.block_count": n_layers, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 32,
            f"{arch}.attention.value_length": 32, f"{arch}.vocab_size": 100}
    return meta | {f"{arch}.{k}": v for k, v in extra.items()}


def test_gguf_attention_scale_follows_llama_cpp():
    """llama.cpp: (n_embd / n_head)^-0.5 for the 27B block counts (46 Gemma 2, 62 Gemma 3), else
    key_length^-0.5; Gemma 2 defaults (window 4096, caps 50 / 30); Gemma 3 without a window: no SWA."""
    assert config_from_gguf(_gguf_meta("gemma2", 46), set()).attn_scale == pytest.approx(16**-0.5)
    assert config_from_gguf(_gguf_meta("gemma3", 62), set()).attn_scale == pytest.approx(16**-0.5)
    g2 = config_from_gguf(_gguf_meta("gemma2", 26), set())
    assert (g2.attn_scale, g2.sliding_window, g2.attn_softcap, g2.final_softcap) == (32**-0.5, 4096, 50.0, 30.0)
    assert g2.sliding_layers == (True, False) * 13 and g2.rope_theta == 10000.0
    g3 = config_from_gguf(_gguf_meta("gemma3", 26), set())
    assert (g3.sliding_window, g3.sliding_layers, g3.rope_theta_local, g3.final_softcap) == (None, (), None, None)
    g3 = config_from_gguf(_gguf_meta("gemma3", 12, **{"attention.sliding_window": 512}), set())
    assert g3.sliding_layers == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    assert g3.rope_theta_local == 10000.0 and g3.tied_output and g3.embed_scale == 8.0


def test_hf_gemma3_minimal_text_config():
    """gemma-3-4b's config.json leaves most text fields to Gemma3TextConfig's defaults."""
    cfg = config_from_hf({"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}, "vision_config": {}})
    expected = dict(arch="gemma3", n_heads=8, n_kv_heads=4, head_dim=256, vocab_size=262208, rope_theta=1e6,
                    rope_theta_local=1e4, sliding_window=1024, attn_scale=256**-0.5, tied_output=True,
                    context_length=131072, final_softcap=None, attn_softcap=None, qk_norm=True)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0
    assert cfg.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))


def test_hf_null_softcaps_mean_none(tiny):
    """config.json null soft-caps switch them off (transformers), absent ones take Gemma2Config's defaults."""
    hp = json.loads((tiny.hf("gemma2") / "config.json").read_text())
    assert config_from_hf({**hp, "attn_logit_softcapping": None}).attn_softcap is None
    absent = {k: v for k, v in hp.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping")}
    cfg = config_from_hf(absent)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("change,needle", [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
])
def test_hf_bad_gemma_config(tiny, change, needle):
    hp = json.loads((tiny.hf("gemma2") / "config.json").read_text())
    with pytest.raises(LocalLLMError, match=needle):
        config_from_hf({**hp, **change})


# ---- the model the configs imply

@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_expected_shapes_match_the_model(tiny, case):
    """validate.expected_shapes (post norms, q/k norm, tied output) is what model.Transformer holds."""
    from localllm.gguf_file import open_gguf
    from localllm.model import Transformer
    from localllm.validate import check_gguf, expected_shapes
    from localllm.weights import gguf_name

    cfg = check_gguf(open_gguf(tiny.gguf(case)))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert {gguf_name(n): tuple(t.shape) for n, t in model.state_dict().items()} == expected_shapes(cfg)


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
@torch.inference_mode()
def test_cached_decode_equals_one_pass(tiny, tokens, case):
    """A prompt of 7 then one token at a time through the cache (the window sliding past the first
    keys) gives the logits of one pass over all 16 tokens."""
    lm = load_model(str(tiny.gguf(case)), "cpu", torch.float32)
    full = lm.model(tokens, make_cache(lm.config, T, batch=BATCH), 0)
    cache = make_cache(lm.config, T, batch=BATCH)
    steps = [lm.model(tokens[:, :7], cache, 0)]
    steps += [lm.model(tokens[:, i:i + 1], cache, i) for i in range(7, T)]
    assert_close(torch.cat(steps, dim=1), full, tol=1e-5)


@pytest.mark.parametrize("case,facts", [
    ("gemma2", {"sliding_window": "5 tokens on 2 of 4 layers", "soft_caps": "attention 2, logits 3"}),
    ("gemma3", {"sliding_window": "5 tokens on 5 of 6 layers", "rope_scaling": "linear, factor 4"}),
])
def test_info_names_the_family_facts(tiny, case, facts):
    """`localllm info` shows what distinguishes the family, read from the file (GGUF) and the folder."""
    from localllm.commands.info import model_info

    for spec in (str(tiny.gguf(case, Q.F32)), str(tiny.hf(case))):
        info = model_info(spec)
        assert {k: info.get(k) for k in facts} == facts, spec
