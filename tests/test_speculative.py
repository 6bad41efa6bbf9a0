"""Speculative decoding against its oracles: plain decoding's ids (greedy, fp32), the target's own
distribution (a chi-square test over many seeds, which a deliberately broken rule must fail), and
logits recomputed from scratch after every round's rollback of both caches.

Tiny models: the untied tiny llama is the target; its drafts are itself quantized in memory
(self:Q4_0, a related model: some drafts kept, some not), another tiny model of the same vocabulary
(unrelated: nearly every draft rejected) and prompt lookup.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

import localllm.speculative as speculative
from localllm.cli import app
from _bad_files import write_tiny_model
from conftest import GREEDY_TOKENS
from localllm.commands.bench import BenchModel
from localllm.cache import make_cache
from localllm.chat import ChatSession
from localllm.chat_template import resolve_template
from localllm.config import ModelConfig
from localllm.draft import lookup_ids, open_drafter, vocab_difference
from localllm.errors import LocalLLMError
from localllm.generate import generate, prefill
from localllm.load import load_model
from localllm.runner import complete
from localllm.sampling import Sampler
from localllm.settings import DraftSettings, GenerationSettings, SamplingSettings
from localllm.commands.spec_bench import bench_spec_model
from localllm.speculative import AdaptiveK, SpecStats, best_k, generate_speculative, speculative_round
from localllm.synthetic import synthetic_model
from localllm.tokenizer import Tokenizer
from test_sampling import chi_square_p

TOL = 1e-4
GREEDY = SamplingSettings(temperature=0.0, repeat_penalty=1.3)  # the penalty makes each step depend on history
# Few tokens kept (top-k 3), so the joint law of two tokens has at most 9 cells; the penalty makes the
# second token's law depend on the first through the history each position is processed with.
RANDOM = SamplingSettings(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.5, seed=0)
F32_DRAFT = DraftSettings(draft="self:Q4_0", dtype="float32")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread


@pytest.fixture(scope="module")
def target(tiny):
    return load_model(str(tiny.gguf("llama")), "cpu", torch.float32)


@pytest.fixture(scope="module")
def prompt(target) -> list[int]:
    return target.tokenizer.encode("Once upon a time, there was")


def drafter_for(target, ds: DraftSettings, sampling: SamplingSettings):
    return open_drafter(target.runtime, target.tokenizer, ds, sampling)


def plain_ids(rt, prompt, sampling, n, stop=(), capacity=128) -> list[int]:
    return list(generate(rt, rt.new_cache(capacity), prompt, Sampler(sampling), n, stop))


def spec_ids(rt, prompt, sampling, drafter, ds, n, stop=(), capacity=128, stats=None):
    cache = rt.new_cache(capacity)
    out = list(generate_speculative(rt, cache, prompt, Sampler(sampling), drafter, n, stop, stats, settings=ds))
    return out, cache


# ---- greedy: the same ids as plain decoding


# name -> (draft settings, greedy settings). Lookup runs without the penalty: the tiny model's greedy
# text then repeats itself here and there, which is what lookup drafts from.
DRAFTS = {
    "self-q4_0-adaptive": (F32_DRAFT, GREEDY),
    "self-q8_0-k3": (DraftSettings(draft="self:Q8_0", max_draft=3, dtype="float32"), GREEDY),
    "self-q4_0-min-p": (replace(F32_DRAFT, min_p=0.02), GREEDY),  # about the median top probability here
    "unrelated-model": (None, GREEDY),  # the tiny llama3 file: filled in by the test (its path is a fixture's)
    # without a transform both sides compare ids (sampling.is_plain_greedy), not distributions
    "self-q4_0-plain-greedy": (F32_DRAFT, SamplingSettings(temperature=0.0)),
    "lookup-3": (DraftSettings(lookup=3), SamplingSettings(temperature=0.0)),
    "lookup-1-k8": (DraftSettings(lookup=1, max_draft=8), SamplingSettings(temperature=0.0)),
}


@pytest.mark.parametrize("name", DRAFTS)
def test_greedy_equals_plain(target, prompt, tiny, name):
    ds, greedy = DRAFTS[name]
    ds = ds or DraftSettings(draft=str(tiny.gguf("llama3")), dtype="float32")
    ref = plain_ids(target.runtime, prompt, greedy, 64)
    stats = SpecStats()
    out, _ = spec_ids(target.runtime, prompt, greedy, drafter_for(target, ds, greedy), ds, 64, stats=stats)
    assert out == ref
    assert stats.generated_tokens == 64 and stats.drafted > 0
    if name != "unrelated-model":  # a related draft or lookup: some passes give more than one id
        assert stats.target_passes < 64


def test_greedy_stop_id_budget_and_context_end(target, prompt):
    drafter = drafter_for(target, F32_DRAFT, GREEDY)
    ref = plain_ids(target.runtime, prompt, GREEDY, 40)
    k = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    out, cache = spec_ids(target.runtime, prompt, GREEDY, drafter, F32_DRAFT, 40, stop={ref[k]})
    assert out == ref[:k]
    assert cache.length <= len(prompt) + k and drafter.cache.length <= len(prompt) + k
    for n in (1, 2, 7):  # the budget holds exactly, whatever the round sizes
        assert spec_ids(target.runtime, prompt, GREEDY, drafter, F32_DRAFT, n)[0] == ref[:n]
    capacity = len(prompt) + 6  # the context ends first
    assert spec_ids(target.runtime, prompt, GREEDY, drafter, F32_DRAFT, 40, capacity=capacity)[0] == \
        plain_ids(target.runtime, prompt, GREEDY, 40, capacity=capacity)


def test_default_model_f32_target_with_its_q4_1_file_as_draft(default_lm, default_greedy):
    """The bar's pairing: the fp32 model and the Q4_1 file it was decoded from, drafting at the CPU's
    default dtype. The same ids as plain decoding, and nearly every draft kept."""
    prompt, ref, _ = default_greedy
    ds = DraftSettings(draft="smollm2-135m")
    greedy = SamplingSettings(temperature=0.0)
    drafter = open_drafter(default_lm.runtime, default_lm.tokenizer, ds, greedy)
    stats = SpecStats()
    out, _ = spec_ids(default_lm.runtime, prompt, greedy, drafter, ds, GREEDY_TOKENS, default_lm.tokenizer.stop_ids,
                      stats=stats)
    assert out == ref
    assert stats.acceptance() > 0.9 and stats.tokens_per_pass() > 3


# ---- temperature > 0: the target's distribution exactly


def joint_law(target, prompt) -> dict[tuple[int, int], float]:
    """P(x1, x2) of plain sampling: the target's processed distributions, recomputed from scratch."""
    model, sampler = target.model, Sampler(RANDOM)

    @torch.inference_mode()
    def probs(seq):
        logits = model(torch.tensor([seq]), make_cache(model.cfg, len(seq)), 0)[0, -1]
        return sampler.probs(logits, torch.tensor(seq))

    p1 = probs(prompt)
    law = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [x1])
        for x2 in p2.nonzero().flatten().tolist():
            law[(x1, x2)] = float(p1[x1]) * float(p2[x2])
    return law


def speculative_pairs(target, prompt, seeds: int) -> Counter:
    """(x1, x2) of one speculative generation per seed. Up to 2 drafts per pass, so x1 and x2 come from
    every path: kept drafts, a residual draw at either position, the bonus draw, a plain step."""
    ds = replace(F32_DRAFT, max_draft=2)
    drafter = drafter_for(target, ds, RANDOM)
    cache = make_cache(target.config, 32)
    prefill(target.runtime, cache, prompt[:-1], 0)  # every run reuses these rows (generate's `reuse`)
    counts = Counter()
    for seed in range(seeds):
        drafter.sampler.generator.manual_seed(1_000_000 + seed)
        sampler = Sampler(replace(RANDOM, seed=seed))
        ids = generate_speculative(target.runtime, cache, prompt, sampler, drafter, 3, reuse=len(prompt) - 1,
                                   settings=ds)
        counts[tuple(ids)[:2]] += 1
    return counts


def chi_square(counts: Counter, law: dict) -> float:
    assert set(counts) <= set(law), f"drew pairs of probability 0: {set(counts) - set(law)}"
    cells = sorted(law)
    return chi_square_p([counts[c] for c in cells], [law[c] for c in cells])


SEEDS = 800


def test_chi_square_first_two_tokens_follow_the_target(target, prompt, monkeypatch):
    law = joint_law(target, prompt)
    assert len(law) >= 6  # a real distribution over pairs, not nearly one cell
    counts = speculative_pairs(target, prompt, SEEDS)
    assert chi_square(counts, law) > 0.01, counts
    with monkeypatch.context() as m:
        # Broken: after a rejection, draw from p instead of max(0, p - q) (over-weights what q favours).
        m.setattr(speculative, "residual", lambda p, q: p)
        broken = speculative_pairs(target, prompt, SEEDS)
    assert chi_square(broken, law) < 1e-4, broken


# ---- rollback: both caches equal recomputation after random accept patterns


@torch.inference_mode()
def recompute(model, seq: list[int]) -> torch.Tensor:
    return model(torch.tensor([seq]), make_cache(model.cfg, len(seq)), 0)[0]


@torch.inference_mode()
def test_rollback_matches_recomputation(target, prompt, tiny):
    model, cfg = target.model, target.config
    sampling = replace(RANDOM, top_k=0, temperature=1.5)  # wide distributions: drafts kept and rejected
    # A dense fp32 draft (the tiny llama3 file): its cached and recomputed logits agree to rounding
    # (a quantized one's products round activations, differently per path, by about TOL already).
    drafter = drafter_for(target, DraftSettings(draft=str(tiny.gguf("llama3")), dtype="float32"), sampling)
    sampler, rng = Sampler(sampling), random.Random(0)
    cache = make_cache(cfg, 128)
    drafter.start(128, 0)
    prefill(target.runtime, cache, prompt[:-1], 0)
    seq, seen = list(prompt), set()
    while len(seq) < 100:
        new, n = speculative_round(target.runtime, cache, sampler, drafter, seq, torch.tensor(seq), rng.randint(1, 6))
        seen.add((n, len(new) - 1))
        seq += new
        # target: rows [0, N-1) are seq[:-1]; the next step's logits from them equal a fresh pass
        assert cache.length == len(seq) - 1
        got = model(torch.tensor([seq[-1:]]), cache, cache.length)[0, -1]
        cache.length -= 1
        assert (got - recompute(model, seq)[-1]).abs().max() <= TOL
        # draft: rows [0, L) are seq[:L]; a pass over the rest equals a fresh pass
        L = drafter.cache.length
        assert L <= len(seq) - 1
        got = drafter.rt.model(torch.tensor([seq[L:]]), drafter.cache, L)[0]
        drafter.cache.length = L
        assert (got - recompute(drafter.rt.model, seq)[L:]).abs().max() <= TOL
    assert any(m == 0 for n, m in seen) and any(0 < m < n for n, m in seen) and any(m == n for n, m in seen), seen


# ---- the parts


def test_lookup_ids_against_a_naive_search():
    rng = random.Random(1)
    for _ in range(200):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        ngram, k = rng.randint(1, 4), rng.randint(1, 5)
        expected = []
        for n in range(min(ngram, len(seq) - 1), 0, -1):
            starts = [i for i in range(len(seq) - n) if seq[i:i + n] == seq[-n:]]
            if starts:
                whole = [i for i in starts if i + n + k <= len(seq)]  # the latest with k ids after it
                pick = whole[-1] if whole else starts[0]  # else the earliest: the most ids
                expected = seq[pick + n: pick + n + k]
                break
        assert lookup_ids(torch.tensor(seq), ngram, k) == expected, (seq, ngram, k)


def test_best_k_maximises_tokens_per_cost():
    for a in (0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0):
        for cost in (0.05, 0.3, 1.0):
            def per_cost(k):
                return sum(a**i for i in range(k + 1)) / (1 + cost * k)  # expected tokens: 1 + a + ... + a^k
            assert per_cost(best_k(a, cost, 16)) == pytest.approx(max(per_cost(k) for k in range(1, 17)))
    assert best_k(1.0, 0.3, 16) == 16 and best_k(0.0, 0.3, 16) == 1


def test_adaptive_k_follows_the_acceptance_rate():
    schedule = AdaptiveK(cost=0.3, most=16, memory=0.7, kept=0.8)
    for _ in range(30):  # every draft kept: K climbs to the most
        schedule.update(schedule.k(), schedule.k())
    assert schedule.k() == 16
    for _ in range(30):  # every first draft rejected: one at a time
        schedule.update(schedule.k(), 0)
    assert schedule.k() == 1
    schedule.update(0, 0)  # nothing drafted: no evidence either way
    assert schedule.k() == 1
    assert AdaptiveK(0.3, 16, 0.7, 0.0, fixed=5).k() == 5  # --draft-max


def tokenizer(tokens, bos=1, eos=2):
    return Tokenizer(tokens, None, bos_id=bos, eos_id=eos, add_bos=False)


def test_vocab_difference():
    base = [f"t{i}" for i in range(1200)]
    a = tokenizer(base)
    assert vocab_difference(a, tokenizer(list(base))) is None
    assert "1199 tokens" in vocab_difference(a, tokenizer(base[:-1]))
    assert "eos_id" in vocab_difference(a, tokenizer(base, eos=3))
    assert "token 999" in vocab_difference(a, tokenizer(base[:999] + ["x"] + base[1000:]))
    assert vocab_difference(a, tokenizer(base[:1000] + ["x"] + base[1001:])) is None  # past the checked ids


def one_error_line(result, needle: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr


@pytest.mark.parametrize("args, needle", [
    (["--draft", "self:Q4_0", "--lookup", "2"], "exclude each other"),
    (["--draft", "self:Q9_9"], "unknown type"),
    (["--lookup", "2", "--draft-max", "0"], "--draft-max"),
    (["--lookup", "2", "--draft-min-p", "1.5"], "--draft-min-p"),
    (["--draft-max", "3"], "need a drafter"),
])
def test_bad_draft_options(args, needle):
    one_error_line(CliRunner().invoke(app, ["complete", "hi", *args]), needle)


def test_draft_with_another_vocabulary_is_one_error_line(tiny, tmp_path):
    other = write_tiny_model(tmp_path / "other-vocab.gguf")  # _bad_files' tiny model: its own 260-token vocabulary
    result = CliRunner().invoke(app, ["complete", str(tiny.gguf("llama")), "hi", "--draft", str(other)])
    one_error_line(result, "does not share the target's vocabulary")
    with pytest.raises(LocalLLMError, match="synthetic target"):
        open_drafter(load_model(str(other), "cpu").runtime, None, DraftSettings(draft=str(other)), GREEDY)


# ---- the commands


def test_cli_complete_equals_plain_and_reports(target, tiny):
    """`complete --draft self:Q4_0 -v` prints plain decoding's text (the library's, computed here) and
    the speculative figures."""
    greedy, gen = SamplingSettings(temperature=0.0), GenerationSettings(max_tokens=24)
    expected = "".join(complete(target, "Once upon a time", gen, greedy)) + "\n"
    result = CliRunner().invoke(app, ["complete", str(tiny.gguf("llama")), "Once upon a time", "-n", "24", "--temp", "0",
                                      "--dtype", "float32", "--draft", "self:Q4_0", "--draft-dtype", "float32", "-v"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected
    assert "drafts accepted" in result.stderr and "tokens per target pass" in result.stderr
    assert "x plain decoding" in result.stderr


def test_chat_with_a_drafter_equals_plain(target):
    template, _ = resolve_template("chatml", None)
    gen = GenerationSettings(max_tokens=16, ctx=256)
    greedy = SamplingSettings(temperature=0.0)

    def replies(drafter):
        session = ChatSession(target, template, gen, greedy, drafter=drafter, draft=F32_DRAFT)
        return ["".join(session.reply(text)) for text in ("Hi! Who are you?", "Tell me about the sea.")]

    drafter = open_drafter(target.runtime, target.tokenizer, F32_DRAFT, greedy)
    assert replies(drafter) == replies(None)
    assert drafter.cache.length > 0  # it drafted for both turns, keeping the first turn's rows


TINY = ModelConfig(arch="llama", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, head_dim=64,
                   vocab_size=300, context_length=128, norm_eps=1e-5, rope_theta=10000.0)


def test_spec_bench_rows():
    rt, types = synthetic_model(TINY, "f32", "cpu", torch.float32)
    ds = DraftSettings(draft="self:Q8_0", dtype="float32")
    drafter = open_drafter(rt, None, ds, SamplingSettings(temperature=0.0))
    # one repetition: the speedup (a mean of per-repetition ratios) is then exactly the ratio of the two
    # speeds (with more, the two statistics part under a loaded CPU's noise)
    rows = bench_spec_model(BenchModel("tiny", rt, types), drafter, ds, [8], [12], 1)
    assert [r.test for r in rows] == ["tg12 after pp8"]
    r = rows[0]
    assert r.same_output and r.plain_tps > 0 and r.spec_tps > 0 and r.tokens_per_pass >= 1
    assert r.speedup == pytest.approx(r.spec_tps / r.plain_tps, rel=1e-9)


def test_cli_bench_lookup():
    result = CliRunner().invoke(app, ["bench", "--synthetic", "smollm2-135m", "--type", "f32", "-p", "8", "-n", "4",
                                      "-r", "1", "--device", "cpu", "--lookup", "2", "-o", "json"])
    assert result.exit_code == 0, result.output
    assert '"same_output": true' in result.stdout and '"draft": "lookup 2"' in result.stdout
