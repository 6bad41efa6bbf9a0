"""Tokenizers: GGUF vocabularies (SentencePiece-BPE "llama", byte-level BPE "gpt2", Gemma 4's
SentencePiece-style BPE "gemma4") and HF model folders.

    tok = load_gguf_tokenizer(open_gguf(path).metadata)
    ids = tok.encode("Hello", add_bos=tok.add_bos)
    text = tok.decode(ids)

Defaults and special-token handling follow llama.cpp's llama_vocab::impl::load (src/llama-vocab.cpp).
"""

from __future__ import annotations

from typing import Any

from ..errors import LocalLLMError
from .base import StreamDecoder, Tokenizer
from .bpe import BpeTokenizer
from .hf import load_hf_tokenizer
from .pretok import PRE_TOKENIZERS
from .meta import optional_bool, optional_int, optional_text, typed_list
from .spm import SpmTokenizer

__all__ = ["StreamDecoder", "Tokenizer", "load_gguf_tokenizer", "load_hf_tokenizer"]

KEY = "tokenizer.ggml."


def load_gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF file's tokenizer.ggml.* metadata (every value type-checked
    first: one error naming the key, never a traceback from deep inside)."""
    model = optional_text(metadata, KEY + "model")
    if model is None:
        raise LocalLLMError("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    tokens = typed_list(metadata, KEY + "tokens", "text")
    if not tokens:
        raise LocalLLMError("the GGUF has no vocabulary (tokenizer.ggml.tokens is missing)")
    # llama.cpp renames empty token texts so that every text maps back to one id
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = typed_list(metadata, KEY + "token_type", "int")
    common = dict(
        chat_template=optional_text(metadata, "tokenizer.chat_template"),
        extra_stop_ids=(optional_int(metadata, KEY + "eot_token_id"), optional_int(metadata, KEY + "eom_token_id")),
        rstrip_ids=_phi3_rstrip_ids(metadata, tokens, types),
        bos_id=optional_int(metadata, KEY + "bos_token_id", 1 if model == "llama" else None),
        eos_id=optional_int(metadata, KEY + "eos_token_id", 2 if model == "llama" else None),
    )
    if model == "llama":
        return SpmTokenizer(
            tokens, types, typed_list(metadata, KEY + "scores", "number"),
            add_space_prefix=optional_bool(metadata, KEY + "add_space_prefix", True),
            unk_id=optional_int(metadata, KEY + "unknown_token_id", 0),
            add_bos=optional_bool(metadata, KEY + "add_bos_token", True),
            **common,
        )
    if model in ("gpt2", "gemma4"):
        # llama.cpp: the "gemma4" model is BPE with the pre-tokenizer "gemma4", whatever the file says
        pre = "gemma4" if model == "gemma4" else optional_text(metadata, KEY + "pre") or "default"
        pretok = PRE_TOKENIZERS.get(pre)
        if pretok is None:
            raise LocalLLMError(f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                                f"known: {', '.join(sorted(PRE_TOKENIZERS))}")
        merges = typed_list(metadata, KEY + "merges", "text")
        if merges is None:
            raise LocalLLMError("the GGUF has a BPE vocabulary without merges (tokenizer.ggml.merges)")
        if pre in ("chatglm-bpe", "glm4"):
            common["bos_id"] = None
        add_bos = optional_bool(metadata, KEY + "add_bos_token", bool(pretok.add_bos))
        return BpeTokenizer(
            tokens, types, merges, pre_name=pre, pretok=pretok,
            add_bos=add_bos or pretok.force_add_bos,
            **common,
        )
    raise LocalLLMError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                        "supported: 'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE), "
                        "'gemma4' (SentencePiece-style BPE)")


def _phi3_rstrip_ids(metadata: dict[str, Any], tokens: list[str], types) -> list[int]:
    """llama.cpp: for Phi-3 models every special token eats the blanks after it, except
    <unk>, <s> and <|endoftext|>."""
    name = str(metadata.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name or not types:
        return []
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (2, 3, 4) and t not in keep]
