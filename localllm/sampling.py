"""Samplers as composable pure functions of (logits, history); no GPU->CPU sync until the caller reads the id.

logits: (V,) fp32 for one position. Each transform returns new logits with removed tokens at -inf.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import options
from .settings import SamplingSettings

Transform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits (V,), history (N,)) -> logits


def repeat_penalty(penalty: float, last_n: int) -> Transform:
    """llama.cpp's rule: each token seen in the last N (N = -1: all of them) has its logit divided (if >0)
    or multiplied by penalty."""

    def apply(logits, history):
        recent = history if last_n < 0 else history[-last_n:] if last_n > 0 else history[:0]
        if recent.numel() == 0:
            return logits
        seen = logits[recent]
        logits = logits.clone()
        logits[recent] = torch.where(seen > 0, seen / penalty, seen * penalty)
        return logits

    return apply


def temperature(t: float) -> Transform:
    return lambda logits, history: logits / t


def top_k(k: int) -> Transform:
    """Keep exactly k tokens, as llama.cpp does: on a tie at the k-th logit, the cut goes through the tie
    (a `logits < kth` threshold would keep every tied token)."""

    def apply(logits, history):
        keep = torch.topk(logits, min(k, logits.numel())).indices
        return torch.full_like(logits, float("-inf")).scatter(0, keep, logits[keep])

    return apply


def top_p(p: float) -> Transform:
    """Keep the smallest set of most likely tokens whose probability sums to at least p."""

    def apply(logits, history):
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # A token is dropped when the tokens before it already reach p. The first one is always kept,
        # explicitly: for p <= 0 "nothing before it" (0) already reaches p and every token would go.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))

    return apply


def min_p(p: float) -> Transform:
    """Drop tokens whose probability is below p times the top token's."""

    def apply(logits, history):
        probs = logits.softmax(-1)
        return logits.masked_fill(probs < p * probs.max(), float("-inf"))

    return apply


def make_transforms(s: SamplingSettings) -> list[Transform]:
    """The chain in llama.cpp's default order: penalties, top-k, top-p, min-p, then temperature."""
    chain: list[Transform] = []
    if s.repeat_penalty != 1.0:
        chain.append(repeat_penalty(s.repeat_penalty, s.repeat_last_n))
    if s.temperature <= 0:
        return chain
    if s.top_k > 0:
        chain.append(top_k(s.top_k))
    if s.top_p < 1.0:
        chain.append(top_p(s.top_p))
    if s.min_p > 0:
        chain.append(min_p(s.min_p))
    chain.append(temperature(s.temperature))
    return chain


def check_settings(s: SamplingSettings) -> None:
    """Every value in its range, before any model loads: out of range, a sampler silently does something
    else (a negative top-k or temperature acts as 0, a top-p above 1 as 1) or breaks the logits (a
    penalty of 0 or infinity, a NaN or infinite temperature: sampling from an all -inf or NaN row
    yields token 0 forever)."""
    options.at_least("--temp", s.temperature, 0, "(0: greedy)")
    options.at_least("--top-k", s.top_k, 0, "(0: off)")
    options.between("--top-p", s.top_p, 0, 1)
    options.between("--min-p", s.min_p, 0, 1)
    options.above("--repeat-penalty", s.repeat_penalty, 0)
    options.at_least("--repeat-last-n", s.repeat_last_n, -1, "(-1: the whole context, 0: off)")
    options.seed(s.seed)


class Sampler:
    """Applies the transforms, then picks argmax (temperature 0) or samples with a seeded generator."""

    def __init__(self, settings: SamplingSettings, device: str | torch.device = "cpu"):
        check_settings(settings)
        self.settings = settings
        self.transforms = make_transforms(settings)
        self.generator = torch.Generator(device=device)
        if settings.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(settings.seed)

    def process(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The logits after every transform of the chain (removed tokens at -inf)."""
        for t in self.transforms:
            logits = t(logits, history)
        return logits

    def probs(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The distribution this sampler draws from (one-hot when greedy): speculative decoding
        compares the target's and the draft's, each processed by the same chain."""
        logits = self.process(logits, history)
        if self.settings.temperature <= 0:
            return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
        return logits.softmax(-1)

    def __call__(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """-> a 0-d int64 tensor on the logits' device."""
        logits = self.process(logits, history)
        if self.settings.temperature <= 0:
            return logits.argmax()
        return draw(logits.softmax(-1), self.generator)


def is_plain_greedy(sampler: Sampler) -> bool:
    """The sampler picks argmax(logits) itself (temperature 0, no transform): speculative decoding
    compares ids then, not distributions."""
    return sampler.settings.temperature <= 0 and not sampler.transforms


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id with probability proportional to weights (V,) >= 0, not necessarily normalised, without a
    host sync: exponential race, the argmax of w / E with E ~ Exp(1)."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / race).argmax()
