"""The continuous-batching engine (localllm/engine.py) without HTTP, on the default model: the prefix
cache (a free slot's own rows, rows copied from a busy slot), the context's end, cancellation, the
queue's bound. Oracle: generate() alone on a fresh cache."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from localllm.engine import Engine, QueueFull, Request
from localllm.errors import LocalLLMError
from localllm.generate import generate
from localllm.runner import encode_prompt, open_model
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings
from serve_helpers import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve_timeline  # noqa: E402

GREEDY = SamplingSettings(temperature=0)
CTX = 96


@pytest.fixture(scope="module")
def lm(default_path):
    return open_model(str(default_path), "cpu")


def ids_of(events):
    return [e.token for e in events if e.token is not None]


def engine(lm, parallel=2, queue=4):
    return Engine(lm.runtime, lm.tokenizer.stop_ids, parallel, CTX, queue).start()


def test_prefix_rows_copied_from_a_busy_slot(lm):
    eng = engine(lm)
    try:
        system = encode_prompt(lm, "You are a helpful assistant who knows the sea. Question:")
        a, b = system + encode_prompt(lm, " what is salt?")[1:], system + encode_prompt(lm, " why waves?")[1:]
        ha = eng.submit(Request(a, GREEDY, 12, ignore_eos=True))
        hb = eng.submit(Request(b, GREEDY, 12, ignore_eos=True))  # admitted while a's slot is busy
        out_a, out_b = ids_of(ha), ids_of(hb)
        assert eng.stats.reused >= len(system) - 1  # b's shared prefix came from a's rows
        assert eng.stats.prefilled == len(a) + len(b) - eng.stats.reused
        assert out_a == reference(lm, a, 12, CTX) and out_b == reference(lm, b, 12, CTX)
        # the same prompt again: served from the free slot's own rows, all but the last id
        before = eng.stats.reused
        assert ids_of(eng.submit(Request(a, GREEDY, 12, ignore_eos=True))) == out_a
        assert eng.stats.reused - before == len(a) - 1
    finally:
        eng.join()


def test_the_context_end_is_length(lm):
    eng = engine(lm)
    try:
        prompt = encode_prompt(lm, "one two three four five six seven")
        prompt = (prompt * (CTX // len(prompt) + 1))[: CTX - 3]
        events = list(eng.submit(Request(prompt, GREEDY, -1, ignore_eos=True)))
        assert len(ids_of(events)) == 3 and events[-1].finish == "length"
        with pytest.raises(LocalLLMError, match=f"{CTX} tokens but the context holds {CTX}"):
            eng.submit(Request(prompt + [1, 2, 3], GREEDY))
    finally:
        eng.join()


def test_cancel_frees_the_slot_and_the_queue_is_bounded(lm):
    eng = engine(lm, parallel=1, queue=1)
    try:
        prompt = encode_prompt(lm, "Count:")
        running = eng.submit(Request(prompt, GREEDY, 80, ignore_eos=True))
        waiting = eng.submit(Request(prompt, GREEDY, 80, ignore_eos=True))
        with pytest.raises(QueueFull):
            eng.submit(Request(prompt, GREEDY, 2))
        waiting.cancel()
        first = next(iter(running))
        assert first.token is not None
        running.cancel()
        assert list(running)[-1].finish == "cancelled"
        assert list(waiting)[-1].finish == "cancelled"
        events = list(eng.submit(Request(prompt, GREEDY, 4, ignore_eos=True)))  # the slot is free again
        assert len(ids_of(events)) == 4 and events[-1].finish == "length"
        assert eng.load() == {"slots_idle": 1, "slots_processing": 0, "queued": 0}
    finally:
        eng.join()


def test_waiting_prompts_prefilled_together_within_the_cap(lm):
    """Requests queued before the engine starts are admitted at once: one prefill_slots pass (within
    prefill_tokens), or prompts in parts over several steps under a cap shorter than them; a prompt
    sharing a prefix with another of the pass waits for a second pass that copies its rows. Every stream
    equals generate() alone (without end-of-turn ids, as ignore_eos)."""
    prompts = [encode_prompt(lm, f"Fact number {i} about the sea:") for i in (3, 14, 15, 92)]
    want = [list(generate(lm.runtime, lm.runtime.new_cache(CTX), p, Sampler(GREEDY), 6, frozenset())) for p in prompts]
    assert min(len(w) for w in want) == 6 and len({tuple(w) for w in want}) > 2  # a mix-up would show
    longest = max(len(p) for p in prompts)
    for cap, passes in ((4 * longest, 1), (5, None)):  # 5: every prompt prefilled in parts, several a pass
        eng = Engine(lm.runtime, lm.tokenizer.stop_ids, 4, CTX, 4, prefill_tokens=cap)
        handles = [eng.submit(Request(p, GREEDY, 6, ignore_eos=True)) for p in prompts]
        eng.start()
        try:
            assert [ids_of(h) for h in handles] == want
            # (one pass a step, each of at most cap ids; later ones copy "Fact number"'s rows)
            assert eng.stats.prefill_passes == (passes or -(-eng.stats.prefilled // cap))
            assert eng.stats.prefilled + eng.stats.reused == sum(len(p) for p in prompts)
        finally:
            eng.join()
    system = encode_prompt(lm, "You are a helpful assistant who knows the sea well. Question:")
    shared = [system + encode_prompt(lm, f" what are {w}?")[1:] for w in ("tides", "whales")]
    eng = Engine(lm.runtime, lm.tokenizer.stop_ids, 4, CTX, 4, share_min=8)
    handles = [eng.submit(Request(p, GREEDY, 6, ignore_eos=True)) for p in shared]
    eng.start()
    try:
        assert [ids_of(h) for h in handles] == [reference(lm, p, 6, CTX) for p in shared]
        assert eng.stats.prefill_passes == 2 and eng.stats.reused >= len(system) - 1
    finally:
        eng.join()


def test_debug_log_has_one_line_per_prefill_pass_and_step(lm, caplog):
    # `localllm serve --log-level debug`'s engine lines (issue 22: where first tokens wait on a GPU run):
    # one per pass, their ids adding up to the ids the engine counts as prefilled, and one per decode
    # step; bench/serve_timeline.py reads each of them
    caplog.set_level(logging.DEBUG, logger="localllm.engine")
    eng = engine(lm, parallel=2, queue=4)
    try:
        handles = [eng.submit(Request([1, 2, 3, 4 + i, 5], max_tokens=3)) for i in range(4)]
        assert all(len(ids_of(list(h))) == 3 for h in handles)
    finally:
        eng.join(10)
    lines = [r.getMessage() for r in caplog.records if r.name == "localllm.engine"]
    timeline = serve_timeline.events(lines)  # (start, end, kind, rows or prompts, ids, events' seconds)
    assert [e[2] for e in timeline].count("step") == eng.stats.steps
    assert [e[2] for e in timeline].count("pass") == eng.stats.prefill_passes
    assert sum(e[4] for e in timeline if e[2] == "pass") == eng.stats.prefilled
    assert sum(e[3] for e in timeline if e[2] == "step") == eng.stats.decoded
    steps = [line for line in lines if line.startswith("decode step: ")]
    lines = [line for line in lines if line.startswith("prefill pass: ")]
    assert len(steps) == eng.stats.steps and sum(int(line.split()[2]) for line in steps) == eng.stats.decoded
    assert len(lines) == eng.stats.prefill_passes >= 2  # 4 requests through 2 slots
    ids = [int(re.search(r"prompts, (\d+) ids", line).group(1)) for line in lines]
    assert sum(ids) == eng.stats.prefilled and eng.stats.slowest_prefill > 0
    assert sum(len(re.search(r"submitted ms ago: \[(.*)\]", line).group(1).split(",")) for line in lines) == 4


def test_running_ahead_equals_each_request_alone(lm):
    """run_ahead (CUDA's default for steps of 32+ rows: the next step launched before a step's events are
    handed out) from one row on the CPU path: greedy streams of different lengths, one ending at an
    end-of-turn id, a seeded sampled one, and one cancelled mid-stream, whose slot then serves another
    request. Oracle: generate() alone (the sampled one: the same engine without running ahead)."""
    prompts = [encode_prompt(lm, f"Tell me about the number {i}.") for i in (7, 21, 99, 64, 42)]
    sampled = SamplingSettings(temperature=0.9, seed=5)

    def serve(run_ahead: int):
        eng = Engine(lm.runtime, lm.tokenizer.stop_ids, 4, CTX, 4, run_ahead=run_ahead).start()
        try:
            long = eng.submit(Request(prompts[4], GREEDY, 60, ignore_eos=True))
            handles = [eng.submit(Request(prompts[0], GREEDY, 5, ignore_eos=True)),
                       eng.submit(Request(prompts[1], GREEDY, 12, ignore_eos=True)),
                       eng.submit(Request(prompts[2], GREEDY, 40)),
                       eng.submit(Request(prompts[3], sampled, 9, ignore_eos=True))]
            it = iter(long)
            got_long = [next(it).token for _ in range(3)]
            long.cancel()
            assert list(it)[-1].finish == "cancelled"
            out = [ids_of(h) for h in handles]
            out.append(ids_of(eng.submit(Request(prompts[4], GREEDY, 8, ignore_eos=True))))  # a freed slot
            return got_long, out, eng.stats.ahead
        finally:
            eng.join()

    def alone(p, n):  # without end-of-turn ids, as ignore_eos
        return list(generate(lm.runtime, lm.runtime.new_cache(CTX), p, Sampler(GREEDY), n, frozenset()))

    got_long, out, ahead = serve(1)
    assert ahead > 10  # most steps launched ahead
    want = [alone(prompts[0], 5), alone(prompts[1], 12), reference(lm, prompts[2], 40, CTX), alone(prompts[4], 8)]
    assert 0 < len(want[2]) < 40  # an end-of-turn id ends it
    assert got_long == want[3][:3]
    assert out[:3] + out[4:] == want
    _, plain, none_ahead = serve(0)
    assert none_ahead == 0 and out[3] == plain[3] and len(out[3]) == 9
