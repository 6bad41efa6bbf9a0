"""Gemma 4 text models: our fp32 logits against transformers' Gemma4ForCausalLM (the oracle) on tiny
random-weight checkpoints (tiny_gemma4.py), as a safetensors folder and as the GGUF llama.cpp's converter
writes (transformers cannot load a gemma4 GGUF: our GGUF load is compared to our safetensors load,
which is compared to transformers), and each Gemma 4 feature shown to change the logits."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import tiny_gemma4 as g4
from tiny_spec import Q
from tiny_tokenizer import vocab_size
from tiny_models import assert_close
from localllm.cache import make_cache
from localllm.load import build_model, load_model, read_hf_folder
from localllm.runtime import Runtime

TOL = 1e-3
BATCH, T = 2, 16


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, vocab_size(), (BATCH, T), generator=g)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (HF folder, GGUF F32 path, GGUF Q8_0 path), written on first use."""
    root, made = tmp_path_factory.mktemp("gemma4"), {}

    def get(case: str):
        if case not in made:
            spec = g4.CASES[case]
            folder = g4.write_hf_folder(spec, root / case / "hf")
            made[case] = (folder, g4.write_gguf(spec, folder, root / case / "tiny-F32.gguf"),
                          g4.write_gguf(spec, folder, root / case / "tiny-Q8_0.gguf", Q.Q8_0))
        return made[case]
    return get


@torch.inference_mode()
def run(runtime_or_path, tokens: torch.Tensor, chunks: tuple[int, ...] = ()) -> torch.Tensor:
    """Logits of the whole batch, fed in one pass or in chunks (prompt, then more: the cache path)."""
    model = load_model(str(runtime_or_path), "cpu", torch.float32).model if not isinstance(
        runtime_or_path, Runtime) else runtime_or_path.model
    cache = make_cache(model.cfg, tokens.shape[1], batch=tokens.shape[0])
    if not chunks:
        return model(tokens, cache, 0)
    out, start = [], 0
    for n in chunks:
        out.append(model(tokens[:, start:start + n], cache, start))
        start += n
    return torch.cat(out, dim=1)


@torch.inference_mode()
def hf_logits(folder, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model(tokens).logits.float()



@pytest.mark.parametrize("case", list(g4.CASES))
def test_safetensors_matches_transformers(files, tokens, case):
    folder, _, _ = files(case)
    ref = hf_logits(folder, tokens)
    assert_close(run(folder, tokens), ref)
    # prompt then single tokens then a chunk: the cache (per-layer buffers, shared layers) and the masks
    assert_close(run(folder, tokens, (5, 1, 1, 9)), ref)


@pytest.mark.parametrize("case", list(g4.CASES))
def test_gguf_equals_safetensors(files, tokens, case):
    folder, f32, q8 = files(case)
    ours = run(folder, tokens)
    assert_close(run(f32, tokens), ours, tol=1e-4)
    # Q8_0: the CPU backend keeps the file's blocks (per-layer embeddings too) for its C++ products;
    # against the same file decoded to dense fp32
    dense = load_model(str(q8), "cpu", torch.float32, keep_quantized=False)
    assert_close(run(q8, tokens), run(dense.runtime, tokens), tol=2e-2)


def variant(folder, tokens, state_fn=None, **changes) -> torch.Tensor:
    """Our logits of the folder's weights with config fields changed / tensors edited."""
    cfg, state, _, _ = read_hf_folder(folder)
    if state_fn is not None:
        state_fn(state)
    return run(build_model(replace(cfg, **changes), state, "cpu", torch.float32), tokens)


def _set(pattern: str, value: float):
    def edit(state):
        names = [n for n in state if n.endswith(pattern)]
        assert names, pattern
        for n in names:
            state[n] = torch.full_like(state[n], value)
    return edit


# feature -> (case, state edit, config changes) that remove it; each must move the logits
FEATURES = {
    "sliding_window": ("dense", None, dict(sliding_window=10**6)),
    "proportional_rope": ("dense", None, dict(rope_partial_global=1.0)),
    "local_rope_theta": ("dense", None, dict(rope_theta_local=1e6)),
    "value_norm": ("dense", None, dict(attn_v_norm=False)),
    "attn_scale_1": ("dense", None, dict(attn_scale=None)),
    "final_softcap": ("dense", None, dict(final_softcap=None)),
    "embed_scale": ("dense", None, dict(embed_scale=1.0)),
    "layer_scalar": ("dense", _set("layer_output_scale.weight", 1.0), {}),
    "per_layer_embeddings": ("e2b", _set(".proj.weight", 0.0), {}),
    "per_layer_token_part": ("e2b", _set("per_layer_token_embd.weight", 0.0), {}),
    "experts": ("moe", _set("ffn_down_exps.weight", 0.0), {}),
    "experts_top_k": ("moe", None, dict(n_experts_used=1)),
    "per_expert_scale": ("moe", _set("ffn_down_exps.scale", 1.0), {}),
    "router_scale": ("moe", _set("ffn_gate_inp.scale", 1.0), {}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_changes_logits(files, tokens, feature):
    case, edit, changes = FEATURES[feature]
    folder, _, _ = files(case)
    assert (variant(folder, tokens, edit, **changes) - hf_logits(folder, tokens)).abs().max() > 0.05


@pytest.mark.parametrize("case", ["dense", "e2b"])
def test_released_multimodal_layout(files, tokens, tmp_path, case):
    """A folder laid out as the released checkpoints are (Gemma4ForConditionalGeneration: model_type
    gemma4, the text config under text_config with global_head_dim / num_global_key_value_heads, the
    text weights under model.language_model., vision tower tensors beside them, and k/v projections
    stored for KV-shared layers, which transformers ignores) loads to the same logits."""
    from safetensors.torch import load_file, save_file

    folder, _, _ = files(case)
    spec = g4.CASES[case]
    state = {k.replace("model.", "model.language_model.", 1): v
             for k, v in load_file(str(folder / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(0)
    state["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.randn(8, 4, generator=g)
    state["model.embed_vision.embedding_projection.weight"] = torch.randn(spec.dim, 8, generator=g)
    first = spec.n_layers - spec.n_kv_shared
    for i in range(first, spec.n_layers):
        p = f"model.language_model.layers.{i}.self_attn."
        kv = spec.n_kv_heads * spec.head_dim if spec.layer_types[i] == g4.S else spec.global_head_dim * (
            spec.n_global_kv_heads or spec.n_kv_heads)
        state[p + "k_proj.weight"] = torch.randn(kv, spec.dim, generator=g)
        state[p + "v_proj.weight"] = torch.randn(kv, spec.dim, generator=g)
        state[p + "k_norm.weight"] = torch.randn(kv // (spec.n_global_kv_heads or spec.n_kv_heads)
                                                 if spec.layer_types[i] == g4.F else spec.head_dim, generator=g)
    out = tmp_path / case
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text((folder / name).read_text())
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
              "text_config": dict(g4.text_config(spec), model_type="gemma4_text", use_bidirectional_attention="vision"),
              "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8}, "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(config))
    assert_close(run(out, tokens), hf_logits(folder, tokens))


# ---- bad input: one LocalLLMError line naming the key


def _with_config(folder, tmp_path, **changes):
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("case, changes, message", [
    ("dense", dict(layer_types=["sliding_attention"]), "'layer_types'"),
    ("dense", dict(per_layer_config={"2": {"head_dim": 32, "num_key_value_heads": 1}, "5": {"head_dim": 64}}),
     "one shape for every full-attention layer"),
    ("dense", dict(use_bidirectional_attention="all"), "'use_bidirectional_attention'"),
    ("e2b", dict(num_kv_shared_layers=5), "need an earlier layer"),
    ("moe", dict(num_experts=None), "missing 'num_experts'"),
    ("dense", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}), "proportional"),
])
def test_bad_config(files, tmp_path, case, changes, message):
    from localllm.errors import LocalLLMError
    from localllm.validate import check_hf_folder

    folder, _, _ = files(case)
    with pytest.raises(LocalLLMError) as e:
        check_hf_folder(_with_config(folder, tmp_path, **changes))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gguf_without_rope_freqs(files, tmp_path):
    """The full layers' proportional rope lives in rope_freqs.weight: a file without it is refused."""
    import gguf as gg

    from localllm.errors import LocalLLMError
    from localllm.gguf_file import open_gguf
    from localllm.validate import check_gguf

    _, f32, _ = files("dense")
    reader = gg.GGUFReader(str(f32))
    w = gg.GGUFWriter(str(tmp_path / "no-rope.gguf"), "gemma4")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gg.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        if t.name != "rope_freqs.weight":
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LocalLLMError, match="rope_freqs"):
        check_gguf(open_gguf(tmp_path / "no-rope.gguf"))


@pytest.mark.parametrize("case", list(g4.CASES))
def test_expected_shapes_match_the_model(files, case):
    """validate.expected_shapes (the loader's trust boundary) is exactly what model.Transformer holds."""
    from localllm.model import Transformer
    from localllm.validate import check_hf_folder, expected_shapes
    from localllm.weights import gguf_name

    cfg, _ = check_hf_folder(files(case)[0])
    with torch.device("meta"):
        model = Transformer(cfg)
    assert {gguf_name(n): tuple(t.shape) for n, t in model.state_dict().items()} == expected_shapes(cfg)


@pytest.mark.parametrize("case", ["dense", "e2b", "moe"])
def test_quantize_folder_writes_the_converters_gguf(files, tokens, tmp_path, case):
    """`localllm quantize FOLDER --type F32` writes what tiny_gemma4 writes as llama.cpp's converter
    (the same gemma4.* keys and values, tensor names, shapes), and it loads to the folder's logits."""
    import gguf as gg
    from cli_helpers import invoke_quantize

    folder, f32, _ = files(case)
    out = tmp_path / "fromhf.gguf"
    result = invoke_quantize(folder, out, "--type", "F32")
    assert result.exit_code == 0, result.stderr

    def contents(path):
        r = gg.GGUFReader(str(path))
        meta = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("gemma4.")}
        return meta, {t.name: tuple(t.shape.tolist()) for t in r.tensors}

    ours, theirs = contents(out), contents(f32)
    assert ours[0].keys() == theirs[0].keys()
    for key, value in theirs[0].items():
        assert ours[0][key] == pytest.approx(value), key
    assert ours[1] == theirs[1]
    assert_close(run(out, tokens), run(folder, tokens), tol=1e-5)


def test_gguf_with_kv_shared_layers_k_v(files, tokens, tmp_path):
    """A GGUF converted from a checkpoint that stores k/v projections and k norms for its KV-shared
    layers (llama.cpp loads them as not required) loads, ignoring them, to the same logits."""
    folder, _, _ = files("e2b")
    spec = g4.CASES["e2b"]
    rng = np.random.default_rng(0)
    extra = {}
    for i in range(spec.n_layers - spec.n_kv_shared, spec.n_layers):
        d = spec.head_dim if spec.layer_types[i] == g4.S else spec.global_head_dim
        kv = spec.n_kv_heads * d
        extra |= {f"blk.{i}.attn_k.weight": rng.standard_normal((kv, spec.dim)).astype(np.float32),
                  f"blk.{i}.attn_v.weight": rng.standard_normal((kv, spec.dim)).astype(np.float32),
                  f"blk.{i}.attn_k_norm.weight": rng.standard_normal(d).astype(np.float32)}
    path = g4.write_gguf(spec, folder, tmp_path / "stray.gguf", extra=extra)
    assert_close(run(path, tokens), run(folder, tokens), tol=1e-4)
