"""Generation as a generator of token ids, plus text streaming with stop strings.

prefill() runs the whole prompt in one forward pass; decode_one() runs one token. Both write the
KV cache passed in. `generate` yields ids until an end-of-turn id, the token limit or the context end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .cache import KVCache
from . import options
from .errors import LocalLLMError
from .model import Transformer
from .nonfinite import check_logits
from .sampling import Sampler, is_plain_greedy
from .tokenizer import StreamDecoder, Tokenizer


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, ids: list[int], start: int = 0) -> torch.Tensor:
    """Run ids at positions [start, start+len) in one pass -> logits of the last position (V,).

    On CUDA a prompt shape seen before replays a captured graph (cuda_prefill.py)."""
    return prefill_rows(model, cache, [ids], start)[0]


def prefill_rows(model: Transformer, cache: KVCache, rows: list[list[int]], start: int = 0) -> torch.Tensor:
    """One prompt per sequence of the cache (equal lengths) at positions [start, start+len) in one pass
    -> logits of each last position (B, V)."""
    device = model.token_embd.weight.device
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    if device.type == "cuda":
        from .cuda_prefill import prefill_graph_for

        return prefill_graph_for(model, cache).run(tokens, start)[:, -1]
    return model(tokens, cache, start, last_only=True)[:, -1]


@torch.inference_mode()
def graph_decoding(cache: KVCache) -> bool:
    """Decode steps into this cache replay CUDA graphs (cuda_decode.py): batch 1 on CUDA."""
    return cache.k.device.type == "cuda" and cache.k.shape[1] == 1


def decode_one(model: Transformer, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """token: 0-d id tensor at position cache.length of a batch-1 cache -> logits (V,) (decode_rows)."""
    return decode_rows(model, cache, token.view(1))[0]


def decode_rows(model: Transformer, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B,): one id per sequence of the cache, all at position cache.length -> logits (B, V).

    On CUDA the step is a replayed CUDA graph of the same kernels as batch 1 (cuda_decode.py; the
    products read each weight once for all B rows); its logits buffer is overwritten by the next step."""
    b = cache.k.shape[1]
    if cache.k.device.type == "cuda":
        from .cuda_decode import decoder_for  # Triton is imported only where it runs

        return decoder_for(model, cache).step(tokens).view(b, -1)
    return model(tokens.view(b, 1), cache, cache.length)[:, -1]


def greedy_rows(model: Transformer, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B,) as decode_rows takes them -> the argmax ids (B,) of their logits. On CUDA the argmax
    is the graph's last kernel and the ids stay the decoder's input buffer (overwritten by the next
    step; passed back, they are not copied): one launch a token."""
    if cache.k.device.type == "cuda":
        from .cuda_decode import decoder_for

        return decoder_for(model, cache, greedy=True).step_greedy(tokens)
    return decode_rows(model, cache, tokens).argmax(-1)


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
    model: Transformer,
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
    device = model.token_embd.weight.device
    stop = set(stop_ids)
    history = torch.tensor(prompt, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt[reuse:], reuse)
    check_logits(model, logits)
    budget, by_context = token_budget(max_tokens, len(prompt), cache.capacity)
    greedy = is_plain_greedy(sampler)  # then the decode step picks the next id itself (greedy_rows)
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
            token = greedy_rows(model, cache, token.view(1))[0] if greedy else \
                sampler(decode_one(model, cache, token), history)
        stats.generate_seconds = time.perf_counter() - t0
    else:
        stats.context_full = cache.capacity if by_context else 0


def stream_text(tok: Tokenizer, ids: Iterable[int], stop: tuple[str, ...] = ()) -> Iterator[str]:
    """Turn ids into text pieces, ending before the first stop string (which is not emitted).

    Text that might be the start of a stop string is held back until it is known not to be one.
    """
    stop = tuple(s for s in stop if s)  # "" would match at once and end every stream before its first piece
    dec = StreamDecoder(tok)
    pending = ""
    hold = max((len(s) for s in stop), default=0)
    for tid in ids:
        pending += dec.push(tid)
        cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            if cut:
                yield pending[:cut]
            return
        safe = len(pending) - (hold - 1) if hold else len(pending)
        if safe > 0:
            yield pending[:safe]
            pending = pending[safe:]
    pending += dec.flush()
    if pending:
        cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
        yield pending[:cut] if cut >= 0 else pending
