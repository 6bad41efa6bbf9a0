"""The text and chunks of `localllm perplexity`, as llama.cpp's tools/perplexity cuts them.

Chunking (llama.cpp `perplexity()`):
- the whole text is tokenized once, BOS first when the vocabulary's add_bos says so, special tokens
  not parsed;
- it is cut into non-overlapping chunks of `ctx` tokens (a partial last chunk is dropped); the first
  token of every chunk is *replaced* by BOS when add_bos (llama.cpp overwrites, it does not insert);
- each chunk runs in one forward pass on a fresh KV cache (positions 0 .. ctx-1);
- only the second half is scored: logits at positions first = ctx//2 .. ctx-2 predict the tokens at
  first+1 .. ctx-1, i.e. ctx - 1 - ctx//2 predictions per chunk, each with at least ctx/2 tokens of
  context.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.errors import LocalLLMError
from localllm.load import LoadedModel
from localllm.tokenizer import Tokenizer
from localllm.user_text import read_utf8_file

DEFAULT_CTX = 512  # llama.cpp's perplexity default


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a file; one error line naming the file (and the byte offset where the text is
    not UTF-8) otherwise (user_text's policy for files)."""
    return read_utf8_file(path, "text file")


def text_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The whole text's ids as llama.cpp's perplexity tokenizes it: BOS per add_bos, no special parsing."""
    return tokenizer.encode(text, add_bos=tokenizer.add_bos, parse_special=False)


def scored_per_chunk(ctx: int) -> int:
    return ctx - 1 - ctx // 2


@dataclass(frozen=True)
class Chunks:
    ids: torch.Tensor  # (n_chunks, ctx) int64, first token of each chunk replaced by BOS when add_bos
    text_tokens: int  # tokens in the whole text

    @property
    def ctx(self) -> int:
        return self.ids.shape[1]

    @property
    def n_chunks(self) -> int:
        return self.ids.shape[0]

    @property
    def first(self) -> int:
        """First scored logit position (it predicts the token at first + 1)."""
        return self.ctx // 2

    @property
    def per_chunk(self) -> int:
        return scored_per_chunk(self.ctx)

    def targets(self, rows: slice = slice(None)) -> torch.Tensor:
        """The predicted ids of the scored positions of chunks `rows`, flattened chunk after chunk."""
        return self.ids[rows, self.first + 1 :].reshape(-1)

    def fingerprints(self) -> list[str]:
        return [chunk_fingerprint(row) for row in self.ids]


def chunk_fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()


def check_chunking(ctx: int, max_chunks: int | None = None, batch: int = 1) -> None:
    """perplexity's --ctx, --chunks and --batch, before any model loads."""
    if ctx < 3:
        raise LocalLLMError(f"--ctx must be at least 3 (the second half of each chunk is scored), got {ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise LocalLLMError(f"--chunks must be at least 1, got {max_chunks}")
    if batch < 1:
        raise LocalLLMError(f"--batch must be at least 1, got {batch}")


def make_chunks(tokens: list[int], ctx: int, bos_id: int | None = None, max_chunks: int | None = None) -> Chunks:
    """Non-overlapping chunks of ctx tokens; bos_id (when the vocabulary adds BOS) replaces each first token."""
    check_chunking(ctx, max_chunks)
    n = len(tokens) // ctx
    if n == 0:
        raise LocalLLMError(
            f"the text is too short: it has {len(tokens)} tokens, one chunk of --ctx {ctx} needs {ctx}"
        )
    if max_chunks is not None:
        n = min(n, max_chunks)
    ids = torch.tensor(tokens[: n * ctx], dtype=torch.long).view(n, ctx)
    if bos_id is not None:
        ids[:, 0] = bos_id
    return Chunks(ids, len(tokens))


def chunks_for(lm: LoadedModel, text: str, ctx: int = DEFAULT_CTX, max_chunks: int | None = None) -> Chunks:
    if ctx > lm.config.context_length:
        raise LocalLLMError(f"--ctx {ctx} is larger than the model's context ({lm.config.context_length} tokens)")
    tok = lm.tokenizer
    return make_chunks(text_tokens(tok, text), ctx, tok.bos_id if tok.add_bos else None, max_chunks)
