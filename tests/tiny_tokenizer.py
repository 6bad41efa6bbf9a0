"""The tiny models' tokenizer: a small byte-level BPE trained here, saved as tokenizer.json
(tiny_hf.py) and as GGUF metadata (tiny_gguf.py).
"""

from __future__ import annotations

import json
from functools import cache

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
CORPUS = """Once upon a time, there was a little girl named Emma who loved to play in the sun.
She would often go to the beach and play with her friends. One day, she decided to go to the park.
The quick brown fox jumps over the lazy dog. Hello world! 1234567890 tokens, weights and caches.
A model reads text as numbers; the tokenizer cuts words into pieces and the pieces into bytes.
Llama, Mistral, Qwen: attention heads, key and value heads, rotary position embeddings, norms."""


@cache
def tokenizer_json(vocab_size: int = 384) -> str:
    """A byte-level BPE (GPT-2 style) trained on a few lines: 256 byte tokens, merges, 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return tok.to_str()


def vocab_and_merges() -> tuple[list[str], list[str]]:
    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def vocab_size() -> int:
    return len(vocab_and_merges()[0])
