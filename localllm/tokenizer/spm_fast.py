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
ids of words already seen are kept (a long text repeats its words). The new words of a long text go
to sentencepiece's batch encode on all the CPUs this process may use (its C++ threads split the list;
Python waits). Tried and dropped (docs/PERFORMANCE.md): the whole text in one call (sentencepiece
costs 3-5x more per character on one long string than on words: its merge heap grows), words joined
into chunks (no cheaper per character), finer exact cuts (where no token holds the two neighbouring
characters: a third of the characters to encode, but twice the words, and the Python work per word
eats the saving).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from itertools import chain

import numpy as np

SPACE = "\u2581"
CACHE_WORDS = 1 << 16  # distinct words whose ids are kept (a few MB); the cache starts over when full
# new words' characters from which sentencepiece's batch encode gets more than one thread (below this
# the work, about 0.2-0.5 us a character, is not worth starting threads for)
THREAD_CHARS = 1 << 14

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
    sentencepiece's), and an identity normalizer (the caller escapes spaces and adds the prefix).

    The pieces are laid out with numpy (a 256k vocab in a fraction of a second): each is
    [tag, varint(body size), tag, varint(text size), text, tag, f32 score, tag, type], the varints
    one or two bytes: texts must be shorter than 16 KiB (fast_spm_model checks)."""
    text, n = _utf8_texts(tokens)
    vlen = lambda x: 1 + (x >= 128)  # noqa: E731 - varint sizes of values below 2**14
    body = 1 + vlen(n) + n + 5 + 2
    start = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(1 + vlen(body) + body, out=start[1:])
    out = np.zeros(int(start[-1]), dtype=np.uint8)
    pos = start[:-1].copy()

    def put(values, width=None) -> None:  # write values (one byte, or a varint) at pos, advance pos
        nonlocal pos
        values = np.broadcast_to(np.asarray(values, dtype=np.int64), pos.shape)
        if width is None:  # one byte
            out[pos] = values
            pos = pos + 1
            return
        two = width == 2
        out[pos] = np.where(two, values & 0x7F | 0x80, values)
        out[pos[two] + 1] = values[two] >> 7
        pos = pos + width

    put(_tag(_PIECES, 2)[0])
    put(body, vlen(body))
    put(_tag(_PIECE, 2)[0])
    put(n, vlen(n))
    out[np.repeat(pos - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(len(text))] = text
    pos = pos + n
    put(_tag(_SCORE, 5)[0])
    score = np.asarray(scores).astype("<f4").view(np.uint8).reshape(-1, 4)
    for k in range(4):
        out[pos + k] = score[:, k]
    pos = pos + 4
    put(_tag(_TYPE, 0)[0])
    put(np.asarray(types, dtype=np.int64))  # types < 128: one byte
    trainer = _int_field(_MODEL_TYPE, _BPE) + _int_field(_BYTE_FALLBACK, 1)
    normalizer = (_bytes_field(_NAME, b"identity") + _int_field(_ADD_DUMMY_PREFIX, 0)
                  + _int_field(_REMOVE_EXTRA_WHITESPACES, 0) + _int_field(_ESCAPE_WHITESPACES, 0))
    return out.tobytes() + _bytes_field(_TRAINER, trainer) + _bytes_field(_NORMALIZER, normalizer)


def _utf8_texts(tokens: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the UTF-8 bytes of all texts one after the other, each text's byte count)."""
    joined = "\x00".join(tokens)
    if joined.count("\x00") == len(tokens) - 1:  # no NUL inside a text: one encode, cut at the NULs
        data = np.frombuffer(joined.encode("utf-8"), dtype=np.uint8)
        cuts = np.flatnonzero(data == 0)
        n = np.diff(cuts, prepend=-1, append=len(data)) - 1
        return data[data != 0], n
    raws = [t.encode("utf-8") for t in tokens]
    return np.frombuffer(b"".join(raws), dtype=np.uint8), np.fromiter(map(len, raws), dtype=np.int64)


def _mergeable(text: str, to_id: dict[str, int]) -> bool:
    """Whether llama.cpp's bigram merge could produce text: it is some pair of symbols (a token or a
    single character each) joined."""
    for cut in range(1, len(text)):
        left, right = text[:cut], text[cut:]
        if (left in to_id or len(left) == 1) and (right in to_id or len(right) == 1):
            return True
    return False


def fast_spm_model(tokens: Sequence[str], scores: Sequence[float], unk_id: int | None,
                   to_id: dict[str, int]) -> tuple[bytes | None, str]:
    """(serialized ModelProto, "") when sentencepiece gives llama.cpp's ids for this vocab, else
    (None, the reason). to_id: text -> id of tokens."""
    if len(to_id) != len(tokens):
        # sentencepiece refuses duplicates; llama.cpp keeps the last id, our Python path the first
        twice = next(t for i, t in enumerate(tokens) if to_id[t] != i)
        return None, f"token text {twice!r} appears twice"
    if "\x00".join(tokens).count("\x00") != len(tokens) - 1:
        return None, "a token text holds NUL"  # sentencepiece refuses such pieces
    if len(tokens) and max(map(len, tokens)) > 4000:
        return None, "a token text is longer than 4000 characters"  # model_proto's two-byte sizes
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
    wide = np.asarray(scores, dtype=np.float64)
    if not np.array_equal(wide, wide.astype(np.float32).astype(np.float64)):  # NaN is not equal either
        return None, "a score is not a float32"  # llama.cpp compares float32 scores
    types = [_NORMAL] * len(tokens)
    types[unk_id] = _UNKNOWN
    for tid in byte_ids:
        types[tid] = _BYTE
    return model_proto(tokens, wide, types), ""


def word_pattern(tokens: Sequence[str]) -> re.Pattern:
    """The words of an escaped text (findall): a word ends before a "▁" that follows a character c
    such that no token holds c + "▁", so no token, hence no merge, spans two words."""
    # the characters c, found in one go over the texts joined by NUL
    text = "\x00".join(tokens)
    pieces = text.split(SPACE)  # the character before each "▁" ends a piece ...
    joined = {p[-1] for p in pieces[:-1] if p}
    if "" in pieces[1:-1]:  # ... or is a "▁" itself
        joined.add(SPACE)
    if text.count("\x00") == len(tokens) - 1:  # no text holds NUL: only the joins put it before "▁"
        joined.discard("\x00")
    joined.discard(" ")  # escaped text holds no " "
    return words_regex(joined)


def words_regex(joined: set[str], general: bool = False) -> re.Pattern:
    """word_pattern for the set of characters that hold on to a following "▁"."""
    if not general and joined <= {SPACE}:  # the usual case, in a form the regex engine runs faster
        return re.compile(f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+" if joined else f"{SPACE}[^{SPACE}]*|[^{SPACE}]+")
    keep = "".join(re.escape(c) for c in sorted(joined))
    go_on = f"(?:(?<=[{keep}]){SPACE}[^{SPACE}]*)*" if joined else ""
    # a first character, the non-"▁" run after it, then each "▁" the previous character holds on to
    return re.compile(f"(?s:.)[^{SPACE}]*{go_on}")


def fast_spm(tokens: Sequence[str], scores: Sequence[float], unk_id: int | None, to_id: dict[str, int]
             ) -> tuple[FastSpm | None, str]:
    """(the sentencepiece engine, "") for a vocab it runs exactly, else (None, the reason)."""
    proto, reason = fast_spm_model(tokens, scores, unk_id, to_id)
    if proto is None:
        return None, reason
    try:
        return FastSpm(proto, tokens), ""
    except RuntimeError as e:  # a check of sentencepiece's own that the ones above do not foresee
        return None, f"sentencepiece refuses it: {e}"


class FastSpm:
    """sentencepiece over the words of an escaped text, with the ids of words seen before kept."""

    def __init__(self, proto: bytes, tokens: Sequence[str]) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        self._words = word_pattern(tokens).findall
        self._cache: dict[str, list[int]] = {}
        self.cache_words = CACHE_WORDS
        self.threads = usable_cpus()  # sentencepiece threads for a long text's new words

    def clear_cache(self) -> None:
        """Forget the words seen (benchmarks time the first encode of a text)."""
        self._cache = {}

    def encode(self, text: str) -> list[int]:
        """Ids of text (spaces already "▁", prefix already added), as llama.cpp's SPM gives them."""
        words = self._words(text)
        if not words:
            return []
        cache = self._cache  # this call's dict, even if another thread starts a new one meanwhile
        new = [w for w in dict.fromkeys(words) if w not in cache] if cache else list(dict.fromkeys(words))
        if len(cache) + len(new) > self.cache_words:
            cache = self._cache = {}
            new = list(dict.fromkeys(words))
        if new:
            cache.update(zip(new, self._encode_words(new)))
        if len(words) == 1:
            return list(cache[words[0]])
        return list(chain.from_iterable(map(cache.__getitem__, words)))

    def _encode_words(self, words: list[str]) -> list[list[int]]:
        """sentencepiece's ids of each word; threads for many characters (it runs the list inline when
        it has one word)."""
        threads = 1
        if self.threads > 1 and len(words) > 1 and sum(map(len, words)) >= THREAD_CHARS:
            threads = self.threads
        return self._sp.encode(words, num_threads=threads)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
