"""Generation as a generator of token ids, plus text streaming with stop strings.

prefill() runs the whole prompt in one pass; decode_one() runs one token; both go through the model's
Runtime (its backend's fastest path) and write the KV cache passed in. `generate` yields ids until an end-of-turn id, the token limit or the context end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .cache import KVCache
from . import options
from .errors import LocalLLMError
from .nonfinite import check_logits
from .runtime import Runtime
from .sampling import Sampler, is_plain_greedy
from .stop_text import StopText
from .tokenizer import Tokenizer


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    context_full: int = 0  # the context's size when generation stopped because it was full (0: it did not)

    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


@torch.inference_mode()
def prefill(rt: Runtime, cache: KVCache, ids: list[int], start: int = 0) -> torch.Tensor:
    """Run ids at positions [start, start+len) in one pass -> logits of the last position (V,)."""
    return rt.prefill(cache, [ids], start)[0]


@torch.inference_mode()
def decode_one(rt: Runtime, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """token: 0-d id tensor at position cache.length of a batch-1 cache -> logits (V,) (Runtime.decode)."""
    return rt.decode(cache, token.view(1))[0]


@torch.inference_mode()
def greedy_one(rt: Runtime, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """decode_one's argmax as a 0-d tensor (Runtime.greedy_step: on CUDA inside the step's graph)."""
    return rt.greedy_step(cache, token.view(1))[0]


def check_generation(max_tokens: int, ctx: int) -> None:
    """-n and --ctx, before any model loads. -n -1 is llama.cpp's "until the end of text or the context
    is full"; 0 would print nothing. A context needs the prompt's first token and one generated."""
    if not (max_tokens == -1 or max_tokens >= 1):
        raise LocalLLMError(f"-n/--max-tokens must be at least 1, or -1 (until the end of text or the context "
                            f"is full), got {max_tokens}")
    options.at_least("--ctx", ctx, 2, "(the prompt's first token and one generated)")


def token_budget(max_tokens: int, prompt_len: int, capacity: int) -> tuple[int, bool]:
    """(ids to generate after a prompt of prompt_len in a cache of capacity, whether the context and not
    max_tokens (-1: no limit) sets it)."""
    room = capacity - prompt_len
    return (room, True) if max_tokens < 0 or max_tokens > room else (max_tokens, False)


def check_fits(prompt_len: int, cache: KVCache) -> None:
    if prompt_len == 0:
        raise LocalLLMError("the prompt is empty (no tokens to start from)")
    if prompt_len >= cache.capacity:
        raise LocalLLMError(
            f"prompt is {prompt_len} token{'s' if prompt_len != 1 else ''} but the context holds {cache.capacity}"
            f" (one more is needed for the reply): shorten it or raise --ctx"
        )


def check_prompt(prompt_len: int, cache: KVCache, reuse: int) -> None:
    """The prompt fits, and `reuse` (ids already cached) leaves at least one id to run."""
    check_fits(prompt_len, cache)
    if not 0 <= reuse < prompt_len:
        raise ValueError(f"reuse={reuse} must leave at least one of {prompt_len} prompt tokens to prefill")


def generate(
    rt: Runtime,
    cache: KVCache,
    prompt: list[int],
    sampler: Sampler,
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    stats: Stats | None = None,
    reuse: int = 0,
) -> Iterator[int]:
    """Yield generated ids after `prompt`. Stop ids are not yielded. max_tokens -1: until a stop id or
    the context is full (stats.context_full says when the context ended it).

    The first `reuse` prompt tokens are already in the cache (a chat's earlier turns): only
    prompt[reuse:] is prefilled. On return cache.length counts the prompt plus the fed generated ids.
    """
    check_prompt(len(prompt), cache, reuse)
    stats = stats if stats is not None else Stats()
    stop = set(stop_ids)
    history = torch.tensor(prompt, dtype=torch.long, device=rt.device)
    t0 = time.perf_counter()
    logits = prefill(rt, cache, prompt[reuse:], reuse)
    check_logits(rt.model, logits)
    budget, by_context = token_budget(max_tokens, len(prompt), cache.capacity)
    greedy = is_plain_greedy(sampler)  # then the decode step picks the next id itself (greedy_one)
    token = sampler(logits, history)
    for i in range(budget):
        tid = int(token)  # the one host sync per token: we must know the id to stream it
        if i == 0:
            stats.prompt_tokens, stats.prompt_seconds = len(prompt) - reuse, time.perf_counter() - t0
            t0 = time.perf_counter()
        if tid in stop:
            break
        yield tid
        stats.generated_tokens += 1
        history = torch.cat((history, token.view(1)))
        if i + 1 < budget:
            token = greedy_one(rt, cache, token) if greedy else sampler(decode_one(rt, cache, token), history)
        stats.generate_seconds = time.perf_counter() - t0
    else:
        stats.context_full = cache.capacity if by_context else 0


def stream_text(tok: Tokenizer, ids: Iterable[int], stop: tuple[str, ...] = ()) -> Iterator[str]:
    """Turn ids into text pieces, ending before the first stop string (which is not emitted).

    Text that might be the start of a stop string is held back until it is known not to be one
    (stop_text.StopText).
    """
    text = StopText(tok, stop)
    for tid in ids:
        piece = text.push(tid)
        if piece:
            yield piece
        if text.stopped:
            return
    piece = text.flush()
    if piece:
        yield piece
