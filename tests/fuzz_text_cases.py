"""Random inputs for the tokenizers: text for encode (lone surrogates, control characters, long runs
of one character, random code points, random bytes decoded with surrogateescape, special-token
texts) and id lists for decode (random, negative, past the vocabulary, huge). A case is plain data
(JSON-able), so that a failing one is saved as a file and replayed."""

from __future__ import annotations

import random

SPECIAL_TEXTS = ["<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                 "<|eot_id|>", "<bos>", "<eos>", "<pad>", "<|end|>", "<start_of_turn>", "[INST]", "<0x0A>", "<0xFF>"]
PIECES = ["hello", " world", "\n", "\t", " ", "  ", "\r\n", "é", "ü", "日本語", "🙂", "👨‍👩‍👧", "\u200b", "\ufeff",
          "\u0301", "ﬁ", "Ω", "'s", "'S", "123", "1234567", "\x00", "\x14", "\x7f", "\u2028", "a\u0301"]
RUN_LENGTHS = [1000, 5000, 20000]


def random_char(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:
        return chr(rng.randrange(0x20, 0x7F))
    if roll < 0.4:
        return chr(rng.randrange(0, 0x20))
    if roll < 0.5:
        return chr(rng.randrange(0xD800, 0xE000))  # a lone surrogate
    if roll < 0.8:
        return chr(rng.randrange(0x80, 0x3000))
    return chr(rng.randrange(0x3000, 0x110000))


def random_text(rng: random.Random) -> tuple[str, str]:
    """(text, how it was made)."""
    kind = rng.choice(["chars", "pieces", "bytes", "run", "specials", "empty"])
    n = rng.choice([1, 2, 5, 20, 100, 500])
    if kind == "chars":
        text = "".join(random_char(rng) for _ in range(n))
    elif kind == "pieces":
        text = "".join(rng.choice(PIECES) for _ in range(n))
    elif kind == "bytes":
        text = bytes(rng.randrange(256) for _ in range(n)).decode("utf-8", "surrogateescape")
    elif kind == "run":
        text = rng.choice(["a", " ", "\n", "日", "1", "\ud800", "<", "'", "🙂"]) * rng.choice(RUN_LENGTHS)
    elif kind == "specials":  # special-token texts among ordinary pieces
        text = "".join(rng.choice(SPECIAL_TEXTS + PIECES) for _ in range(n))
    else:
        text = ""
    return text, kind


# ids relative to the vocabulary's size ("V-1": its last id), resolved by resolve_ids in the worker
EDGE_IDS = [0, 1, 2, "V-1", "V", "V+1", -1, -2, 2**31, 2**63, 2**64, -(2**63)]


def random_ids(rng: random.Random) -> list:
    n = rng.choice([0, 1, 3, 20, 200])
    return [rng.choice(EDGE_IDS) if rng.random() < 0.3 else rng.randrange(32000) for _ in range(n)]


def resolve_ids(ids: list, vocab_size: int) -> list[int]:
    """Concrete ids: relative ones against this vocabulary, plain ones folded into it."""
    rel = {"V-1": vocab_size - 1, "V": vocab_size, "V+1": vocab_size + 1}
    return [rel[i] if isinstance(i, str) else i % vocab_size if 0 <= i < 32000 else i for i in ids]


def make_case(rng: random.Random, vocabs: list[str]) -> dict:
    """{vocab, op: encode|decode|stream, ...}: vocab is an index into the worker's tokenizer list."""
    v = rng.randrange(len(vocabs))
    op = rng.choice(["encode", "encode", "encode", "decode", "stream"])
    if op == "encode":
        text, kind = random_text(rng)
        return dict(vocab=v, name=vocabs[v], op=op, text=text, kind=kind, add_bos=rng.random() < 0.5,
                    parse_special=rng.random() < 0.5)
    return dict(vocab=v, name=vocabs[v], op=op, ids=random_ids(rng), skip_special=rng.random() < 0.5)
