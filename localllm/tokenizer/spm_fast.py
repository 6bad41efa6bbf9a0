"""llama.cpp's SPM tokenizer run by the `sentencepiece` library (C++), for GGUF model "llama".

llama.cpp's `llm_tokenizer_spm_session` is a port of sentencepiece's BPE encoder (bpe_model.cc):
the same bigram agenda (highest score of the merged piece first, ties to the leftmost pair), the
same stale-pair test, the same byte fallback. So a sentencepiece ModelProto made from the GGUF vocab
gives llama.cpp's ids, provided the proto hides none of llama.cpp's freedoms:
- every token is a merge target in llama.cpp (its text->id map holds all tokens), while sentencepiece
  merges only into NORMAL / USER_DEFINED / UNUSED pieces and matches USER_DEFINED ones whole before
  merging, and splits UNUSED ones back: so every token is written as NORMAL, except
- the 256 "<0xNN>" tokens (BYTE: sentencepiece's byte fallback needs them) and the unknown token
  (sentencepiece needs one); these cannot be merged into by sentencepiece, so the vocab is accepted
  only if llama.cpp cannot merge into them either (no split of their text into two merge operands);
- scores are float32 in both (GGUF stores f32).
`fast_spm_model` says why when a vocab cannot be represented; the caller then keeps the pure-Python
tokenizer (spm.spm_tokenize, which stays the reference in the tests).

Speed: the text is cut before each "▁" that no token can span (the merges on the two sides never
meet, so each word's ids are those of the whole text), each distinct word is encoded once, and the
ids of words already seen are kept (a long text repeats its words).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from itertools import chain

SPACE = "\u2581"
CACHE_WORDS = 1 << 18  # distinct words whose ids are kept; the cache starts over when it is full

# sentencepiece_model.proto field numbers (ModelProto, SentencePiece, TrainerSpec, NormalizerSpec)
_PIECES, _TRAINER, _NORMALIZER = 1, 2, 3
_PIECE, _SCORE, _TYPE = 1, 2, 3
_NORMAL, _UNKNOWN, _BYTE = 1, 2, 6
_MODEL_TYPE, _BPE, _BYTE_FALLBACK = 3, 2, 35
_NAME, _ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WHITESPACES, _ESCAPE_WHITESPACES = 1, 3, 4, 5


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(data)) + data


def _int_field(field: int, value: int) -> bytes:
    return _tag(field, 0) + _varint(value)


def model_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> bytes:
    """A serialized sentencepiece ModelProto: BPE with byte fallback, the pieces as given (types are
    sentencepiece's), and an identity normalizer (the caller escapes spaces and adds the prefix)."""
    piece_tag, score_tag, type_tag = _tag(_PIECE, 2), _tag(_SCORE, 5), _tag(_TYPE, 0)
    outer = _tag(_PIECES, 2)
    parts = []
    for text, score, ptype in zip(tokens, scores, types):
        raw = text.encode("utf-8")
        body = b"".join((piece_tag, _varint(len(raw)), raw, score_tag, struct.pack("<f", score),
                         type_tag, _varint(ptype)))
        parts.append(outer + _varint(len(body)) + body)
    trainer = _int_field(_MODEL_TYPE, _BPE) + _int_field(_BYTE_FALLBACK, 1)
    normalizer = (_bytes_field(_NAME, b"identity") + _int_field(_ADD_DUMMY_PREFIX, 0)
                  + _int_field(_REMOVE_EXTRA_WHITESPACES, 0) + _int_field(_ESCAPE_WHITESPACES, 0))
    return b"".join(parts) + _bytes_field(_TRAINER, trainer) + _bytes_field(_NORMALIZER, normalizer)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _mergeable(text: str, to_id: dict[str, int]) -> bool:
    """Whether llama.cpp's bigram merge could produce text: it is some pair of symbols (a token or a
    single character each) joined."""
    for cut in range(1, len(text)):
        left, right = text[:cut], text[cut:]
        if (left in to_id or len(left) == 1) and (right in to_id or len(right) == 1):
            return True
    return False


def fast_spm_model(tokens: Sequence[str], scores: Sequence[float], unk_id: int | None
                   ) -> tuple[bytes | None, str]:
    """(serialized ModelProto, "") when sentencepiece gives llama.cpp's ids for this vocab, else
    (None, the reason)."""
    to_id: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if to_id.setdefault(text, i) != i:
            # sentencepiece refuses duplicates; llama.cpp keeps the last id, our Python path the first
            return None, f"token text {text!r} appears twice"
    byte_ids = [to_id.get(f"<0x{b:02X}>") for b in range(256)]
    if None in byte_ids:
        # sentencepiece's byte fallback needs all 256; llama.cpp then uses 1-char tokens or <unk>
        return None, "no byte-fallback tokens (<0x00>..<0xFF>)"
    if unk_id is None:
        return None, "no unknown token"
    unk = tokens[unk_id]
    if len(unk) == 1:  # sentencepiece would write that character as bytes, llama.cpp as <unk>
        return None, f"the unknown token is one character ({unk!r})"
    reserved = [unk_id, *byte_ids]
    for tid in reserved:
        if _mergeable(tokens[tid], to_id):
            return None, f"llama.cpp can merge into {tokens[tid]!r}, sentencepiece cannot"
    if any(math.isnan(s) or _f32(s) != s for s in scores):
        return None, "a score is not a float32"  # llama.cpp compares float32 scores
    types = [_NORMAL] * len(tokens)
    types[unk_id] = _UNKNOWN
    for tid in byte_ids:
        types[tid] = _BYTE
    return model_proto(tokens, scores, types), ""


def word_pattern(tokens: Sequence[str]) -> re.Pattern:
    """The words of an escaped text (findall): a word ends before a "▁" that follows a character c
    such that no token holds c + "▁", so no token, hence no merge, spans two words."""
    joined = set()  # the characters c
    for text in tokens:
        pos = text.find(SPACE, 1)
        while pos > 0:
            joined.add(text[pos - 1])
            pos = text.find(SPACE, pos + 1)
    go_on = f"(?:(?<=[{''.join(re.escape(c) for c in sorted(joined))}]){SPACE}[^{SPACE}]*)*" if joined else ""
    # a first character, the non-"▁" run after it, then each "▁" the previous character holds on to
    return re.compile(f"(?s:.)[^{SPACE}]*{go_on}")


class FastSpm:
    """sentencepiece over the words of an escaped text, with the ids of words seen before kept."""

    def __init__(self, proto: bytes, tokens: Sequence[str]) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        self._words = word_pattern(tokens).findall
        self._cache: dict[str, list[int]] = {}
        self.cache_words = CACHE_WORDS

    def encode(self, text: str) -> list[int]:
        """Ids of text (spaces already "▁", prefix already added), as llama.cpp's SPM gives them."""
        words = self._words(text)
        if not words:
            return []
        cache = self._cache
        new = [w for w in dict.fromkeys(words) if w not in cache]
        if len(cache) + len(new) > self.cache_words:
            cache.clear()
            new = list(dict.fromkeys(words))
        if new:
            cache.update(zip(new, self._sp.encode(new, num_threads=1)))
        if len(words) == 1:
            return list(cache[words[0]])
        return list(chain.from_iterable(map(cache.__getitem__, words)))
