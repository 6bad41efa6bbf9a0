"""Small vocabularies with a chat template, for the chat-template tests: byte-level BPEs trained here with
the Llama 3 / Qwen families' special tokens and pre-tokenizer regexes (the real 128k/150k-token files
take tens of seconds to read), written as vocab-only GGUF files or wrapped as transformers' tokenizers;
the real llama-spm vocabulary with a template; and the comparison of our prompt text with transformers'.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import gguf
import pytest

from chat_data import CONVERSATIONS
from localllm.chat import chat_prompt
from localllm.errors import LocalLLMError

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json (llama.cpp's llama-bpe / qwen2).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [m["content"] for conv in CONVERSATIONS.values() for m in conv] * 3 + [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time, a dragon guarded a hoard of gold in the mountains.",
    "system user assistant ipython Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "You are a helpful assistant. You are Qwen, created by Alibaba Cloud.",
] * 3


@lru_cache(maxsize=None)
def trained_bpe(specials: tuple[str, ...], split: str):
    """A byte-level BPE with the family's special tokens (ids 0..) and pre-tokenizer, as tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_bpe_gguf(path: Path, specials, split: str, pre: str, bos: str, eos: str, add_bos: bool,
                   template: str) -> Path:
    """A vocab-only GGUF as convert_hf_to_gguf.py writes one for that tokenizer.json."""
    spec = json.loads(trained_bpe(tuple(specials), split).to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[bos])
    w.add_eos_token_id(vocab[eos])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(template)
    return _finish(w, path)


def write_spm_gguf(path: Path, meta: dict, template: str) -> Path:
    """The real llama-spm vocabulary with a chat template."""
    k = "tokenizer.ggml."
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta[k + "tokens"])
    w.add_token_scores(meta[k + "scores"])
    w.add_token_types(meta[k + "token_type"])
    w.add_bos_token_id(meta[k + "bos_token_id"])
    w.add_eos_token_id(meta[k + "eos_token_id"])
    w.add_unk_token_id(meta[k + "unknown_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(template)
    return _finish(w, path)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_fast(specials, split: str, bos: str | None, eos: str, template: str):
    """transformers' tokenizer over the same trained vocabulary, with the same template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=trained_bpe(tuple(specials), split), bos_token=bos,
                                   eos_token=eos, chat_template=template)


def ours(tok, messages, template=None) -> str:
    """Our prompt text, through the chat session's own path (BOS/EOS texts from the vocabulary)."""
    return chat_prompt(tok, template or tok.chat_template, messages)[0]


def theirs(hf, messages, template) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)


def assert_same(tok, hf, template, conversations=CONVERSATIONS):
    """Equal text for every conversation; where transformers' template raises, ours must too."""
    for name, messages in conversations.items():
        try:
            expected = theirs(hf, messages, template)
        except Exception as e:  # jinja2's TemplateError: the template rejects this conversation
            with pytest.raises(LocalLLMError, match="chat template error"):
                ours(tok, messages, template)
            assert "alternate" in str(e) or "roles" in str(e), f"{name}: {e}"
            continue
        assert ours(tok, messages, template) == expected, name
