"""decode(encode(s)) == s for every text the vocabulary can represent, and a named report of the
characters it cannot (Tokenizer.unrepresentable), for llama.cpp's vocab files and the default model.

"Representable" (base.Tokenizer.unrepresentable): a character survives encode/decode on its own. The
oracle on the other side: the round trip of a text with unrepresentable characters gives the text with
exactly those characters dropped (or written as <unk>), never anything else.
"""

from __future__ import annotations

import random
import zlib

import pytest
from test_tokenizer import SMOLLM_NAME, VOCABS, gguf_tokenizer, read_cases, smollm_dir, vocab_path

from localllm.errors import LocalLLMError

# Seeded text pools: ASCII, whitespace, accented Latin, CJK, emoji (with ZWJ and skin tone),
# combining marks, right-to-left, control characters, and the odd corners of Unicode.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    " \t\n\r\v\f  ",
    "éèêàâäöüñçÅØßœÆŁţăĳ",
    "日本語中文한국어のテキスト、。",
    "😀🦙👍🏽\u200d🚀🌫️",
    "e\u0301a\u0308\u0327",
    "שלוםمرحبا",
    "".join(chr(c) for c in range(0x20)) + "\x7f\x85\xa0\xad",
    "\ufeff\ufffd\u2028\u2029\U0010ffff\ue000",
]
NAMES = list(VOCABS) + ["smollm2"]


def tokenizer(name: str):
    return gguf_tokenizer(smollm_dir() / SMOLLM_NAME if name == "smollm2" else vocab_path(name))


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        pools = rng.sample(POOLS, rng.randint(1, 3))
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))))
    return texts


def expected_back(tok, text: str) -> str:
    """What the round trip must give: text without the characters the vocabulary cannot write."""
    lost = {ch for ch, _ in tok.unrepresentable(text)}
    return "".join(ch for ch in text if ch not in lost)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip(name):
    tok = tokenizer(name)
    texts = random_texts(zlib.crc32(name.encode()), 150)
    texts += [t for t, _ in read_cases(name)] if name != "smollm2" else []
    both = {True: 0, False: 0}
    for text in texts:
        missing = tok.unrepresentable(text)
        both[not missing] += 1
        back = tok.decode(tok.encode(text))
        if not missing:
            assert back == text, (name, text)
        elif all(fate == "dropped" for _, fate in missing):
            assert back == expected_back(tok, text), (name, text, missing)
    assert both[True] > 100, both  # the exact side is well exercised on every vocabulary


def test_byte_level_gaps_are_reported():
    """SmolLM2's vocabulary has no token for six control bytes: they are named, not silently lost."""
    tok = tokenizer("smollm2")
    assert tok.unrepresentable("a\x14b\x04c\x14") == [("\x14", "dropped"), ("\x04", "dropped")]
    assert tok.decode(tok.encode("a\x14b")) == "ab"
    assert tok.unrepresentable("plain text, café 日本 😀") == []
    assert {ch for ch, _ in tok.unrepresentable("".join(map(chr, range(256))))} == set("\x04\x06\x13\x14\x16\x1d")


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "gpt-2", "gemma-4"])
def test_full_vocabularies_represent_everything(name):
    """Byte fallback (SPM, Gemma 4) and a complete byte alphabet (GPT-2) write every character."""
    tok = tokenizer(name)
    text = "".join(map(chr, range(0x300))) + "日本😀\U0010ffff"
    assert tok.unrepresentable(text) == []
    assert tok.decode(tok.encode(text)) == text


def test_spm_without_byte_tokens_uses_unk():
    from localllm.tokenizer.spm import SpmTokenizer

    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a"]
    tok = SpmTokenizer(tokens, [2, 3, 3, 1, 1, 1, 1], [0.0] * 7, unk_id=0, bos_id=1, eos_id=2, add_bos=True)
    assert tok.unrepresentable("ab") == []
    assert tok.decode(tok.encode("ab")) == "ab"
    assert tok.unrepresentable("axb") == [("x", "written as <unk>")]


@pytest.mark.parametrize("name", ["smollm2", "llama-spm"])
def test_any_string_encodes_or_fails_cleanly(name):
    """Lone surrogates (invalid UTF-8 from argv or a JSON escape) become U+FFFD; no other exception."""
    tok = tokenizer(name)
    for text in ["\udcff", "a\ud800b", "\ud83d", "x" * 3 + "\udfff"]:
        ids = tok.encode(text, add_bos=True, parse_special=True)
        assert "\ufffd" in tok.decode(ids)
        assert all(fate.startswith("not a character") for _, fate in tok.unrepresentable(text) if fate)
    with pytest.raises(LocalLLMError, match="expected text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
