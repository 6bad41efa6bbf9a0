"""Gemma 4's BPE over raw UTF-8 for GGUF `tokenizer.ggml.model == "gemma4"`, run by the `tokenizers` library.

llama.cpp (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GEMMA4) and the model's own HF tokenizer
(transformers' GemmaTokenizer: BPE with byte fallback, normalizer " " -> "▁") agree on:
- spaces become "▁" (U+2581); no space is put in front of the text;
- merges ("a b", by rank: lowest first, ties leftmost) run on the UTF-8 characters themselves, not on
  GPT-2's byte alphabet; llama.cpp cuts the text into runs of newlines and runs of other characters
  first (its merge loop needs it; the vocabulary has no merge across a newline);
- a character left without a token is written as its UTF-8 bytes in <0xNN> byte tokens (HF's byte
  fallback; llama.cpp would drop it, we follow the model's tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from .base import Tokenizer
from .bpe import library_encode, library_errors, split_merge

SPACE = "\u2581"


def build_gemma4_model(tokens: Sequence[str], merges: Sequence[str]) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    pairs = []
    for merge in merges:
        pair = split_merge(merge)
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    with library_errors("bad BPE vocabulary (tokenizer.ggml.tokens / merges)"):
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=True)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


class Gemma4Tokenizer(Tokenizer):
    kind = "bpe"
    pre = "gemma4"

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None, merges: Sequence[str],
                 **kwargs) -> None:
        super().__init__(tokens, token_types, **kwargs)
        self._hf = build_gemma4_model(self._tokens, merges)

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        return library_encode(self._hf, text.replace(" ", SPACE))

    def _normal_piece(self, tid: int) -> bytes:
        return self._tokens[tid].replace(SPACE, " ").encode("utf-8")
