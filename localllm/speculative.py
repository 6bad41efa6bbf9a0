"""Speculative decoding: a drafter proposes K tokens, the target scores them all in one forward pass,
and rejection sampling keeps a prefix of them plus one token drawn by the target.

Exactness (Leviathan et al. 2023, Chen et al. 2023): p_i is the target's and q_i the draft's
distribution at drafted position i, each processed by the same sampler chain (sampling.Sampler.probs).
Drafted id d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
replacement is drawn from max(0, p_i - q_i), normalised; when all K are kept, one more is drawn from
p_{K+1}. Every emitted id then follows the target's distribution, whatever the draft. Greedy is the
case of one-hot p and q: the output is plain greedy decoding's. Prompt lookup's q is one-hot at its ids.

The first id is drawn from the prompt's prefill logits, as plain decoding draws it. Then, with seq the
prompt plus the emitted ids (N of them), a round starts with the target's cache holding seq[:N-1];
the verify pass writes positions N-1 .. N-1+K; after m kept drafts the rollback is cache.length =
N + m (stale rows are overwritten later). The drafter keeps its own cache the same way.

The verify pass is the Runtime's (on CUDA a captured graph of the decode step's kernels run for K+1
tokens, backends/cuda_graph.py, whose rows are computed exactly as plain decode steps compute them,
so greedy ids equal plain decoding's on the GPU too; K is then at most Runtime.most_drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

from .cache import KVCache
from .generate import Stats, check_prompt, decode_one, prefill, token_budget
from .nonfinite import check_logits
from .runtime import Runtime
from .sampling import Sampler, draw, is_plain_greedy
from .settings import DEFAULT_DRAFT, DraftSettings


class Drafter(Protocol):
    cost: float  # one drafted token's cost relative to a target pass (for the adaptive K)

    def start(self, capacity: int, valid: int) -> None:
        """Before a generation: positions up to capacity; only seq[:valid] is known to be kept."""

    def propose(self, seq: list[int], history: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k ids to follow seq, and the draft's distributions they were drawn from (n, V)
        (None: one-hot at the ids). history: seq as a tensor on the target's device."""

    def rollback(self, valid: int) -> None:
        """Only seq[:valid] is still the sequence: cache rows after it are stale."""


@dataclass
class SpecStats(Stats):
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_tps: float = 0.0  # plain decoding of the same target measured in the same run (0: not measured)

    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def tokens_per_pass(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    def speedup(self) -> float:
        return self.generate_tps() / self.plain_tps if self.plain_tps else 0.0


# ---- the target's side


@torch.inference_mode()
def feed(rt: Runtime, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """Run ids at positions cache.length.. -> logits of the last (V,). Up to two ids go one at a time
    through decode_one (a CUDA graph; on the CPU the C++ one-token step): cheaper than a small
    multi-row pass. More (a prompt) are one prefill."""
    if len(ids) > 2:
        return prefill(rt, cache, ids, cache.length)
    for t in ids:
        logits = decode_one(rt, cache, torch.tensor(t, device=rt.device))
    return logits


@torch.inference_mode()
def verify(rt: Runtime, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """The target's pass over the last emitted id and the drafts -> logits (T, V): one id is a plain
    step, more are one pass reading the weights once for all of them (Runtime.verify)."""
    if len(ids) == 1:
        return feed(rt, cache, ids)[None]
    return rt.verify(cache, ids)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) (V,), unnormalised (draw() takes weights). It cannot be all zero after a rejection
    (it sums to the total variation between p and q); should rounding make it so, p itself."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum() > 0, r, p)


def accept(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """p: (n+1, V) target distributions, q: (n, V) draft distributions of drafted (n,) ids
    -> (m, the id drawn after the m kept drafts as a 0-d tensor)."""
    n = drafted.numel()
    rows = torch.arange(n, device=p.device)
    u = torch.rand(n, generator=generator, device=p.device)
    # keep d_i with probability min(1, p/q): u * q < p avoids dividing (q(d_i) > 0: the draft drew d_i)
    kept = u * q[rows, drafted] < p[rows, drafted]
    m = int(kept.int().cumprod(0).sum())  # the one host sync of the verdict
    weights = residual(p[m], q[m]) if m < n else p[n]
    return m, draw(weights, generator)


def verdict(logits: torch.Tensor, drafted: list[int], q: torch.Tensor | None, sampler: Sampler,
            history: torch.Tensor, greedy: bool) -> tuple[int, int]:
    """The target's judgement of n drafts: logits (n+1, V) of its pass over the last emitted id and the
    drafts, q (n, V) the draft's distributions (None: one-hot at the drafts), history the sequence so far
    (N,) -> (m drafts kept, the target's id after them). Also `serve`'s (engine_spec.py)."""
    n = len(drafted)
    if greedy:  # p_i one-hot at argmax: keep drafts while they are the argmax (one sync)
        best = logits.argmax(-1).tolist()
        m = next((i for i in range(n) if drafted[i] != best[i]), n)
        return m, best[m]
    N = history.numel()
    d = torch.tensor(drafted, dtype=torch.long, device=history.device)
    full = torch.cat((history, d))
    # p_i conditions on seq + d_<i: its history (the repeat penalty's) is full[:N + i]
    p = torch.stack([sampler.probs(logits[i], full[: N + i]) for i in range(n + 1)])
    if q is None:
        q = torch.nn.functional.one_hot(d, p.shape[-1]).float()
    m, drawn = accept(p, q, d, sampler.generator)
    return m, int(drawn)


@torch.inference_mode()
def speculative_round(
    rt: Runtime, cache: KVCache, sampler: Sampler, drafter: Drafter, seq: list[int], history: torch.Tensor, k: int
) -> tuple[list[int], int]:
    """One round: draft up to k ids after seq, verify them in one target pass, keep a prefix, draw one
    more. The target's cache holds seq[:-1] before, seq[:-1] + the kept drafts after.
    -> (the new ids: kept drafts then the drawn one; the number drafted)."""
    N = len(seq)
    assert cache.length == N - 1, f"target cache holds {cache.length} ids, expected {N - 1}"
    drafted, q = drafter.propose(seq, history, k)
    n = len(drafted)
    logits = verify(rt, cache, seq[-1:] + drafted)
    m, token = verdict(logits, drafted, q, sampler, history, is_plain_greedy(sampler))
    cache.length = N + m
    drafter.rollback(N + m)
    return drafted[:m] + [token], n


# ---- how many to draft


@dataclass
class AdaptiveK:
    """K from the recent per-token acceptance rate a: the K maximising the expected tokens per cost,
    (1 - a^(K+1)) / ((1 - a)(1 + c K)). `fixed` (--draft-max) overrides it."""

    cost: float
    most: int
    memory: float
    kept: float  # running sums, decayed each pass: drafts kept, drafts tested (kept + the first rejected)
    tested: float = 1.0
    fixed: int | None = None

    def k(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return best_k(self.kept / self.tested, self.cost, self.most)

    def update(self, drafted: int, kept: int) -> None:
        if drafted == 0:  # nothing proposed: no evidence
            return
        self.kept = self.memory * self.kept + kept
        self.tested = self.memory * self.tested + kept + (kept < drafted)


def best_k(a: float, cost: float, most: int) -> int:
    def tokens_per_cost(k: int) -> float:
        expected = k + 1 if a >= 1 - 1e-9 else (1 - a ** (k + 1)) / (1 - a)
        return expected / (1 + cost * k)

    return max(range(1, most + 1), key=tokens_per_cost)


def adaptive_k(drafter: Drafter, ds: DraftSettings) -> AdaptiveK:
    return AdaptiveK(drafter.cost, ds.most_k, ds.acceptance_memory, ds.start_acceptance, fixed=ds.max_draft)


# ---- generation


@torch.inference_mode()
def time_plain_step(rt: Runtime, cache: KVCache, token: int, steps: int) -> float:
    """Seconds of one plain decode step of token at position cache.length (after one warm-up step:
    CUDA graph capture). The same row is rewritten each time; cache.length is restored."""
    start, t = cache.length, torch.tensor(token, device=rt.device)
    decode_one(rt, cache, t)
    cache.length = start
    rt.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        decode_one(rt, cache, t).argmax().item()  # a plain step ends in a host sync too
        cache.length = start
    return (time.perf_counter() - t0) / steps


def generate_speculative(
    rt: Runtime,
    cache: KVCache,
    prompt: list[int],
    sampler: Sampler,
    drafter: Drafter,
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    stats: SpecStats | None = None,
    reuse: int = 0,
    settings: DraftSettings = DEFAULT_DRAFT,
    plain_steps: int = 0,
) -> Iterator[int]:
    """generate()'s contract (ids after prompt, stop ids not yielded, `reuse` prompt ids already
    cached), with several ids per target pass. plain_steps > 0 times that many plain decode steps
    first, for stats.plain_tps. On return both caches hold at most prompt + the yielded ids."""
    check_prompt(len(prompt), cache, reuse)
    stats = stats if stats is not None else SpecStats()
    device = rt.device
    stop = set(stop_ids)
    seq = list(prompt)
    history = torch.tensor(prompt, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    drafter.start(cache.capacity, reuse)
    budget, by_context = token_budget(max_tokens, len(prompt), cache.capacity)
    # the first id as plain decoding draws it: from the prompt's prefill logits
    logits = prefill(rt, cache, prompt[reuse:], reuse)
    check_logits(rt.model, logits)
    token = sampler(logits, history)
    first = int(token)
    stats.prompt_tokens, stats.prompt_seconds = len(prompt) - reuse, time.perf_counter() - t0
    if budget < 1 or first in stop:
        return
    if plain_steps:  # at the first id's position, rolled back
        stats.plain_tps = 1 / time_plain_step(rt, cache, first, plain_steps)
    schedule = adaptive_k(drafter, settings)
    limit = rt.most_drafts(cache)
    t0 = time.perf_counter()
    seq.append(first)
    history = torch.cat((history, token.view(1)))
    try:
        stats.generated_tokens, stats.generate_seconds = 1, time.perf_counter() - t0
        yield first
        while len(seq) - len(prompt) < budget:
            # the round emits up to k + 1 ids; none past the budget (nor past the cache's end)
            k = min(schedule.k(), budget - (len(seq) - len(prompt)) - 1, limit or budget)
            new, n = speculative_round(rt, cache, sampler, drafter, seq, history, k)
            schedule.update(n, len(new) - 1)
            stats.target_passes += 1
            stats.drafted += n
            stats.accepted += len(new) - 1
            history = torch.cat((history, torch.tensor(new, device=device)))
            for tid in new:
                if tid in stop:
                    return
                if len(seq) - len(prompt) >= budget:
                    break
                seq.append(tid)
                stats.generated_tokens += 1
                stats.generate_seconds = time.perf_counter() - t0
                yield tid
        stats.context_full = cache.capacity if by_context else 0
    finally:
        # rows past the yielded ids (a stop id, drafts after it, a consumer that stopped) are not kept
        cache.length = min(cache.length, len(seq))
        drafter.rollback(len(seq))


def describe_speculative(stats: SpecStats) -> str:
    line = (f"speculative: {stats.accepted}/{stats.drafted} drafts accepted ({stats.acceptance():.1%}), "
            f"{stats.tokens_per_pass():.2f} tokens per target pass")
    if stats.plain_tps:
        line += f", {stats.speedup():.2f}x plain decoding ({stats.plain_tps:.1f} tokens/s measured in this run)"
    return line
