"""Our fp32 logits against transformers' on the same checkpoint file, for every architecture and
checkpoint format, plus exact decoding of every GGUF tensor type we read.

The checkpoints are tiny random-weight models (tiny_models.py) written as llama.cpp's converter and
`save_pretrained` write them. Transformers is the oracle:
- safetensors folder: `from_pretrained(folder)` (f32 sharded, f16, bf16 and f32 files among the cases);
- GGUF F32 / Q8_0: `from_pretrained(dir, gguf_file=name)`, which dequantizes with the gguf package and
  un-permutes llama q/k itself.
Two GGUF cases transformers' GGUF loader cannot express, so there it loads the same GGUF with the
config.json of the identical safetensors folder (`config=`), and we also check that our GGUF load equals
our safetensors load of the same weights (the safetensors load is itself checked against transformers):
- qwen3: the loader does not read `qwen3.attention.key_length`, so head_dim != dim / heads fails;
- llama3 rope scaling: the loader ignores the `rope_freqs.weight` tensor, which is where GGUF carries
  the scaling; the HF side gets it from config.json's rope_scaling {"rope_type": "llama3", ...};
- linear rope scaling: the loader ignores rope.scaling.type / rope.scaling.factor.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tiny_models as tm
from tiny_gguf import permute_qk
from tiny_raw import ALL_TYPES, random_tensor_data, write_raw_gguf
from tiny_spec import Q
from tiny_tokenizer import vocab_size
from tiny_models import assert_close
from localllm.kernels.cpu import BlockQWeight
from localllm.cache import make_cache
from localllm.gguf_file import open_gguf
from localllm.load import load_model
from localllm.weights import gguf_tensor
from localllm.quantize.formats import SUPPORTED_TYPES

TOL = 1e-3
BATCH, T = 2, 16
FORMATS = ["gguf-F32", "gguf-Q8_0", "safetensors"]
# Architectures whose GGUF transformers can only load with the HF config (see the module docstring).
GGUF_NEEDS_HF_CONFIG = {"qwen3", "llama3", "llama_linear"}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size(), (BATCH, T), generator=g)


def checkpoint(tiny, case: str, fmt: str):
    """-> (path we load, transformers from_pretrained args)."""
    if fmt == "safetensors":
        folder = tiny.hf(case)
        return folder, {"pretrained_model_name_or_path": str(folder)}
    path = tiny.gguf(case, Q[fmt.removeprefix("gguf-")])
    kwargs = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    if case in GGUF_NEEDS_HF_CONFIG:
        kwargs["config"] = AutoConfig.from_pretrained(str(tiny.hf(case)))
    return path, kwargs


@torch.inference_mode()
def our_logits(path, tokens: torch.Tensor) -> torch.Tensor:
    lm = load_model(str(path), "cpu", torch.float32)
    cache = make_cache(lm.config, tokens.shape[1], batch=tokens.shape[0])
    logits = lm.model(tokens, cache, 0)
    assert logits.dtype == torch.float32 and logits.shape == (*tokens.shape, vocab_size())
    return logits


@torch.inference_mode()
def hf_logits(kwargs: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(**kwargs, dtype=torch.float32).eval()
    return model(tokens).logits.float()



@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(tm.CASES))
def test_logits_match_transformers(tiny, tokens, case, fmt):
    path, kwargs = checkpoint(tiny, case, fmt)
    assert_close(our_logits(path, tokens), hf_logits(kwargs, tokens))


@pytest.mark.parametrize("case", list(tm.CASES))
def test_gguf_equals_safetensors(tiny, tokens, case):
    """The same weights as GGUF F32 (q/k permuted, GGUF names, rope_freqs) and as a HF folder load
    to the same model: checks permutation, names and rope scaling without transformers."""
    assert_close(our_logits(tiny.gguf(case), tokens), our_logits(tiny.hf(case), tokens), tol=1e-5)


def test_llama3_rope_scaling_matters(tiny, tokens):
    """The llama3 case is only a test of rope scaling if unscaled rope gives other logits."""
    path, kwargs = checkpoint(tiny, "llama3", "safetensors")
    cfg = AutoConfig.from_pretrained(str(path))
    cfg.rope_scaling = None
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": tm.CASES["llama3"].rope_theta}
    unscaled = hf_logits(dict(kwargs, config=cfg), tokens)
    assert (our_logits(path, tokens) - unscaled).abs().max() > 0.05


def test_linear_rope_scaling_matters(tiny, tokens):
    path, kwargs = checkpoint(tiny, "llama_linear", "safetensors")
    cfg = AutoConfig.from_pretrained(str(path))
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": tm.CASES["llama_linear"].rope_theta}
    assert (our_logits(path, tokens) - hf_logits(dict(kwargs, config=cfg), tokens)).abs().max() > 0.05


def test_bf16_checkpoint_is_stored_as_bf16(tiny):
    from safetensors import safe_open

    with safe_open(str(tiny.hf("qwen2_bf16") / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable) == {"BF16"}
    assert (tiny.hf("llama") / "model.safetensors.index.json").is_file()


# ---- every GGUF tensor type we read decodes to exactly gguf.quants.dequantize

ROWS, COLS = 8, 512


def test_supported_types_are_the_documented_ones():
    assert set(ALL_TYPES) == set(SUPPORTED_TYPES)


@pytest.fixture(scope="module")
def raw_type_file(tmp_path_factory):
    """One GGUF with a tensor of each supported type -> (path, name -> (raw, type))."""
    rng = np.random.default_rng(7)
    tensors = {f"t.{t.name}": (random_tensor_data(t, ROWS, COLS, rng), t) for t in ALL_TYPES}
    path = write_raw_gguf(tmp_path_factory.mktemp("types") / "types.gguf", tensors)
    return path, tensors


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_tensor_type_decodes_exactly(raw_type_file, qtype):
    path, tensors = raw_type_file
    raw, t = tensors[f"t.{qtype.name}"]
    expected = gguf.quants.dequantize(raw, t).astype(np.float32)
    assert expected.shape == (ROWS, COLS) and np.isfinite(expected).all() and expected.std() > 1e-3
    reader_tensor = open_gguf(path).tensors[f"t.{qtype.name}"]
    assert reader_tensor.tensor_type == qtype
    got = gguf_tensor(reader_tensor)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.fixture(scope="module")
def mixed(tiny):
    path, raw = tiny.mixed_gguf()
    return path, raw, load_model(str(path), "cpu", torch.float32)


def test_mixed_type_model_weights_are_exact(mixed):
    """Each matrix of a model whose 2-D tensors span all 16 types equals gguf's decoding of its raw
    data (q/k compared after re-applying the converter's permutation to our un-permuted weight).
    On the CPU the matrices stay quantized (kernels/cpu.py): their decoding is what is compared."""
    _, raw, lm = mixed
    assert {t for _, t in raw.values()} == set(ALL_TYPES)
    params = lm.model.state_dict()
    spec = tm.MIXED
    for name, (data, t) in raw.items():
        module = lm.model.get_submodule(_module_name(name).removesuffix(".weight"))
        held = getattr(module, "qweight", None) or module.weight  # a Linear's, or the embedding's
        ours = (held.dequantize() if isinstance(held, BlockQWeight) else params[_module_name(name)]).numpy()
        if ".attn_q." in name:
            ours = permute_qk(ours, spec.n_heads)
        elif ".attn_k." in name:
            ours = permute_qk(ours, spec.n_kv_heads)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, t).astype(np.float32), err_msg=name)


def test_mixed_type_model_matches_transformers(mixed, tokens):
    path, _, _ = mixed
    kwargs = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    assert_close(our_logits(path, tokens), hf_logits(kwargs, tokens))


def _module_name(gguf_name: str) -> str:
    # Our parameter names are the GGUF names, attention ones under `.attn.` (model.Block).
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2].startswith("attn_") and parts[2] != "attn_norm":
        parts.insert(2, "attn")
    return ".".join(parts)


# ---- Hugging Face folder variants


def _folder_args(folder) -> dict:
    return {"pretrained_model_name_or_path": str(folder)}


def _copy_folder(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_config_saved_by_transformers(tiny, tokens, tmp_path):
    """config.json as transformers 5 writes it (rope_parameters instead of rope_theta/rope_scaling)."""
    for case in ("llama3", "qwen3"):
        folder = _copy_folder(tiny.hf(case), tmp_path / case)
        AutoConfig.from_pretrained(str(folder)).save_pretrained(str(folder))
        assert "rope_parameters" in (folder / "config.json").read_text()
        assert_close(our_logits(folder, tokens), hf_logits(_folder_args(folder), tokens))


def test_tied_folder_that_also_stores_lm_head(tiny, tokens, tmp_path):
    """tie_word_embeddings with a different lm_head.weight stored: transformers (and llama.cpp, whose
    converter writes it as output.weight) use the stored head."""
    from safetensors.torch import load_file, save_file

    folder = _copy_folder(tiny.hf("qwen2"), tmp_path / "qwen2")
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_close(our_logits(folder, tokens), hf_logits(_folder_args(folder), tokens))


def test_tiny_tokenizer_loads_everywhere(tiny):
    """The tiny checkpoints' tokenizer (GGUF metadata and tokenizer.json) means the same to us and to
    transformers, so the tiny files are faithful stand-ins for real ones."""
    from transformers import AutoTokenizer

    from localllm.load import load_tokenizer

    text = "Once upon a time, there was a little girl named Emma. Weights & caches: 42!"
    path, folder = tiny.gguf("llama"), tiny.hf("llama")
    expected = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text)["input_ids"] == expected
    for tok in (load_tokenizer(str(path)), load_tokenizer(str(folder))):
        assert tok.encode(text) == expected
        assert tok.decode(expected) == text
