"""Phi-3 / Phi-4 (`phi3`) and SmolLM3 (`smollm3`) checkpoints beyond the logits: config.json as
transformers writes it and as real Phi models hold it, the loader's trust boundary (one-line errors,
the fused tensors checked in the file's layout), names from gguf's tables, and `localllm quantize`
(from a HF folder: the converter's file; imatrix and mixed plans keyed by the file's fused names)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

import tiny_models as tm
from tiny_spec import GGUF_ARCH, Q
from tiny_weights import make_weights
from localllm.errors import LocalLLMError
from localllm.load import load_model
from localllm.model import Transformer
from localllm.validate import check_hf_folder, expected_shapes
from localllm.weights import gguf_name
from phi_checkpoints import (BATCH, GGUF_CASES, T, Files, assert_close, hf_logits, our_logits,
                             random_tokens)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(tmp_path_factory.mktemp("phi_models"))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(BATCH, T, 4321)


# ---- config.json variants and the loader's trust boundary


def test_config_saved_by_transformers(files, tokens, tmp_path):
    """config.json as transformers 5 writes it (rope_parameters holding LongRoPE and the partial factor)."""
    import shutil

    for case in ("phi3", "phi4mini", "smollm3"):
        folder = shutil.copytree(files.hf(case), tmp_path / case)
        AutoConfig.from_pretrained(str(folder)).save_pretrained(str(folder))
        assert "rope_parameters" in (folder / "config.json").read_text()
        assert_close(our_logits(folder, tokens), hf_logits(folder, tokens))


@pytest.mark.parametrize("case", ["phi3", "phi4mini", "smollm3", "smollm3_nope2"])
def test_expected_shapes_match_the_model(files, case):
    cfg = check_hf_folder(files.hf(case))[0]
    with torch.device("meta"):
        model = Transformer(cfg)
    assert {gguf_name(n): tuple(t.shape) for n, t in model.state_dict().items()} == expected_shapes(cfg)


def _edit_config(files, tmp_path, case, edit):
    import shutil

    folder = shutil.copytree(files.hf(case), tmp_path / case)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("what,edit,needle", [
    ("short list", lambda c: c["rope_scaling"].update(short_factor=[1.0] * 3), "short_factor"),
    ("bad factor", lambda c: c["rope_scaling"]["long_factor"].__setitem__(0, -1.0), "long_factor"),
    ("partial", lambda c: c.update(partial_rotary_factor=1.5), "partial_rotary_factor"),
    ("window", lambda c: c.update(sliding_window="wide"), "sliding_window"),
])
def test_bad_phi3_config_is_one_line(files, tmp_path, what, edit, needle):
    folder = _edit_config(files, tmp_path, "phi3", edit)
    with pytest.raises(LocalLLMError) as e:
        load_model(str(folder), "cpu", torch.float32)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_smollm3_config_is_one_line(files, tmp_path):
    folder = _edit_config(files, tmp_path, "smollm3", lambda c: c.update(no_rope_layers=[1, 0]))
    with pytest.raises(LocalLLMError, match="no_rope_layers"):
        load_model(str(folder), "cpu", torch.float32)


def _rewrite_gguf(src, dst, drop=(), reshape=None):
    """A copy of a GGUF without the tensors in drop (reshape: name -> new fp32 array)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "phi3")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = (reshape or {}).get(t.name)
        if data is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type) if t.tensor_type != Q.F32 else \
                w.add_tensor(t.name, t.data.copy())
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_gguf_with_one_longrope_set_is_one_line(files, tmp_path):
    path = _rewrite_gguf(files.gguf("phi3"), tmp_path / "one.gguf", drop={"rope_factors_short.weight"})
    with pytest.raises(LocalLLMError, match="rope_factors_short"):
        load_model(str(path), "cpu", torch.float32)


def test_gguf_fused_tensor_of_the_wrong_size_is_one_line(files, tmp_path):
    """The fused tensors are checked in the file's layout (q|k|v rows) before anything is split."""
    path = _rewrite_gguf(files.gguf("phi3"), tmp_path / "qkv.gguf",
                         reshape={"blk.1.attn_qkv.weight": np.zeros((96, 64), dtype=np.float32)})
    with pytest.raises(LocalLLMError, match="attn_qkv") as e:
        load_model(str(path), "cpu", torch.float32)
    assert "(128, 64)" in str(e.value)


# ---- localllm quantize from a HF folder writes what llama.cpp's converter writes


def _gguf_fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: (f.types, f.contents()) for k, f in r.fields.items()
            if not k.startswith("GGUF.") and k not in ("general.name", "general.type")}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_quantize_from_safetensors_matches_converter(files, tokens, tmp_path, case):
    """F32 from the HF folder = the converter's F32 file (tiny_gguf.write_gguf): the same tensors
    (fused names, LongRoPE tensors, smollm3 q/k permuted) and metadata; then a Q8_0 one runs close."""
    from localllm.commands.quantize_cmd import quantize_model

    ref, out = files.gguf(case), tmp_path / f"{case}.gguf"
    quantize_model(str(files.hf(case)), out, "F32", tokenizer_from=ref, progress=False)
    want = {t.name: t for t in gguf.GGUFReader(str(ref)).tensors}
    got = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert np.array_equal(np.array(t.data), np.array(want[name].data)), name
    assert _gguf_fields(out) == _gguf_fields(ref)
    q8 = tmp_path / f"{case}-q8.gguf"
    quantize_model(str(files.hf(case)), q8, "Q8_0", tokenizer_from=ref, progress=False)
    assert_close(our_logits(q8, tokens), hf_logits(files.q8_folder(case), tokens))


def test_real_phi_configs():
    """The config.json values of Phi-3-mini-4k (window 2047), Phi-3.5-mini (LongRoPE, a window longer
    than the context: none) and Phi-4-mini (partial rotary 0.75, tied) -> our fields."""
    from localllm.config_hf import config_from_hf

    base = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "sliding_window": 2047, "rope_scaling": None, "tie_word_embeddings": False}
    mini = config_from_hf(base)
    assert (mini.sliding_window, mini.sliding_layers, mini.rotary_dim) == (2047, (True,) * 32, None)
    assert (mini.rope_original_context, mini.rope_attn_factor) == (None, 1.0)
    long = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    phi35 = config_from_hf(base | {"max_position_embeddings": 131072, "sliding_window": 262144,
                                   "rope_scaling": long | {"short_factor": [1.0] * 48, "long_factor": [2.0] * 48}})
    assert phi35.sliding_window is None and phi35.rope_original_context == 4096
    assert phi35.rope_attn_factor == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    phi4 = config_from_hf(base | {"hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
                                  "max_position_embeddings": 131072, "partial_rotary_factor": 0.75,
                                  "sliding_window": 262144, "tie_word_embeddings": True, "rope_scaling": long})
    assert (phi4.head_dim, phi4.rotary_dim, phi4.tied_output, phi4.sliding_window) == (128, 96, True, None)
    assert config_from_hf(base | {"max_position_embeddings": 131072,
                                  "rope_scaling": long | {"type": "su"}}).rope_original_context == 4096


def test_imatrix_and_mixed_plan_use_the_files_fused_names(files, tmp_path):
    """Calibration statistics of a phi3 model are keyed as its file holds the tensors (attn_qkv, the
    2*ffn ffn_up): the imatrix a quantize run measures is read back by the next against the file."""
    from localllm.calibrate import model_tensors
    from localllm.imatrix import collect_imatrix
    from localllm.commands.quantize_cmd import quantize_model
    from localllm.fused import fused_parts

    path = files.gguf("phi3")
    lm = load_model(str(path), "cpu", torch.float32, keep_quantized=False)  # dense, as quantize loads it
    in_file = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in gguf.GGUFReader(str(path)).tensors}
    assert model_tensors(lm.model) == {n: s for n, s in in_file.items() if not n.startswith("rope_")}
    imat = collect_imatrix(lm.model, [tokens_list(12, seed) for seed in range(2)])
    assert set(imat) == {n for n, s in in_file.items() if len(s) == 2 and n != "token_embd.weight"}  # untied
    assert imat["blk.0.attn_qkv.weight"].shape == imat["blk.0.ffn_up.weight"].shape == (64,)
    assert fused_parts(lm.config, "blk.1.attn_qkv.weight") == [f"blk.1.attn_{x}.weight" for x in "qkv"]
    assert fused_parts(lm.config, "blk.1.ffn_up.weight") == ["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"]
    im, out1, out2 = tmp_path / "phi3.imatrix", tmp_path / "a.gguf", tmp_path / "b.gguf"
    quantize_model(str(path), out1, "Q4_K_M", imatrix_file=str(im), progress=False)  # measures, saves
    quantize_model(str(path), out2, "Q4_K_M", imatrix_file=str(im), progress=False)  # reads it back
    assert out1.read_bytes() == out2.read_bytes()


def tokens_list(n: int, seed: int) -> list[int]:
    return random_tokens(1, n, seed)[0].tolist()


@pytest.mark.parametrize("case", ["phi3", "smollm3"])
def test_hf_names_are_ggufs(case):
    """Every checkpoint name maps to the GGUF name gguf's own TensorNameMap gives for the architecture."""
    from localllm.weights import hf_name

    spec = tm.PHI_CASES[case]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[case].upper()], spec.n_layers)
    for key in make_weights(spec):
        base, suffix = key.rsplit(".", 1)
        assert hf_name(key) == f"{name_map.get_name(base)}.{suffix}", key
