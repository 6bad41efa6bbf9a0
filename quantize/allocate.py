"""Per-tensor type choice under a size budget: the per-layer mixed precision of `--target-bpw`.

Input: for every tensor t a set of candidate types q, each with its size in bytes and a predicted loss
L(t, q) (the increase in KL-divergence of the model's output when t alone is stored as q; see
localllm/calibrate.py). Losses of different tensors are taken as additive (second-order: cross terms
of independent rounding errors vanish in expectation). We minimise sum_t L(t, q_t) subject to
sum_t bytes(t, q_t) <= budget: a multiple-choice knapsack, solved by the Lagrangian relaxation
(each tensor picks argmin L + lam * bytes; bisection on lam), then a greedy fill of the space left by
the best loss-saved-per-byte upgrades, which lands within one small step of the budget. The fill alone
misses the case where the next upgrade on the lam curve is too big for the space left (the tensor the
LP would take fractionally): so we also start from the choice just over the budget, free the bytes
that cost the least loss per byte, fill, and keep the better of the two (on random 6-tensor instances
against brute force, tests/test_mixed.py: mean loss 1.04x the optimum with the fill alone, 1.002x
with both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class Option:
    qtype: Hashable
    nbytes: int
    loss: float


def _pick(options: Sequence[Sequence[Option]], lam: float) -> list[int]:
    return [min(range(len(opts)), key=lambda i: opts[i].loss + lam * opts[i].nbytes) for opts in options]


def _size(options: Sequence[Sequence[Option]], choice: Sequence[int]) -> int:
    return sum(opts[i].nbytes for opts, i in zip(options, choice))


def _upgrade(options: Sequence[Sequence[Option]], choice: list[int], budget: int) -> list[int]:
    """Spend what is left of the budget on the upgrades that save the most loss per byte."""
    left = budget - _size(options, choice)
    while True:
        best, best_gain = None, 0.0
        for t, opts in enumerate(options):
            cur = opts[choice[t]]
            for i, o in enumerate(opts):
                extra = o.nbytes - cur.nbytes
                if 0 < extra <= left and o.loss < cur.loss:
                    gain = (cur.loss - o.loss) / extra
                    if gain > best_gain:
                        best, best_gain = (t, i), gain
        if best is None:
            return choice
        t, i = best
        left -= options[t][i].nbytes - options[t][choice[t]].nbytes
        choice[t] = i


def _downgrade(options: Sequence[Sequence[Option]], choice: list[int], budget: int) -> list[int]:
    """Free bytes until the choice fits, each step the move costing the least loss per byte it frees
    (bytes freed beyond what is still over the budget count for nothing)."""
    over = _size(options, choice) - budget
    while over > 0:
        best, best_cost = None, math.inf
        for t, opts in enumerate(options):
            cur = opts[choice[t]]
            for i, o in enumerate(opts):
                freed = cur.nbytes - o.nbytes
                if freed > 0 and (cost := (o.loss - cur.loss) / min(freed, over)) < best_cost:
                    best, best_cost = (t, i), cost
        t, i = best  # a move exists: every tensor's smallest option together fits (checked first)
        over -= options[t][choice[t]].nbytes - options[t][i].nbytes
        choice[t] = i
    return choice


def _loss(options: Sequence[Sequence[Option]], choice: Sequence[int]) -> float:
    return sum(opts[i].loss for opts, i in zip(options, choice))


def allocate(options: Sequence[Sequence[Option]], budget: int) -> list[int]:
    """Index of the chosen option per tensor, with total bytes <= budget and least total loss.

    Raises ValueError when even the smallest option of every tensor exceeds the budget.
    """
    smallest = [min(range(len(o)), key=lambda i: o[i].nbytes) for o in options]
    if _size(options, smallest) > budget:
        raise ValueError(f"the budget of {budget} bytes is below the smallest possible size {_size(options, smallest)}")
    lo, hi = 0.0, 1.0
    while _size(options, _pick(options, hi)) > budget:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        if _size(options, _pick(options, mid)) > budget:
            lo = mid
        else:
            hi = mid
    under = _upgrade(options, _pick(options, hi), budget)
    over = _upgrade(options, _downgrade(options, _pick(options, lo), budget), budget)
    return _fill(options, min(under, over, key=lambda c: _loss(options, c)), budget)


def _fill(options: Sequence[Sequence[Option]], choice: list[int], budget: int) -> list[int]:
    """Spend bytes still left on moves that do not raise the loss, largest first, so the file lands at
    the size asked for even where the least-loss plan is smaller (e.g. a type that reproduces a tensor
    exactly already costs 0): the loss stays the least found, the size comes close to the budget."""
    left = budget - _size(options, choice)
    while True:
        moves = [(o.nbytes - opts[choice[t]].nbytes, t, i) for t, opts in enumerate(options)
                 for i, o in enumerate(opts) if 0 < o.nbytes - opts[choice[t]].nbytes <= left
                 and o.loss <= opts[choice[t]].loss]
        if not moves:
            return choice
        extra, t, i = max(moves)
        left -= extra
        choice[t] = i
