"""The loader's trust boundary (localllm/validate.py, gguf_file.py, gguf_meta.py, config.py): every bad
GGUF file or safetensors folder is one LocalLLMError line naming the key or tensor, its value and what
was expected, raised before any weight is decoded or the model is built.

Each case writes one small file (tests/_bad_files.py: write_gguf and write_tiny_safetensors write
valid layouts with changed metadata or tensors; patch() breaks bytes a writer would not) and loads it
in this process. A few go through the CLI's test runner to check the one `error:` line end to end.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from _bad_files import (
    TINY,
    TINY_TOKENS,
    V,
    patch,
    tensor_info_offsets,
    tiny_tensors,
    write_gguf,
    write_tiny_model,
    write_tiny_safetensors,
)
from localllm.config import ModelConfig
from localllm.errors import LocalLLMError
from localllm.load import load_model
from localllm.model import Transformer
from localllm.nonfinite import nonfinite_tensor
from localllm.validate import expected_shapes
from localllm.weights import gguf_name

U32 = V.UINT32
Q = gguf.GGMLQuantizationType


def load_error(path: Path) -> str:
    """The one-line error loading path gives (and that it gives one)."""
    with pytest.raises(LocalLLMError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message and message, repr(message)
    return message


def assert_names(message: str, needles: list[str]) -> None:
    for word in needles:
        assert word.lower() in message.lower(), f"{word!r} not named in: {message}"


# ---- metadata of the wrong type or out of range: name -> (key -> (value, type[, item]), words)
META_CASES = {
    "heads_0": ({"attention.head_count": (0, U32)}, ["llama.attention.head_count", "is 0", "from 1"]),
    "kv_heads_0": ({"attention.head_count_kv": (0, U32)}, ["llama.attention.head_count_kv", "is 0"]),
    "heads_string": ({"attention.head_count": ("4", V.STRING)}, ["attention.head_count", "'4'", "integer"]),
    "heads_array": ({"attention.head_count": ([4, 4], V.ARRAY, V.INT32)}, ["attention.head_count", "a list"]),
    "heads_float": ({"attention.head_count": (4.0, V.FLOAT32)}, ["attention.head_count", "4.0", "integer"]),
    "heads_bool": ({"attention.head_count": (True, V.BOOL)}, ["attention.head_count", "True", "integer"]),
    "dim_0": ({"embedding_length": (0, U32)}, ["llama.embedding_length", "is 0"]),
    "dim_2_31": ({"embedding_length": (2**31, U32)}, ["llama.embedding_length", str(2**31)]),
    "heads_not_dividing_dim": ({"attention.head_count": (3, U32), "attention.head_count_kv": (1, U32)},
                               ["head_count = 3", "does not divide", "64"]),
    "heads_not_multiple_of_kv": ({"attention.head_count_kv": (3, U32)}, ["head_count = 4", "multiple", "= 3"]),
    "kv_above_heads": ({"attention.head_count_kv": (8, U32)}, ["head_count_kv", "is 8", "from 1 to 4"]),
    "block_count_0": ({"block_count": (0, U32)}, ["llama.block_count", "is 0"]),
    "block_count_1e6": ({"block_count": (10**6, U32)}, ["llama.block_count", "1000000", "4096"]),
    "block_count_2_32": ({"block_count": (2**32 - 1, U32)}, ["llama.block_count", str(2**32 - 1)]),
    "block_count_above_tensors": ({"block_count": (3, U32)}, ["missing tensor 'blk.2.", "3 layers"]),
    "ffn_0": ({"feed_forward_length": (0, U32)}, ["feed_forward_length", "is 0"]),
    "context_0": ({"context_length": (0, U32)}, ["llama.context_length", "is 0"]),
    "context_negative": ({"context_length": (-1, V.INT32)}, ["llama.context_length", "is -1"]),
    "rope_base_nan": ({"rope.freq_base": (float("nan"), V.FLOAT32)}, ["rope.freq_base", "nan", "finite"]),
    "rope_base_inf": ({"rope.freq_base": (float("inf"), V.FLOAT32)}, ["rope.freq_base", "inf"]),
    "rope_base_0": ({"rope.freq_base": (0.0, V.FLOAT32)}, ["rope.freq_base", "above 0"]),
    "eps_negative": ({"attention.layer_norm_rms_epsilon": (-1.0, V.FLOAT32)}, ["layer_norm_rms_epsilon", "-1.0"]),
    "eps_nan": ({"attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)}, ["layer_norm_rms_epsilon"]),
    "vocab_0": ({"vocab_size": (0, U32)}, ["llama.vocab_size", "is 0"]),
    "vocab_disagrees": ({"vocab_size": (100, U32)}, ["token_embd.weight", "(260, 64)", "(100, 64)"]),
    "key_length_odd": ({"attention.key_length": (15, U32)}, ["head dimension 15", "odd"]),
    "value_length": ({"attention.key_length": (16, U32), "attention.value_length": (8, U32)},
                     ["attention.value_length", "is 8", "16"]),
    "eos_id_list": ({"tokenizer.ggml.eos_token_id": ([1, 2], V.ARRAY, V.INT32)},
                    ["tokenizer.ggml.eos_token_id", "a list of 2", "an integer"]),
    "eos_id_inf": ({"tokenizer.ggml.eos_token_id": (float("inf"), V.FLOAT32)}, ["eos_token_id", "inf", "integer"]),
    "tokens_not_a_list": ({"tokenizer.ggml.tokens": (1.5, V.FLOAT32)}, ["tokenizer.ggml.tokens", "list of strings"]),
    "merges_of_ints": ({"tokenizer.ggml.merges": ([1], V.ARRAY, V.INT32)}, ["tokenizer.ggml.merges", "list of strings"]),
    "pre_array": ({"tokenizer.ggml.pre": (["gpt-2"], V.ARRAY, V.STRING)}, ["tokenizer.ggml.pre", "a string"]),
    "token_type_short": ({"tokenizer.ggml.token_type": ([1, 1], V.ARRAY, V.INT32)},
                         ["tokenizer.ggml.token_type", "2 values for 260 tokens"]),
    "add_bos_not_bool": ({"tokenizer.ggml.add_bos_token": ("yes", V.STRING)}, ["add_bos_token", "true or false"]),
    "alignment_3": ({"general.alignment": (3, U32)}, ["general.alignment", "power of two"]),
    "alignment_string": ({"general.alignment": ("32", V.STRING)}, ["general.alignment", "power of two"]),
}


@pytest.mark.parametrize("name", list(META_CASES))
def test_bad_metadata(tmp_path, name):
    meta, needles = META_CASES[name]
    assert_names(load_error(write_gguf(tmp_path / f"{name}.gguf", meta=meta)), needles)


def _blk(i: int, name: str) -> str:
    return f"blk.{i}.{name}.weight"


def _w(*shape) -> np.ndarray:
    return np.full(shape, 0.01, np.float32)


# ---- tensors against the config: name -> (tensors to set or drop, extra metadata, words)
TENSOR_CASES = {
    "q_shape": ({_blk(0, "attn_q"): _w(48, 64)}, {}, [_blk(0, "attn_q"), "(48, 64)", "(64, 64)"]),
    "k_shape": ({_blk(1, "attn_k"): _w(64, 64)}, {}, [_blk(1, "attn_k"), "(64, 64)", "(32, 64)"]),
    "embd_width": ({"token_embd.weight": _w(len(TINY_TOKENS), 32)}, {}, ["token_embd.weight", "(260, 32)"]),
    "norm_shape": ({"output_norm.weight": _w(65)}, {}, ["output_norm.weight", "(65,)", "(64,)"]),
    "no_layer_part": ({"blk": _w(4)}, {}, ["unexpected tensor 'blk'"]),
    "unknown_name": ({"blk.0.foo.weight": _w(4)}, {}, ["unexpected tensor 'blk.0.foo.weight'"]),
    "layer_beyond": ({"blk.7.attn_norm.weight": _w(64)}, {}, ["unexpected tensor 'blk.7.attn_norm.weight'"]),
    "missing": ({_blk(1, "ffn_up"): None}, {}, ["missing tensor 'blk.1.ffn_up.weight'"]),
    "vocab_only": ({n: None for n in tiny_tensors()}, {}, ["no weights", "vocab-only"]),
    "tokens_beyond_embedding": ({"token_embd.weight": _w(200, 64)}, {"vocab_size": (200, U32)},
                                ["260 tokens", "200 rows"]),
    "unsupported_type": ({_blk(0, "ffn_down"): (np.zeros((64, 66), np.uint8), Q.IQ2_XXS)}, {},
                         [_blk(0, "ffn_down"), "unsupported type IQ2_XXS"]),
}


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_tensor_against_config(tmp_path, name):
    tensors, meta, needles = TENSOR_CASES[name]
    assert_names(load_error(write_gguf(tmp_path / f"{name}.gguf", meta=meta, tensors=tensors)), needles)


# ---- bytes a writer would not write


def _kv_type_offset(raw: bytes, key: str) -> int:
    """File offset of the u32 value type of metadata key (right after the key string)."""
    at = raw.index(key.encode())
    assert struct.unpack_from("<Q", raw, at - 8)[0] == len(key.encode())
    return at + len(key.encode())


def _patched(tmp_path: Path, name: str, how) -> Path:
    path = write_tiny_model(tmp_path / f"{name}.gguf")
    how(path, path.read_bytes())
    return path


def _tensor_table_entry(path: Path, name: str) -> int:
    """File offset of tensor name's entry in the tensor table (its name length u64 comes first)."""
    return next(t.field.offset for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


BYTE_CASES = {
    "tensor_count_huge": (lambda p, raw: patch(p, 8, "<Q", 17214436811903948922),
                          ["header says 17214436811903948922 tensors", "impossible"]),
    "kv_count_huge": (lambda p, raw: patch(p, 16, "<Q", 2**40), [f"{2**40} metadata keys", "impossible"]),
    "version_7": (lambda p, raw: patch(p, 4, "<I", 7), ["unsupported GGUF version 7"]),
    "value_type_unknown": (lambda p, raw: patch(p, _kv_type_offset(raw, "llama.block_count"), "<I", 99),
                           ["llama.block_count", "unknown value type 99"]),
    "array_of_arrays": (lambda p, raw: patch(p, _kv_type_offset(raw, "tokenizer.ggml.token_type") + 4, "<I", 9),
                        ["tokenizer.ggml.token_type", "array of arrays"]),
    "array_count_huge": (lambda p, raw: patch(p, _kv_type_offset(raw, "tokenizer.ggml.tokens") + 8, "<Q", 2**40),
                         ["tokenizer.ggml.tokens", str(2**40), "values"]),
    "string_not_utf8": (lambda p, raw: patch(p, _kv_type_offset(raw, "tokenizer.ggml.pre") + 12, "<B", 0xFF),
                        ["tokenizer.ggml.pre", "not valid UTF-8", "offset"]),
    "key_not_utf8": (lambda p, raw: patch(p, raw.index(b"llama.rope.freq_base"), "<B", 0xC3),
                     ["metadata key", "not valid UTF-8", "offset"]),
    "tensor_name_not_utf8": (lambda p, raw: patch(p, _tensor_table_entry(p, "output_norm.weight") + 8, "<B", 0xFE),
                             ["tensor name", "not valid UTF-8", "offset"]),
    "five_dims": (lambda p, raw: patch(p, _tensor_table_entry(p, "output_norm.weight") + 8 + 18, "<I", 5),
                  ["output_norm.weight", "5 dimensions"]),
    # blk.1.ffn_up's data where blk.1.ffn_gate's is: the two overlap (llama.cpp rejects such a file)
    "overlap": (lambda p, raw: patch(p, tensor_info_offsets(p, _blk(1, "ffn_up"))[1], "<Q",
                                     _data_offset(p, _blk(1, "ffn_gate"))),
                [_blk(1, "ffn_up"), "offset", "overlapping"]),
    # a type id swapped for one of another block size (Q8_0: 34 bytes per 32 values): the data no longer
    # fills its range, so the next tensor is not where its offset says
    "type_swapped": (lambda p, raw: patch(p, tensor_info_offsets(p, _blk(0, "ffn_down"))[0], "<I", int(Q.Q8_0)),
                     [_blk(1, "attn_norm"), _blk(0, "ffn_down"), "expected"]),
    "rows_not_whole_blocks": (lambda p, raw: patch(p, tensor_info_offsets(p, _blk(0, "attn_q"))[0], "<I", int(Q.Q4_K)),
                              [_blk(0, "attn_q"), "Q4_K", "rows of 64 values", "256-value blocks"]),
    "arch_missing": (lambda p, raw: patch(p, raw.index(b"general.architecture") + 19, "<B", ord("X")),
                     ["missing 'general.architecture'"]),
    "duplicate_tensor": (lambda p, raw: patch(p, _tensor_table_entry(p, _blk(0, "attn_k")) + 8 + 11, "<B", ord("q")),
                         ["duplicated tensor", _blk(0, "attn_q")]),
}


def _data_offset(path: Path, name: str) -> int:
    """Tensor name's data offset relative to the data section, as the table stores it."""
    r = gguf.GGUFReader(str(path))
    return next(t.data_offset - r.data_offset for t in r.tensors if t.name == name)


@pytest.mark.parametrize("name", list(BYTE_CASES))
def test_corrupt_bytes(tmp_path, name):
    how, needles = BYTE_CASES[name]
    assert_names(load_error(_patched(tmp_path, name, how)), needles)


# ---- Hugging Face folders: name -> (config changes, dropped HF names, replaced tensors, words)
HF_CASES = {
    "heads_0": ({"num_attention_heads": 0}, (), {}, ["config.json", "num_attention_heads", "is 0"]),
    "heads_string": ({"num_attention_heads": "4"}, (), {}, ["num_attention_heads", "'4'", "integer"]),
    "missing_key": ({"hidden_size": None}, (), {}, ["config.json is missing 'hidden_size'"]),
    "tie_not_bool": ({"tie_word_embeddings": "yes"}, (), {}, ["tie_word_embeddings", "true or false"]),
    "eps_0": ({"rms_norm_eps": 0}, (), {}, ["rms_norm_eps", "above 0"]),
    "rope_scaling_equal": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                             "high_freq_factor": 4.0}}, (), {}, ["low_freq_factor", "below"]),
    "q_shape": ({}, (), {"model.layers.0.self_attn.q_proj.weight": _w(48, 64)},
                ["model.layers.0.self_attn.q_proj.weight", "(48, 64)", "(64, 64)"]),
    "missing_tensor": ({}, ("model.layers.1.mlp.up_proj.weight",), {}, ["missing tensor 'blk.1.ffn_up.weight'"]),
    "untied_without_head": ({"tie_word_embeddings": False}, (), {}, ["missing tensor 'output.weight'"]),
    "int_dtype": ({}, (), {"model.norm.weight": np.ones(64, np.int32)}, ["model.norm.weight", "dtype I32"]),
    "unknown_tensor": ({}, (), {"model.layers.0.mlp.extra.weight": _w(4)}, ["unknown tensor", "extra"]),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_bad_safetensors_folder(tmp_path, name):
    config, drop, tensors, needles = HF_CASES[name]
    assert_names(load_error(write_tiny_safetensors(tmp_path / name, config, drop, tensors)), needles)


FOLDER_CASES = {
    "config_list": (lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json holds a list"]),
    "config_not_utf8": (lambda d: (d / "config.json").write_bytes(b'{"model_type": "ll\xffama"}'),
                        ["config.json", "not UTF-8", "offset 18"]),
    "config_truncated": (lambda d: (d / "config.json").write_text('{"model_type": "lla'), ["bad config.json", "line 1"]),
    "index_truncated": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "mo'),
                        ["bad model.safetensors.index.json"]),
    "index_without_weight_map": (lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
                                 ["model.safetensors.index.json", "weight_map"]),
    "index_shard_outside": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}})), ["'../model.safetensors'"]),
    "index_shard_not_a_name": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": {"a": 1}}})), ["'lm_head.weight'", "{'a': 1}", "file name"]),
    "shard_missing": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-2.safetensors"}})), ["missing safetensors shard"]),
    "shard_truncated": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
                        ["cannot read", "model.safetensors"]),
}


@pytest.mark.parametrize("name", list(FOLDER_CASES))
def test_bad_folder_files(tmp_path, name):
    how, needles = FOLDER_CASES[name]
    folder = write_tiny_safetensors(tmp_path / name)
    how(folder)
    assert_names(load_error(folder), needles)


# ---- the design's invariants


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_expected_shapes_match_the_model(arch, tied):
    """validate.expected_shapes must be exactly what model.Transformer holds (rope_freqs included)."""
    from localllm.config import ARCHITECTURES

    cfg = ModelConfig(arch=arch, n_layers=3, dim=64, ffn_dim=96, n_heads=4, n_kv_heads=2, head_dim=24,
                      vocab_size=50, context_length=32, norm_eps=1e-5, rope_theta=1e4, tied_output=tied,
                      **ARCHITECTURES[arch])
    with torch.device("meta"):
        model = Transformer(cfg)
    built = {gguf_name(n): tuple(t.shape) for n, t in model.state_dict().items()}
    assert built == expected_shapes(cfg)


def test_huge_block_count_allocates_nothing(tmp_path):
    """A small file claiming a million layers (or the most we accept, 4096, with 2 present) fails
    before anything proportional to the claim is allocated."""
    paths = [write_gguf(tmp_path / "m.gguf", meta={"block_count": (10**6, U32)}),
             write_gguf(tmp_path / "k.gguf", meta={"block_count": (4096, U32)})]
    for path in paths:
        tracemalloc.start()
        try:
            load_error(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 20 * 2**20, f"{path.name}: {peak / 2**20:.1f} MiB traced before the error"


def test_first_nonfinite_tensor_names_it(tmp_path):
    bad = _w(TINY["ffn_dim"], TINY["dim"])
    bad[3, 5] = np.nan
    lm = load_model(str(write_gguf(tmp_path / "nan.gguf", tensors={_blk(1, "ffn_up"): bad})))
    assert nonfinite_tensor(lm.model) == _blk(1, "ffn_up")
    assert nonfinite_tensor(load_model(str(write_tiny_model(tmp_path / "ok.gguf"))).model) is None


def test_first_nonfinite_tensor_decodes_quantized(tmp_path):
    """A Q8_0 block whose f16 scale is NaN: found in the CPU's BlockQWeight (kept as the file's blocks)."""
    from tiny_gguf import write_gguf
    from tiny_spec import TinySpec

    spec = TinySpec(arch="llama", dim=64, ffn_dim=128)
    path = write_gguf(spec, tmp_path / "q8.gguf", qtype=Q.Q8_0)
    at = next(t.data_offset for t in gguf.GGUFReader(str(path)).tensors if t.name == _blk(1, "ffn_up"))
    patch(path, at + 34 * 5, "<H", 0x7E00)  # the sixth block's scale: f16 NaN
    model = load_model(str(path)).model
    assert not isinstance(model.blk[1].ffn_up.w, torch.Tensor)  # still quantized
    assert nonfinite_tensor(model) == _blk(1, "ffn_up")


def test_one_error_line_through_the_cli(tmp_path):
    """End to end: `info` and `complete` print one `error:` line naming the key, no traceback."""
    from typer.testing import CliRunner

    from localllm.cli import app

    path = write_gguf(tmp_path / "h0.gguf", meta={"attention.head_count": (0, U32)})
    folder = write_tiny_safetensors(tmp_path / "st", {"num_attention_heads": "4"})
    for args in (["info", str(path)], ["complete", str(path), "hi"], ["info", str(folder)]):
        result = CliRunner().invoke(app, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert result.exit_code != 0
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert ("head_count" in lines[0]) or ("num_attention_heads" in lines[0]), lines[0]
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="counts mappings in /proc/self/maps (Linux)")
def test_safetensors_models_are_freed(tmp_path):
    """Loading and running a safetensors folder many times in one process (as a fuzzer or a server
    does) must not keep file mappings: they once leaked until mmap failed with ENOMEM."""
    from localllm.runner import complete
    from localllm.settings import GenerationSettings, SamplingSettings

    folder = write_tiny_safetensors(tmp_path / "st")

    def run_once() -> None:
        lm = load_model(str(folder))
        "".join(complete(lm, "the", GenerationSettings(max_tokens=3), SamplingSettings(temperature=0)))

    def mappings() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    run_once()
    before = mappings()
    for _ in range(10):
        run_once()
    assert mappings() - before < 20, "file mappings grow with every load"


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_vector_refused_at_load(tmp_path, value):
    """A NaN in a norm weight need not reach the logits (found by the fuzzer: one NaN in Qwen3's
    attn_q_norm left them finite), so the 1-D tensors are checked at load."""
    norm = np.ones(TINY["dim"], np.float32)
    norm[7] = value
    path = write_gguf(tmp_path / "nan_norm.gguf", tensors={_blk(0, "attn_norm"): norm})
    with pytest.raises(LocalLLMError, match=r"tensor blk\.0\.attn_norm\.weight holds NaN or Inf values"):
        load_model(str(path))


def test_tokenizer_library_panic_is_one_line(tmp_path):
    """tokenizers panics (a BaseException, with Rust's own message on fd 2) on a continuing-subword
    prefix longer than a token (found by the fuzzer): one error line, through a real process."""
    from _bad_files import run_cli

    folder = write_tiny_safetensors(tmp_path / "hf")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["continuing_subword_prefix"] = "64"
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    r = run_cli("info", folder)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: cannot load"), r.stderr
    assert "tokenizer.json" in lines[0] and "Traceback" not in r.stderr
