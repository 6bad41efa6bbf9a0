"""SentencePiece-BPE tokenizer for GGUF `tokenizer.ggml.model == "llama"`.

Must give the same ids as llama.cpp's `llm_tokenizer_spm_session::tokenize` (src/llama-vocab.cpp):
- a space is put in front of a text piece that starts the input or follows a special token, when
  `tokenizer.ggml.add_space_prefix` is true (the default for this model);
- spaces become "▁" (U+2581) and the text is cut into single characters;
- neighbouring symbols whose concatenation is a token are merged, best first: highest score of the
  merged token, ties to the leftmost pair; merged symbols can merge again;
- a final symbol that is not a token is written as its UTF-8 bytes, as <0xNN> byte tokens.
The merge runs in the `sentencepiece` library when the vocab allows it exactly (spm_fast.py, about
30x faster); `spm_tokenize` below is the pure-Python path for the others and the tests' reference.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .base import Tokenizer
from .spm_fast import FastSpm, fast_spm

SPACE = "\u2581"  # "▁", SentencePiece's escaped space


class SpmTokenizer(Tokenizer):
    kind = "spm"

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        scores: Sequence[float] | None,
        *,
        add_space_prefix: bool = True,
        unk_id: int | None = None,
        fast: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(tokens, token_types, strip_leading_space=add_space_prefix, **kwargs)
        n = self.vocab_size
        self._scores = [float(s) for s in scores[:n]] if scores is not None else []
        self._scores += [0.0] * (n - len(self._scores))
        self._add_space_prefix = add_space_prefix
        self._unk_id = self._checked_id(unk_id)
        self._byte_ids = self._byte_table()
        # the sentencepiece engine, or why this vocab keeps the pure-Python merge
        self._fast: FastSpm | None = None
        self.fast_reason = "not asked for"
        if fast:
            self._fast, self.fast_reason = fast_spm(self._tokens, self._scores, self._unk_id, self._to_id)

    def _byte_table(self) -> list[int | None]:
        """byte value -> token id (llama.cpp byte_to_token: "<0xNN>", else the 1-char token)."""
        table: list[int | None] = []
        for b in range(256):
            tid = self._to_id.get(f"<0x{b:02X}>")
            if tid is None:  # no byte token: the 1-character token (ASCII only), else <unk>
                tid = self._to_id.get(chr(b), self._unk_id) if b < 0x80 else self._unk_id
            table.append(tid)
        return table

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        if self._add_space_prefix and after_special:
            text = " " + text
        if self._fast is not None:
            return self._fast.encode(text.replace(" ", SPACE))
        return spm_tokenize(text.replace(" ", SPACE), self._to_id, self._scores, self._byte_ids)

    def _normal_piece(self, tid: int) -> bytes:
        return self._tokens[tid].replace(SPACE, " ").encode("utf-8")


def spm_tokenize(
    text: str, to_id: dict[str, int], scores: list[float], byte_ids: list[int | None]
) -> list[int]:
    """llama.cpp's SPM bigram merge over the characters of text (already ▁-escaped)."""
    n = len(text)
    if n == 0:
        return []
    syms = list(text)  # symbol text; "" once merged into its left neighbour
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

    def try_add(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = syms[left] + syms[right]
        tid = to_id.get(merged)
        if tid is not None:
            heapq.heappush(heap, (-scores[tid], left, right, len(merged)))

    for i in range(1, n):
        try_add(i - 1, i)

    while heap:
        _, left, right, size = heapq.heappop(heap)
        lsym, rsym = syms[left], syms[right]
        # stale entry: one side was merged away or grew since this pair was queued
        if not lsym or not rsym or len(lsym) + len(rsym) != size:
            continue
        syms[left] = lsym + rsym
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        tid = to_id.get(syms[i])
        if tid is not None:
            out.append(tid)
        else:  # not a token: its bytes as byte tokens (resegment's fallback)
            out.extend(t for t in (byte_ids[b] for b in syms[i].encode("utf-8")) if t is not None)
        i = nxt[i]
    return out
