"""Safetensors input without --tokenizer-from: the tokenizer.* metadata built from the folder's own
tokenizer files (localllm.hf_to_gguf), checked against the `tokenizers` library's ids and against
tiny_gguf.write_gguf (the keys convert_hf_to_gguf writes for the same tokenizer)."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from tiny_gguf import write_gguf
from tiny_hf import write_hf_folder
from tiny_spec import TinySpec
import tiny_tokenizer
from tiny_tokenizer import BOS_ID, CORPUS, EOS_ID
from cli_helpers import invoke_quantize as invoke
from localllm.errors import LocalLLMError
from localllm.hf_to_gguf import CHECK_TEXT, hf_tokenizer_metadata
from localllm.load import load_model
from localllm.commands.quantize_cmd import quantize_model
from localllm.tokenizer.pretok import LLAMA3

torch.set_num_threads(1)

SPEC = TinySpec("qwen2", n_layers=1, tied=True, seed=21)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEXTS = ["Hello world! The quick brown fox.", "  two  spaces\n\nand 1234567890 digits",
         "Ünïcödé 日本語 🦙 x**2", "def f(x):\n    return x  # c", CHECK_TEXT]


def folder(tmp_path, name="hf", pre_tokenizer=None, normalizer=None):
    hf = write_hf_folder(SPEC, tmp_path / name)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
    if pre_tokenizer is not None or normalizer is not None:
        spec = json.loads((hf / "tokenizer.json").read_text())
        spec["pre_tokenizer"] = pre_tokenizer or spec["pre_tokenizer"]
        spec["normalizer"] = normalizer or spec["normalizer"]
        (hf / "tokenizer.json").write_text(json.dumps(spec))
    return hf


def fields(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}


def test_quantize_without_tokenizer_from(tmp_path):
    from tokenizers import Tokenizer

    hf = folder(tmp_path)
    out = tmp_path / "q8.gguf"
    result = invoke(hf, out, "--type", "Q8_0")
    assert result.exit_code == 0, result.stderr
    lm = load_model(str(out), "cpu", torch.float32)
    ref = Tokenizer.from_file(str(hf / "tokenizer.json"))
    for text in TEXTS:
        assert lm.tokenizer.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    got = fields(out)
    assert got["tokenizer.ggml.model"] == "gpt2" and got["tokenizer.ggml.pre"] == "gpt-2"
    assert got["tokenizer.ggml.bos_token_id"] == BOS_ID and got["tokenizer.ggml.eos_token_id"] == EOS_ID
    assert got["tokenizer.ggml.add_bos_token"] is False
    assert got["tokenizer.chat_template"] == TEMPLATE == lm.tokenizer.chat_template
    # the converter's keys for this tokenizer (tiny_gguf.add_tokenizer), plus the chat template
    want = fields(write_gguf(SPEC, tmp_path / "ref.gguf"))
    assert {k: v for k, v in got.items() if k != "tokenizer.chat_template"} == want


def test_same_as_override(tmp_path):
    """Without --tokenizer-from = with the converter's GGUF as --tokenizer-from (the override still works)."""
    hf = write_hf_folder(SPEC, tmp_path / "hf")
    ref = write_gguf(SPEC, tmp_path / "ref.gguf")
    quantize_model(str(hf), tmp_path / "a.gguf", "F32", progress=False)
    quantize_model(str(hf), tmp_path / "b.gguf", "F32", tokenizer_from=ref, progress=False)
    assert fields(tmp_path / "a.gguf") == fields(tmp_path / "b.gguf")


@pytest.mark.parametrize("pre, name", [
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}, "dbrx"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}, "starcoder"),
])
def test_known_regexes(tmp_path, pre, name):
    """Regexes equal to a table entry give its name (LLAMA3 without ignore_merges: dbrx's entry)."""
    kv = hf_tokenizer_metadata(folder(tmp_path, pre_tokenizer=pre), tiny_tokenizer.vocab_size())
    assert kv["tokenizer.ggml.pre"].value == name


def test_unknown_regex_refused(tmp_path):
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+|\s+|[^\s\p{L}]+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    hf = folder(tmp_path, pre_tokenizer=pre)
    out = tmp_path / "x.gguf"
    result = invoke(hf, out, "--type", "Q8_0")
    assert result.exit_code != 0 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pre-tokenizer regexes match no known" in lines[0] and "--tokenizer-from" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_different_ids_refused(tmp_path):
    """Known regexes, but a normalizer llama.cpp does not apply: the id check refuses it."""
    hf = folder(tmp_path, normalizer={"type": "Lowercase"})
    with pytest.raises(LocalLLMError, match="does not reproduce its ids"):
        hf_tokenizer_metadata(hf, tiny_tokenizer.vocab_size())


def test_padded_vocab(tmp_path):
    """config.json's vocab_size beyond the tokenizer's: [PAD{i}] tokens, typed unused."""
    kv = hf_tokenizer_metadata(folder(tmp_path), tiny_tokenizer.vocab_size() + 2)
    n = tiny_tokenizer.vocab_size()
    assert kv["tokenizer.ggml.tokens"].value[n:] == [f"[PAD{n}]", f"[PAD{n + 1}]"]
    assert kv["tokenizer.ggml.token_type"].value[n:] == [5, 5]


def test_sentencepiece_folder(tmp_path):
    """tokenizer.model: the "llama" vocabulary from sentencepiece (pieces, scores, types; [PAD] up to
    config.json's vocab_size), tokenizing as sentencepiece does."""
    import sentencepiece as spm

    hf = write_hf_folder(TinySpec("llama", n_layers=1, seed=22), tmp_path / "hf")
    (hf / "tokenizer.json").unlink()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 4), model_prefix=str(hf / "tokenizer"),
        vocab_size=tiny_tokenizer.vocab_size() - 4, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
        character_coverage=1.0)
    out = tmp_path / "spm.gguf"
    quantize_model(str(hf), out, "Q8_0", progress=False)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    lm = load_model(str(out), "cpu", torch.float32)
    for text in TEXTS:
        assert lm.tokenizer.encode(text) == sp.EncodeAsIds(text), text
    got = fields(out)
    assert got["tokenizer.ggml.model"] == "llama" and got["tokenizer.ggml.pre"] == "default"
    n = sp.vocab_size()
    assert got["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert got["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, n + 4)]
    assert got["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6] and got["tokenizer.ggml.token_type"][n:] == [5] * 4
    assert got["tokenizer.ggml.scores"][n:] == [-10000.0] * 4
    assert got["tokenizer.ggml.bos_token_id"] == 1 and got["tokenizer.ggml.eos_token_id"] == 2
