"""The Tokenizer every model loader returns, plus incremental (streaming) decoding.

What is shared by all vocabularies lives here, following llama.cpp's src/llama-vocab.cpp:
- special tokens written in the text are cut out first (`tokenizer_st_partition`): control and
  unknown tokens only with parse_special, user-defined tokens always, longest token text first;
- the pieces in between go to the vocabulary's own algorithm (`_encode_text`, SPM or BPE);
- a token's output bytes follow `token_to_piece`: control/unknown tokens print nothing unless asked,
  user-defined tokens print their text as stored, byte tokens (<0xNN>) print that byte.
Subclasses supply `_encode_text` and `_normal_piece` (the bytes of a normal token).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from ..errors import LocalLLMError
from ..user_text import repair

# GGUF tokenizer.ggml.token_type values (llama.cpp enum llama_token_type).
TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Token texts that end a turn when they exist as control tokens (see llama.cpp's special_eog_ids).
STOP_TOKEN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>",
                    "<eos>", "<turn|>", "<|tool_response>")  # the last three: Gemma 4

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp for lstrip/rstrip of special tokens


class Tokenizer:
    """Text <-> token ids for one vocabulary. Build it with load_gguf_tokenizer / load_hf_tokenizer."""

    kind: str = ""  # "spm" or "bpe"
    pre: str | None = None  # pre-tokenizer name (bpe)

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int | None] = (),
        strip_leading_space: bool = False,
        rstrip_ids: Iterable[int] = (),
    ) -> None:
        self._tokens = list(tokens)
        self.vocab_size = len(self._tokens)
        types = list(token_types) if token_types is not None else []
        self._types = types[: self.vocab_size] + [TOKEN_NORMAL] * (self.vocab_size - len(types))
        self._to_id: dict[str, int] = {}
        for i, text in enumerate(self._tokens):
            self._to_id.setdefault(text, i)  # first id wins on a duplicate text
        self.bos_id = self._checked_id(bos_id)
        self.eos_id = self._checked_id(eos_id)
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.chat_template = chat_template or None
        self.stop_ids = self._stop_ids(extra_stop_ids)
        # Whether the first output space is dropped: SentencePiece's "add dummy prefix" undone on decode.
        self._strip_leading_space = strip_leading_space
        self._specials = self._special_list(set(rstrip_ids))
        self._piece_cache: dict[int, bytes] = {}
        self._char_fate: dict[str, str | None] = {}  # unrepresentable()'s answers, per character

    # ---- construction helpers -------------------------------------------------------------------

    def _checked_id(self, token_id: int | None) -> int | None:
        if token_id is None or not 0 <= int(token_id) < self.vocab_size:
            return None
        return int(token_id)

    def _stop_ids(self, extra: Iterable[int | None]) -> frozenset[int]:
        stops = {i for i in (self.eos_id, *(self._checked_id(e) for e in extra)) if i is not None}
        for name in STOP_TOKEN_NAMES:
            tid = self._to_id.get(name)
            if tid is not None and self._types[tid] == TOKEN_USER_DEFINED:
                # llama.cpp makes such a token control (Gemma 4's user-defined <|tool_response>):
                # parsed only with parse_special, not printed by decode
                self._types[tid] = TOKEN_CONTROL
            if tid is not None and self._types[tid] == TOKEN_CONTROL:
                stops.add(tid)
        return frozenset(stops)

    def _special_list(self, rstrip_ids: set[int]) -> list[tuple[str, int, bool, bool]]:
        """(text, id, is_control_or_unknown, rstrip) of the tokens matched whole in text, longest first
        (llama.cpp cache_special_tokens: control, user-defined and unknown tokens)."""
        found = []
        for tid, ttype in enumerate(self._types):
            if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and self._tokens[tid]:
                found.append((self._tokens[tid], tid, ttype != TOKEN_USER_DEFINED, tid in rstrip_ids))
        found.sort(key=lambda s: -len(s[0].encode("utf-8")))  # stable: equal lengths keep id order
        return found

    # ---- encoding -------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of text; BOS first if add_bos (and the vocabulary has one).

        parse_special: control tokens written in the text (e.g. "<|im_start|>") become their ids;
        otherwise they are tokenized as plain text. User-defined tokens are always matched whole,
        as llama.cpp and HF tokenizers both do. A lone surrogate (not text: invalid UTF-8 that
        reached Python as a surrogate escape) is encoded as U+FFFD."""
        text = encodable(text)
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        return ids + self._encode_fragments(split_special(text, self._specials, parse_special))

    def encode_protected(self, text: str, protected: list[tuple[int, int]]) -> list[int]:
        """Like encode(text, parse_special=True), except that special tokens are not parsed inside
        the character spans `protected` (chat messages: a user typing "<|im_end|>" must not end the
        turn). Plain text on both sides of a span boundary is tokenized as one piece, so the ids equal
        encode(text, parse_special=True) whenever the spans hold no special token text."""
        text = encodable(text)
        frags: list = []
        pos = 0
        for start, end in sorted(protected) + [(len(text), len(text))]:
            frags += split_special(text[pos:start], self._specials, True)
            # Inside a span only user-defined tokens match (as encode(parse_special=False) does).
            frags += split_special(text[start:end], self._specials, False)
            pos = max(pos, end)
        return self._encode_fragments(_merge_text(frags))

    def _encode_fragments(self, frags: list) -> list[int]:
        """Ids of split_special's output: special ids as they are, text pieces tokenized."""
        ids: list[int] = []
        after_special = True  # llama.cpp SPM: a text piece at the start or after a special token
        for frag in frags:
            if isinstance(frag, int):
                ids.append(frag)
                after_special = True
            else:
                ids.extend(self._encode_text(frag, after_special))
                after_special = False
        return ids

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        raise NotImplementedError

    def unrepresentable(self, text: str) -> list[tuple[str, str]]:
        """(character, what becomes of it) for each distinct character of text, in order of first
        appearance, that this vocabulary cannot write.

        A character is representable when it survives on its own: decode(encode(c)) == c. That is
        exact for byte-level BPE (a character is its UTF-8 bytes, and a byte without a token is dropped
        wherever it stands) and for SentencePiece with byte fallback (everything survives); for SPM
        without byte tokens a character that is not a token becomes <unk>. Special-token parsing plays
        no part (one character is never parsed as one). Then decode(encode(s)) == s for every s made of
        representable characters (tests/test_tokenizer_roundtrip.py)."""
        cache = self._char_fate
        found = []
        for ch in dict.fromkeys(text):
            if ch not in cache:
                cache[ch] = self._fate(ch)
            if cache[ch] is not None:
                found.append((ch, cache[ch]))
        return found

    def _fate(self, ch: str) -> str | None:
        """None if ch survives encode/decode on its own, else what becomes of it."""
        if "\ud800" <= ch <= "\udfff":
            return "not a character (invalid UTF-8): replaced by U+FFFD"
        ids = self.encode(ch)
        back = self.decode(ids)
        if back == ch:
            return None
        unknown = [i for i in ids if self._types[i] == TOKEN_UNKNOWN]
        if unknown:
            return f"written as {self._tokens[unknown[0]]}"
        if not back:
            return "dropped"
        return f"written as {back!r}"

    # ---- decoding -------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """The vocabulary string as stored (e.g. "Ġhello", "▁hello", "<0x0A>", "<|im_end|>")."""
        return self._tokens[self._index(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes this token adds to the output; b"" for control/unknown/unused tokens."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_cache[token_id] = self._piece(self._index(token_id), skip_special=True)
        return piece

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for, special tokens written out (llama.cpp's token_to_piece with
        special=true, what llama-tokenize prints): " w" for "Ġw", b"\\n" for "<0x0A>"."""
        return self._piece(self._index(token_id), skip_special=False)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        if skip_special:
            data = b"".join(self.token_bytes(i) for i in ids)
        else:
            data = b"".join(self._piece(self._index(i), skip_special=False) for i in ids)
        if self._strip_leading_space and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def _index(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise LocalLLMError(f"token id {token_id} is outside the vocabulary ({self.vocab_size} tokens)")
        return int(token_id)

    def _piece(self, tid: int, skip_special: bool) -> bytes:
        # llama.cpp token_to_piece: attr-driven, the same for SPM and BPE except for normal tokens.
        ttype = self._types[tid]
        text = self._tokens[tid]
        if ttype in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b"" if skip_special else text.encode("utf-8")
        if ttype == TOKEN_USER_DEFINED:
            return text.encode("utf-8")
        if ttype == TOKEN_BYTE:
            return byte_token_value(text)
        if ttype in (TOKEN_UNUSED, TOKEN_UNDEFINED):
            return b""
        return self._normal_piece(tid)

    def _normal_piece(self, tid: int) -> bytes:
        raise NotImplementedError

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return f"<Tokenizer {self.kind}{pre}, {self.vocab_size} tokens>"


def encodable(text: str) -> str:
    """text with lone surrogates replaced by U+FFFD (they have no UTF-8 form); one error for non-text."""
    if not isinstance(text, str):
        raise LocalLLMError(f"cannot tokenize a {type(text).__name__}: expected text")
    return repair(text)[0]


def byte_token_value(text: str) -> bytes:
    """b"\\x0a" for "<0x0A>" (SentencePiece byte-fallback token); its text otherwise."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return text.encode("utf-8")


def split_special(text: str, specials: list[tuple[str, int, bool, bool]], parse_special: bool) -> list:
    """Text cut into str pieces and int ids of special tokens found in it (llama.cpp
    tokenizer_st_partition: one token at a time, longest first, each occurrence left to right;
    rstrip drops the blanks after a match)."""
    if not text:
        return []
    frags: list = [text]
    for special, tid, control, rstrip in specials:
        if control and not parse_special:
            continue
        if special not in text:
            continue
        out: list = []
        for frag in frags:
            if isinstance(frag, int) or special not in frag:
                out.append(frag)
            else:
                out.extend(_cut(frag, special, tid, rstrip))
        frags = out
    return frags


def _merge_text(frags: list) -> list:
    """Join neighbouring str fragments (ids stay as they are)."""
    out: list = []
    for f in frags:
        if isinstance(f, str) and out and isinstance(out[-1], str):
            out[-1] += f
        elif f != "":
            out.append(f)
    return out


def _cut(frag: str, special: str, tid: int, rstrip: bool) -> list:
    out: list = []
    start = 0
    while True:
        pos = frag.find(special, start)
        if pos < 0:
            break
        if pos > start:
            out.append(frag[start:pos])
        out.append(tid)
        start = pos + len(special)
        if rstrip:
            while start < len(frag) and frag[start] in _ASCII_SPACE:
                start += 1
    if start < len(frag):
        out.append(frag[start:])
    return out


class StreamDecoder:
    """Turns generated token ids into text as they come, never splitting a UTF-8 character.

    push() returns the text completed by this token (incomplete trailing bytes are held back);
    the pieces plus flush() concatenate to exactly tok.decode(ids)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = tok._strip_leading_space

    def push(self, token_id: int) -> str:
        data = self._tok.token_bytes(token_id)
        if self._at_start and data:
            self._at_start = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
