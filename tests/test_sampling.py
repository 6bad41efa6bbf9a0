"""Samplers against naive references written here (plain Python over lists), llama.cpp's semantics,
and a chi-square test that the sampler's exponential-race draw follows softmax(logits)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from localllm.sampling import Sampler, min_p, repeat_penalty, temperature, top_k, top_p
from localllm.settings import SamplingSettings

NONE = torch.empty(0, dtype=torch.long)  # an empty history


def random_logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 3


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if x != float("-inf")}


def softmax_list(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def only(**kw) -> SamplingSettings:
    """Settings with every filter off except those given."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=64, seed=0)
    return SamplingSettings(**{**base, **kw})


# ---- naive references


def ref_top_k(xs: list[float], k: int) -> set[int]:
    return set(sorted(range(len(xs)), key=lambda i: -xs[i])[:k])


def ref_top_p(xs: list[float], p: float) -> set[int]:
    """The smallest prefix of the most likely tokens whose probabilities sum to at least p."""
    probs = softmax_list(xs)
    out, total = set(), 0.0
    for i in sorted(range(len(xs)), key=lambda i: -probs[i]):
        out.add(i)
        total += probs[i]
        if total >= p:
            break
    return out


def ref_min_p(xs: list[float], p: float) -> set[int]:
    probs = softmax_list(xs)
    return {i for i, q in enumerate(probs) if q >= p * max(probs)}


def ref_repeat_penalty(xs: list[float], history: list[int], penalty: float, last_n: int) -> list[float]:
    """llama.cpp: each distinct token of the last N has its logit divided (> 0) or multiplied (<= 0), once."""
    out = list(xs)
    for t in set(history[-last_n:] if last_n > 0 else []):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


# ---- filters


@pytest.mark.parametrize("k", [1, 2, 5, 17, 100, 500])
def test_top_k_keeps_exactly_k(k):
    for seed in range(5):
        x = random_logits(100, seed)
        out = top_k(k)(x, NONE)
        assert kept(out) == ref_top_k(x.tolist(), k)
        assert len(kept(out)) == min(k, 100)
        assert torch.equal(out[list(kept(out))], x[list(kept(out))])  # kept logits unchanged


def test_top_k_with_ties_keeps_exactly_k():
    x = torch.tensor([1.0, 3.0, 3.0, 3.0, 3.0, 0.0, 2.0])
    for k in (1, 2, 3, 4, 5):
        out = kept(top_k(k)(x, NONE))
        assert len(out) == k
        # The kept tokens are the largest: nothing dropped beats anything kept.
        assert min(x[list(out)]) >= max([x[i] for i in range(len(x)) if i not in out], default=-math.inf)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_top_p_keeps_smallest_prefix_reaching_p(p):
    for seed in range(10):
        x = random_logits(50, seed)
        assert kept(top_p(p)(x, NONE)) == ref_top_p(x.tolist(), p)


def test_top_p_always_keeps_the_top_token():
    x = torch.tensor([10.0, 0.0, -1.0])  # the top token alone is already past p
    assert kept(top_p(0.5)(x, NONE)) == {0}
    y = torch.tensor([0.0, 2.0, 1.0])
    for p in (0.0, -1.0, 1e-9):  # as llama.cpp: at least one token survives
        assert kept(top_p(p)(y, NONE)) == {1}
    for p in (0.0, 1e-9):  # (the Sampler rejects a top-p below 0: --top-p's range is 0 to 1)
        assert int(Sampler(only(top_p=p, seed=1))(y, NONE)) == 1


@pytest.mark.parametrize(
    "settings, option",
    [(only(min_p=1.5), "--min-p"), (only(min_p=-0.1), "--min-p"), (only(repeat_penalty=0.0), "--repeat-penalty"),
     (only(top_p=-1.0), "--top-p"), (only(top_p=2.0), "--top-p"), (only(temperature=float("nan")), "--temp"),
     (only(top_k=-5), "--top-k"), (only(seed=2**64), "--seed")],
)
def test_settings_that_would_mask_every_token_are_rejected(settings, option):
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError, match=option):
        Sampler(settings)


@pytest.mark.parametrize("p", [0.0, 0.01, 0.05, 0.2, 0.5, 1.0])
def test_min_p_threshold(p):
    for seed in range(10):
        x = random_logits(50, seed)
        assert kept(min_p(p)(x, NONE)) == ref_min_p(x.tolist(), p)


@pytest.mark.parametrize("t", [0.1, 0.5, 1.0, 1.7])
def test_temperature_scales_logits(t):
    x = random_logits(30, 3)
    assert torch.allclose(temperature(t)(x, NONE), x / t)
    probs = Sampler(only(temperature=t)).probs(x, NONE)
    expected = torch.tensor(softmax_list([v / t for v in x.tolist()]))
    assert torch.allclose(probs, expected, atol=1e-6)


def test_repeat_penalty_matches_llama_cpp():
    x = torch.tensor([2.0, -2.0, 0.5, -0.5, 3.0, 1.0, -1.0, 0.0])
    # Token 4 only appears before the last 4 tokens; token 1 twice inside them (penalised once).
    history = torch.tensor([4, 4, 1, 2, 1, 3])
    out = repeat_penalty(1.5, 4)(x, history)
    expected = ref_repeat_penalty(x.tolist(), history.tolist(), 1.5, 4)
    assert out.tolist() == pytest.approx(expected)
    assert out[4] == 3.0  # outside the window: untouched
    assert out[1] == pytest.approx(-3.0)  # negative: multiplied
    assert out[2] == pytest.approx(0.5 / 1.5)  # positive: divided
    assert torch.equal(x, torch.tensor([2.0, -2.0, 0.5, -0.5, 3.0, 1.0, -1.0, 0.0]))  # input not modified


def test_repeat_penalty_random_against_reference():
    rnd = random.Random(0)
    for seed in range(20):
        x = random_logits(40, seed)
        history = [rnd.randrange(40) for _ in range(rnd.randrange(0, 30))]
        last_n = rnd.choice([0, 1, 5, 64])
        penalty = rnd.choice([0.8, 1.1, 1.3, 2.0])
        out = repeat_penalty(penalty, last_n)(x, torch.tensor(history, dtype=torch.long))
        assert out.tolist() == pytest.approx(ref_repeat_penalty(x.tolist(), history, penalty, last_n))


def test_repeat_penalty_in_sampler_chain():
    # Greedy with a penalty: the most likely token, once penalised, loses to the runner-up.
    x = torch.tensor([3.0, 2.5, 0.0])
    s = Sampler(only(temperature=0, repeat_penalty=1.5))
    assert int(s(x, torch.tensor([0]))) == 1
    assert int(s(x, torch.tensor([2]))) == 0


# ---- the sampler


def test_greedy_is_argmax():
    s = Sampler(only(temperature=0))
    for seed in range(50):
        x = random_logits(1000, seed)
        assert int(s(x, NONE)) == int(torch.argmax(x))
    assert Sampler(only(temperature=0)).probs(x, NONE).argmax() == torch.argmax(x)


def test_greedy_ignores_seed_and_filters():
    x = random_logits(100, 7)
    a = Sampler(only(temperature=0, seed=1, top_k=3, top_p=0.5, min_p=0.3))
    b = Sampler(only(temperature=0, seed=2))
    assert int(a(x, NONE)) == int(b(x, NONE)) == int(torch.argmax(x))


def test_seeded_sampler_is_reproducible():
    x = random_logits(200, 1)
    settings = SamplingSettings(temperature=1.0, seed=42)  # the default filters on

    def draw(s):
        return [int(s(x, NONE)) for _ in range(100)]

    first = draw(Sampler(settings))
    assert first == draw(Sampler(settings))
    assert first != draw(Sampler(SamplingSettings(temperature=1.0, seed=43)))


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """p-value of Pearson's chi-square goodness of fit (cells with probability 0 must be empty)."""
    n = sum(counts)
    cells = [(c, n * q) for c, q in zip(counts, probs) if q > 0]
    assert all(c == 0 for c, q in zip(counts, probs) if q == 0), "drew a token of probability 0"
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    # The chi-square survival function is the regularized upper incomplete gamma Q(df/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


LOGITS6 = [1.5, 0.8, 0.3, 0.0, -0.7, -1.5]
N_DRAWS = 20_000


def sampler_counts(settings: SamplingSettings, logits: list[float], n: int = N_DRAWS) -> list[int]:
    s = Sampler(settings)
    x = torch.tensor(logits)
    counts = [0] * len(logits)
    for _ in range(n):
        counts[int(s(x, NONE))] += 1
    return counts


def test_chi_square_draws_follow_softmax():
    counts = sampler_counts(only(seed=123), LOGITS6)
    assert chi_square_p(counts, softmax_list(LOGITS6)) > 0.001, counts
    # The test has power: the same counts are clearly not uniform, and uniform draws are clearly
    # not softmax (both would pass if the check were vacuous).
    assert chi_square_p(counts, [1 / 6] * 6) < 1e-9
    g = torch.Generator().manual_seed(0)
    uniform = torch.bincount(torch.randint(0, 6, (N_DRAWS,), generator=g), minlength=6).tolist()
    assert chi_square_p(uniform, softmax_list(LOGITS6)) < 1e-9


def test_chi_square_with_temperature_and_top_k():
    t, k = 0.7, 4
    counts = sampler_counts(only(seed=7, temperature=t, top_k=k), LOGITS6)
    top = ref_top_k(LOGITS6, k)
    scaled = [v / t if i in top else -math.inf for i, v in enumerate(LOGITS6)]
    m = max(scaled)
    e = [math.exp(v - m) for v in scaled]
    probs = [v / sum(e) for v in e]
    assert chi_square_p(counts, probs) > 0.001, counts
    assert top == {0, 1, 2, 3}
    assert chi_square_p(counts, softmax_list(LOGITS6[:k]) + [0, 0]) < 1e-6  # temperature does matter
