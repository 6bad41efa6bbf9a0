"""Byte-level BPE tokenizer for GGUF `tokenizer.ggml.model == "gpt2"`, run by the `tokenizers` library.

Must give the same ids as llama.cpp's `llm_tokenizer_bpe_session::tokenize` (src/llama-vocab.cpp),
which in turn matches the model's own HF tokenizer.json:
- the text is split by the pre-tokenizer regexes named by `tokenizer.ggml.pre` (pretok.py);
- each piece's UTF-8 bytes are written in GPT-2's byte alphabet (byte 0x20 -> "Ġ", ...), which is
  also how the GGUF stores the vocabulary and the "a b" merges;
- merges are applied by rank (lowest first, ties leftmost); with ignore_merges (Llama 3) a piece that
  is itself a token is taken whole.
SentencePiece-style BPE (Gemma 4, `PreTokenizer.byte_encode` False) differs only in the alphabet:
spaces become "\u2581" (`escape_spaces`), merges run over the raw characters, and a character
without a token is written as <0xNN> byte tokens (the library's byte_fallback, as llama.cpp does).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ..errors import LocalLLMError
from .base import Tokenizer
from .pretok import PreTokenizer

SPACE = "\u2581"  # "▁", SentencePiece's escaped space
NEWLINE_RUN = re.compile("\n+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the
    other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) take U+0100 onwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


def byte_level_decode(text: str) -> bytes:
    """Raw bytes of a byte-level token text; a character outside the alphabet stands for itself."""
    out = bytearray()
    for ch in text:
        b = BYTE_DECODER.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def split_merge(merge: str) -> tuple[str, str] | None:
    # llama.cpp: the separator is the first blank after position 0
    pos = merge.find(" ", 1)
    if pos < 0:
        return None
    return merge[:pos], merge[pos + 1 :]


def build_bpe_model(tokens: Sequence[str], merges: Sequence[str], pretok: PreTokenizer) -> HFTokenizer:
    """A `tokenizers.Tokenizer` that splits with pretok's regexes, byte-encodes, and applies merges."""
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    pairs = []
    for merge in merges:
        pair = split_merge(merge)
        # the library rejects merges whose parts or result are not tokens; llama.cpp would merge and
        # then fall back to bytes, which never happens with a consistent vocabulary
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    with library_errors("bad BPE vocabulary (tokenizer.ggml.tokens / merges)"):  # the library's own check
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pretok.ignore_merges,
                           fuse_unk=False, byte_fallback=not pretok.byte_encode)
    hf = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pretok.regexes]
    if pretok.byte_encode:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        hf.decoder = decoders.ByteLevel()
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
    return hf


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def library_errors(what: str) -> Iterator[None]:
    """A failure inside the `tokenizers` library (a bare Exception, or a Rust panic: pyo3's
    PanicException derives from BaseException) as one error line; Ctrl-C and SIGTERM pass through."""
    try:
        yield
    except Exception as e:
        raise LocalLLMError(f"{what}: {first_line(e)}") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise LocalLLMError(f"{what}: {first_line(e)}") from None


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to a scratch file for the duration: a Rust panic prints its own message
    (and, with RUST_BACKTRACE, a hint) there before pyo3 raises, which would make a second stderr line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def library_encode(hf: HFTokenizer, text: str) -> list[int]:
    """The ids the `tokenizers` library gives for text (no special tokens added). Text comes here as
    valid str (base.encodable)."""
    with library_errors("the tokenizer failed on this text"):
        return hf.encode(text, add_special_tokens=False).ids


class BpeTokenizer(Tokenizer):
    kind = "bpe"

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        *,
        pre_name: str,
        pretok: PreTokenizer,
        **kwargs,
    ) -> None:
        super().__init__(tokens, token_types, **kwargs)
        self.pre = pre_name
        self._pretok = pretok
        self._hf = build_bpe_model(self._tokens, merges, pretok)

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        if self._pretok.escape_spaces:
            text = text.replace(" ", SPACE)
        if not self._pretok.whole_newline_runs:
            return library_encode(self._hf, text)
        # newline runs that are tokens stay whole; the text between them goes to the merges
        ids: list[int] = []
        pos = 0
        for run in NEWLINE_RUN.finditer(text):
            tid = self._to_id.get(run.group())
            if tid is not None:
                if run.start() > pos:
                    ids += library_encode(self._hf, text[pos:run.start()])
                ids.append(tid)
                pos = run.end()
        if pos < len(text):
            ids += library_encode(self._hf, text[pos:])
        return ids

    def _normal_piece(self, tid: int) -> bytes:
        if not self._pretok.byte_encode:
            text = self._tokens[tid]
            return (text.replace(SPACE, " ") if self._pretok.escape_spaces else text).encode("utf-8")
        return byte_level_decode(self._tokens[tid])
