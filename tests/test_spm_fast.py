"""The sentencepiece-run SPM tokenizer (localllm/tokenizer/spm_fast.py) against the pure-Python merge
(spm.spm_tokenize, a line-by-line reading of llama.cpp's llm_tokenizer_spm_session), which stays the
oracle: llama.cpp's vocab files on a fuzz corpus, tiny vocabs made to show each rule, and each vocab
the fast path must refuse."""

from __future__ import annotations

import copy
import random
import struct

import pytest

import localllm.tokenizer.spm_fast as spm_fast
from localllm.tokenizer import load_gguf_tokenizer
from localllm.tokenizer.spm import SPACE, SpmTokenizer, spm_tokenize
from test_tokenizer import gguf_tokenizer, read_cases, vocab_path

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# characters the fuzz texts are made of: blanks of every kind, ASCII, Latin-1, CJK, emoji (4-byte
# UTF-8), SentencePiece's own "▁", pieces of special-token and byte-token texts, NUL and controls
ALPHABET = list(" \t\n\r\v\f  abcdeEFGHxyz0123456789.,;:!?'\"()[]{}<>/\\-_=+*#@&%$^~`|") + [
    "é", "ß", "Ω", "я", "你", "好", "世", "界", "🦙", "👍🏽", "\u00a0", "\u3000", SPACE, "\x00", "\x1b",
    "\u200b", "\ufffd", "\U0010ffff", "<s>", "</s>", "<0x0A>", "<unk>", "<|endoftext|>", "<|user|>",
]


def fuzz_texts(seed: int, count: int, alphabet=ALPHABET, longest: int = 40) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        n = rng.randint(0, longest)
        texts.append("".join(rng.choice(alphabet) for _ in range(n)))
    return texts


def python_twin(tok: SpmTokenizer) -> SpmTokenizer:
    """The same tokenizer on the pure-Python merge."""
    twin = copy.copy(tok)
    twin._fast = None
    return twin


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_llama_cpp_vocabs_take_the_fast_path_and_match_the_oracle(name):
    tok = gguf_tokenizer(vocab_path(name))
    assert tok._fast is not None, tok.fast_reason
    slow = python_twin(tok)
    cases = [text for text, _ in read_cases(name)]
    # whole llama.cpp cases glued together (long words, runs of blanks across case borders) + fuzz
    rng = random.Random(1)
    glued = ["".join(rng.sample(cases, 6)) for _ in range(20)]
    texts = cases + glued + fuzz_texts(2, 400)
    for parse_special in (False, True):
        wrong = [t for t in texts if tok.encode(t, parse_special=parse_special)
                 != slow.encode(t, parse_special=parse_special)]
        assert not wrong, f"{len(wrong)} texts differ, first {wrong[0]!r}"
    # the engine alone on escaped text, without the space prefix: what a text piece after a special
    # token without add_space_prefix, or in the middle of a protected span, reaches
    for text in fuzz_texts(3, 200, longest=80):
        esc = text.replace(" ", SPACE)
        assert tok._fast.encode(esc) == spm_tokenize(esc, tok._to_id, tok._scores, tok._byte_ids), text


def test_long_text_with_word_cache():
    """A long text twice (the second time from the word cache) and again after the cache starts over."""
    tok = gguf_tokenizer(vocab_path("llama-spm"))
    text = "".join(text for text, _ in read_cases("llama-spm")) * 3 + " ".join(fuzz_texts(4, 50))
    esc = (" " + text).replace(" ", SPACE)
    want = spm_tokenize(esc, tok._to_id, tok._scores, tok._byte_ids)
    fast = spm_fast.FastSpm(spm_fast.fast_spm_model(tok._tokens, tok._scores, tok._unk_id, tok._to_id)[0], tok._tokens)
    assert fast.encode(esc) == want
    assert fast.encode(esc) == want
    fast.cache_words = 5  # a full cache starts over
    assert fast.encode(esc) == want and len(fast._cache) > 5
    assert fast.encode(esc[:50]) == spm_tokenize(esc[:50], tok._to_id, tok._scores, tok._byte_ids)


def test_long_text_on_threads(monkeypatch):
    """A long text's new words go to sentencepiece's batch encode on several threads (the split of the
    list between them must not change a word's ids or their order); a short one stays on one."""
    monkeypatch.setattr(spm_fast, "THREAD_CHARS", 512)  # a test-sized text is long enough
    tok = gguf_tokenizer(vocab_path("llama-spm"))
    text = "".join(text for text, _ in read_cases("llama-spm")) + " ".join(fuzz_texts(7, 300))
    esc = (" " + text).replace(" ", SPACE)
    fast = spm_fast.FastSpm(spm_fast.fast_spm_model(tok._tokens, tok._scores, tok._unk_id, tok._to_id)[0], tok._tokens)
    fast.threads = 3
    calls, sp = [], fast._sp

    class Spy:  # records the thread count of each batch encode
        def encode(self, words, num_threads):
            calls.append((len(words), num_threads))
            return sp.encode(words, num_threads=num_threads)

    fast._sp = Spy()
    assert fast.encode(esc) == spm_tokenize(esc, tok._to_id, tok._scores, tok._byte_ids)
    assert calls[0][0] > 100 and calls[0][1] == 3
    short = esc[:300]
    fast.clear_cache()
    assert fast.encode(short) == spm_tokenize(short, tok._to_id, tok._scores, tok._byte_ids)
    assert calls[1][1] == 1


def tiny_spm(tokens, scores, types=None, unk=0, **meta) -> SpmTokenizer:
    n = len(tokens)
    return load_gguf_tokenizer({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types or [1] * n,
        "tokenizer.ggml.unknown_token_id": unk,
        **meta,
    })


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the byte tokens, then pieces made to show the rules: equal scores (ties go to
    the leftmost pair: "aba" = "ab"+"a" = "a"+"ba"), a control token reachable by merges ("<s" + ">"),
    a user-defined and an unused token, "▁" inside tokens ("x▁y", "▁▁", ".▁") so words join across a
    "▁", and pieces that only lose to a better pair elsewhere."""
    pieces = [("a", -1), ("b", -1), ("c", -2), ("x", -1), ("y", -1), (".", -1), ("<", -3), (">", -3),
              ("s", -3), (SPACE, -1), ("ab", -2), ("ba", -2), ("aba", -4), ("bab", -4), ("abab", -5),
              ("bc", -3), ("abc", -3), ("x" + SPACE + "y", -2), ("x" + SPACE, -3), (SPACE * 2, -2),
              (SPACE * 3, -6), (SPACE + "a", -2), (SPACE + "ab", -2), (".", -9), ("." + SPACE, -4),
              ("<s", -5), ("你", -1), ("你好", -1), (SPACE + "你", -3), ("cc", -7), ("ccc", -7)]
    pieces = [p for i, p in enumerate(pieces) if p[0] not in [q[0] for q in pieces[:i]]]
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *[p for p, _ in pieces], "<user>", "bb"]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[float(s) for _, s in pieces], 0.0, -1.0]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4, 5]
    return tokens, scores, types


@pytest.mark.parametrize("prefix", [True, False])
def test_tiny_vocab_rules(prefix):
    tokens, scores, types = tiny_vocab()
    tok = tiny_spm(tokens, scores, types, **{"tokenizer.ggml.add_space_prefix": prefix})
    assert tok._fast is not None, tok.fast_reason
    slow = python_twin(tok)
    alphabet = list("abcxy.<>s  \n") + ["你", "好", "é", SPACE, "<s>", "<user>"]
    texts = fuzz_texts(5, 1500, alphabet, longest=30)
    for parse_special in (False, True):
        wrong = [t for t in texts if tok.encode(t, parse_special=parse_special)
                 != slow.encode(t, parse_special=parse_special)]
        assert not wrong, f"{len(wrong)} texts differ, first {wrong[0]!r}"
    # the rules by hand: ties to the leftmost pair ("ab" at 0 before "ba" at 1, then "ab" at 2, then
    # "ab"+"a"); a control token made by merges ("<s" + ">"); a character without a token as bytes
    ids = {t: i for i, t in enumerate(tokens)}
    lead = [ids[SPACE]] if prefix else []
    assert tok.encode("<s>") == lead + [ids["<s>"]]
    assert tok.encode("é") == lead + [ids["<0xC3>"], ids["<0xA9>"]]
    assert tok.encode("ababa") == ([ids[SPACE + "ab"], ids["aba"]] if prefix else [ids["ab"], ids["aba"]])


@pytest.mark.parametrize("change, reason", [
    (lambda t, s, ty: (t + ["a"], s + [0.0], ty + [1]), "appears twice"),
    (lambda t, s, ty: ([x for x in t if x != "<0x41>"], s[:-1], ty[:-1]), "no byte-fallback tokens"),
    (lambda t, s, ty: (t + ["<0x", "0A>"], s + [0.0, 0.0], ty + [1, 1]), "can merge into '<0x0A>'"),
    (lambda t, s, ty: (t + ["<unk", "<u"], s + [0.0, 0.0], ty + [1, 1]), "can merge into '<unk>'"),
    (lambda t, s, ty: (t, [0.1] + s[1:], ty), "not a float32"),
    (lambda t, s, ty: (t, [float("nan")] + s[1:], ty), "not a float32"),
    (lambda t, s, ty: (t + ["q\x00"], s + [0.0], ty + [1]), "holds NUL"),
    (lambda t, s, ty: (t + ["q" * 4001], s + [0.0], ty + [1]), "longer than 4000"),
])
def test_vocabs_the_fast_path_refuses(change, reason):
    """Each vocab sentencepiece could not run exactly keeps the Python merge, which still works."""
    tokens, scores, types = change(*tiny_vocab())
    tok = tiny_spm(tokens, scores, types)
    assert tok._fast is None and reason in tok.fast_reason
    assert tok.decode(tok.encode("abab x y")) == "abab x y"


def test_one_character_unknown_token_is_refused():
    tokens, scores, types = tiny_vocab()
    tokens[0] = "?"
    tok = tiny_spm(tokens, scores, types)
    assert tok._fast is None and "one character" in tok.fast_reason


def reference_proto(tokens, scores, types) -> bytes:
    """model_proto's bytes written field by field (protobuf wire format: key = field << 3 | wire type)."""
    def varint(n):
        out = b""
        while n > 0x7F:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    def text(field, data):
        return varint(field << 3 | 2) + varint(len(data)) + data

    pieces = b"".join(text(1, text(1, t.encode()) + b"\x15" + struct.pack("<f", s) + b"\x18" + varint(ty))
                      for t, s, ty in zip(tokens, scores, types))
    trainer = text(2, b"\x18\x02" + varint(35 << 3) + b"\x01")  # model_type BPE, byte_fallback
    normalizer = text(3, text(1, b"identity") + b"\x18\x00\x20\x00\x28\x00")  # no prefix/trim/escape
    return pieces + trainer + normalizer


@pytest.mark.parametrize("nul", [False, True])
def test_model_proto_layout(nul):
    """The numpy layout equals the field-by-field one, for texts whose sizes need two-byte varints and
    multi-byte characters (and, on the second run, NUL inside a text); sentencepiece reads it back."""
    import sentencepiece

    tokens, scores, types = tiny_vocab()
    tokens += ["x" * 119, "y" * 120, "z" * 300, "é" * 64, "🦙" * 1000] + (["a\x00b"] if nul else [])
    scores += [-1.5, -2.25, -3.0, 1e-30, -1e30] + ([-7.0] if nul else [])
    kinds = [2 if i == 0 else 6 if t in BYTES else 1 for i, t in enumerate(tokens)]
    proto = spm_fast.model_proto(tokens, scores, kinds)
    assert proto == reference_proto(tokens, scores, kinds)
    if nul:  # sentencepiece refuses a piece with NUL; such a vocab keeps the Python merge
        assert spm_fast.fast_spm(tokens, scores, 0, {t: i for i, t in enumerate(tokens)})[1] == \
            "a token text holds NUL"
        return
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    assert [sp.id_to_piece(i) for i in range(sp.get_piece_size())] == tokens
    assert [sp.get_score(i) for i in range(len(tokens))] == [struct.unpack("<f", struct.pack("<f", s))[0]
                                                           for s in scores]
    assert [i for i in range(len(tokens)) if sp.is_byte(i)] == [tokens.index(b) for b in BYTES]
    assert sp.unk_id() == 0


@pytest.mark.parametrize("joined", [set(), {SPACE}, {SPACE, "a"}, {"a", "]", "\\", "^", "-"}])
def test_word_cuts(joined):
    """The short regexes for the usual cases cut exactly where the general one does, and the general
    one cuts before a "▁" exactly when the character before it is not in joined."""
    alphabet = [SPACE, SPACE, "a", "b", "]", "\\", "^", "-", "\n", "你"]
    for text in fuzz_texts(6, 300, alphabet, longest=25):
        words = spm_fast.words_regex(joined).findall(text)
        assert words == spm_fast.words_regex(joined, general=True).findall(text)
        assert "".join(words) == text and all(words)
        cuts = [i for i in range(1, len(text)) if text[i] == SPACE and text[i - 1] not in joined]
        assert [sum(map(len, words[:k])) for k in range(1, len(words))] == cuts


def test_word_pattern_from_tokens():
    """Which characters hold on to a following "▁", read from the token texts (the NUL that joins
    them to search them in one go is not one of them unless a text holds it)."""
    assert spm_fast.word_pattern(["▁a", "b"]).pattern == spm_fast.words_regex(set()).pattern
    assert spm_fast.word_pattern(["▁▁", "▁a"]).pattern == spm_fast.words_regex({SPACE}).pattern
    assert spm_fast.word_pattern(["x▁y", "▁▁"]).pattern == spm_fast.words_regex({"x", SPACE}).pattern
    assert spm_fast.word_pattern(["a\x00▁", "▁b"]).pattern == spm_fast.words_regex({"\x00"}).pattern
    assert spm_fast.word_pattern(["a ▁"]).pattern == spm_fast.words_regex(set()).pattern  # no " " in escaped text
    llama = gguf_tokenizer(vocab_path("llama-spm"))
    assert spm_fast.word_pattern(llama._tokens).pattern == spm_fast.words_regex({SPACE}).pattern
