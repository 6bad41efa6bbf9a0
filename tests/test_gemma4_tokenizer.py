"""Gemma 4's GGUF tokenizer (tokenizer.ggml.model "gemma4") against the model's own HF tokenizer class
(transformers' GemmaTokenizer: BPE over raw UTF-8 with byte fallback, spaces as "▁") on one tiny
vocabulary: the HF side from vocab + merges, ours from the GGUF metadata llama.cpp's converter writes
for it (tokens in id order, CONTROL / UNKNOWN / BYTE / NORMAL types, "a b" merges, add_bos)."""

from __future__ import annotations

import gguf
import pytest

from tiny_tokenizer import CORPUS

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Emma who loved to play in the sun.",
    "  two  spaces and a trailing one ",
    "line one\nline two\n\n\nend\n",
    "unknown characters: é ü 😀 中文 ∑",
    "tabs\tand\r\nCRLF, digits 1234567890",
    "<bos> in text: a control token where special tokens are parsed",
]


@pytest.fixture(scope="module")
def vocab_merges():
    """A BPE trained on tiny_tokenizer's corpus with Gemma's pipeline: ids 0-3 specials, 4-259 byte tokens."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4 + ["\n\n", "a\nb\n\nc"], trainer)
    trained = tok.model.get_vocab() if hasattr(tok.model, "get_vocab") else tok.get_vocab()
    import json

    spec = json.loads(tok.to_str())
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for text, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    return vocab, merges


def test_gguf_gemma4_tokenizer_matches_hf(vocab_merges, tmp_path):
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    from localllm.gguf_file import open_gguf
    from localllm.tokenizer import load_gguf_tokenizer

    vocab, merges = vocab_merges
    hf = GemmaTokenizer(vocab=vocab, merges=merges)
    tokens = sorted(vocab, key=vocab.get)
    T = gguf.TokenType
    types = [T.CONTROL if t in ("<pad>", "<eos>", "<bos>") else T.UNKNOWN if t == "<unk>" else
             T.BYTE if t.startswith("<0x") else T.NORMAL for t in tokens]
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_gguf_tokenizer(open_gguf(tmp_path / "tok.gguf").metadata)
    assert ours.add_bos and ours.bos_id == 2
    byte_fallback_seen = False
    for text in TEXTS:
        expected = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, parse_special=True) == expected, text
        assert ours.decode(expected, skip_special=False) == hf.decode(expected) == text
        byte_fallback_seen |= any(4 <= i < 260 for i in expected)
    assert byte_fallback_seen  # the unknown characters took the <0xNN> path
    assert ours.encode("Hello", add_bos=True)[0] == 2
