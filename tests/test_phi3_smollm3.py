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

import json

import numpy as np

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tiny_models as tm
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.load import load_model
from localllm.model import Transformer
from localllm.validate import check_gguf, check_hf_folder, expected_shapes
from localllm.weights import gguf_name

TOL = 1e-3
BATCH, T = 2, 16
CASES = list(tm.PHI_CASES)
GGUF_CASES = [c for c in CASES if c != "smollm3_nope2"]  # llama.cpp's GGUF has no NoPE interval key
FORMATS = ["gguf-F32", "gguf-Q8_0", "safetensors"]


class Files:
    """Each case's HF folder, GGUF files and Q8_0 round-trip folder, written on first use."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def _once(self, key, make):
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def hf(self, case):
        return self._once((case, "hf"), lambda: tm.write_hf_folder(tm.PHI_CASES[case], self.root / case / "hf"))

    def gguf(self, case, qtype=tm.Q.F32):
        path = self.root / case / f"tiny-{case}-{qtype.name}.gguf"
        return self._once((case, qtype), lambda: tm.write_gguf(tm.PHI_CASES[case], path, qtype))

    def q8_folder(self, case):
        """The HF folder of the Q8_0 file's numbers: each 2-D tensor quantized and decoded by gguf."""
        def make():
            spec = tm.PHI_CASES[case]
            w = {k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), tm.Q.Q8_0), tm.Q.Q8_0))
                 if v.ndim == 2 else v for k, v in tm.make_weights(spec).items()}
            return tm.write_hf_folder(spec, self.root / case / "hf-q8", weights=w)
        return self._once((case, "q8"), make)

    def oracle_folder(self, case, fmt):
        return self.q8_folder(case) if fmt == "gguf-Q8_0" else self.hf(case)

    def path(self, case, fmt):
        return self.hf(case) if fmt == "safetensors" else self.gguf(case, tm.Q[fmt.removeprefix("gguf-")])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(tmp_path_factory.mktemp("phi_models"))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, tm.vocab_size(), (BATCH, T), generator=g)


@torch.inference_mode()
def our_logits(path, tokens: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Logits of one pass over tokens with a KV cache of `capacity` rows (default: the prompt's length)."""
    lm = load_model(str(path), "cpu", torch.float32)
    cache = make_cache(lm.config, capacity or tokens.shape[1], batch=tokens.shape[0])
    return lm.model(tokens, cache, 0)


@torch.inference_mode()
def hf_logits(folder, tokens: torch.Tensor, config=None) -> torch.Tensor:
    kwargs = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    return model(tokens).logits.float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape
    assert ref.std() > 0.1 and torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


def assert_differs(a: torch.Tensor, b: torch.Tensor, by: float = 0.05) -> None:
    assert (a - b).abs().max().item() > by


def hf_config(files, case, **changes):
    """The case's transformers config with attributes changed (a feature switched off)."""
    cfg = AutoConfig.from_pretrained(str(files.hf(case)))
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


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
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type) if t.tensor_type != tm.Q.F32 else \
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
    """F32 from the HF folder = the converter's F32 file (tiny_models.write_gguf): the same tensors
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
    from localllm.config import config_from_hf

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
    from localllm.calibrate import collect_imatrix, model_tensors
    from localllm.commands.quantize_cmd import quantize_model
    from localllm.fused import fused_parts

    path = files.gguf("phi3")
    lm = load_model(str(path), "cpu", torch.float32)
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
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tm.vocab_size(), (n,), generator=g).tolist()


@pytest.mark.parametrize("case", ["phi3", "smollm3"])
def test_hf_names_are_ggufs(case):
    """Every checkpoint name maps to the GGUF name gguf's own TensorNameMap gives for the architecture."""
    from localllm.weights import hf_name

    spec = tm.PHI_CASES[case]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[tm.GGUF_ARCH[case].upper()], spec.n_layers)
    for key in tm.make_weights(spec):
        base, suffix = key.rsplit(".", 1)
        assert hf_name(key) == f"{name_map.get_name(base)}.{suffix}", key
