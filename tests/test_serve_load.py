"""bench/serve_load.py's plan of requests (no server: one_request replaced by a recorder): every prompt
of a run, warm-ups included, shares no prefix with another (a repeated prompt is served from localllm's
prefix cache as a 1-id prefill, which is not what the rounds claim to measure: issue 22's 16-client
TTFT stalls), requests without any text are counted, not ranked as NaN, and a connection dropped before
any text is retried once and counted."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve_load  # noqa: E402

from localllm.chat import common_prefix  # noqa: E402


def run_plan(monkeypatch, argv: list[str], ttft=lambda k: 0.01) -> tuple[list[list[int]], list[dict]]:
    """measure() against the recorder -> (every prompt sent, in order; the rows)."""
    sent: list[list[int]] = []

    async def record(api, model, ids, gen):
        sent.append(ids)
        return {"ttft": ttft(len(sent) - 1), "itl": [0.001] * (gen - 1), "tokens": gen}

    monkeypatch.setattr(serve_load, "one_request", record)
    args = serve_load.parse_args(["--model", "m", *argv])
    _, rows = asyncio.run(serve_load.measure(args, report=lambda line: None))
    return sent, rows


def test_no_two_prompts_of_a_run_share_a_prefix(monkeypatch):
    sent, rows = run_plan(monkeypatch, ["--clients", "1,16,64", "--requests", "2", "--prompt-tokens", "16"])
    assert len(sent) == (1 + 16 + 64) * (1 + 2)  # the warm-ups (one each), then the rounds
    assert all(len(ids) == 16 and all(1000 <= t < 21000 for t in ids) for ids in sent)
    worst = max(common_prefix(a, b) for i, a in enumerate(sent) for b in sent[i + 1:])
    assert worst == 0
    assert [r["requests"] for r in rows] == [2, 32, 128]


def test_requests_without_text_have_no_ttft(monkeypatch):
    # every third request of the run streams no text (ttft None): counted in no_text, not in the percentiles
    sent, rows = run_plan(monkeypatch, ["--clients", "4", "--requests", "3"],
                          ttft=lambda k: None if k % 3 == 0 else 0.001 * k)
    r = rows[0]
    timed = [0.001 * k for k in range(4, 16) if k % 3]  # the round's requests are the 5th to the 16th sent
    assert r["no_text"] == 12 - len(timed)
    assert r["ttft_p99_ms"] == 1e3 * max(timed) and r["ttft_p50_ms"] == 1e3 * serve_load.percentile(timed, 50)
    assert "without text" in serve_load.describe(r, 64)


class _Chunk:
    def __init__(self, text, usage=None):
        self.choices = [type("C", (), {"text": text})()]
        self.usage = usage


class _Api:
    """completions.create: fails with a dropped connection the first `drops` times (before any text, or
    after the first chunk if late), then streams 3 chunks."""

    def __init__(self, drops: int, late: bool = False):
        self.completions, self.drops, self.late, self.calls = self, drops, late, 0

    async def create(self, **kw):
        self.calls += 1
        dropped = self.calls <= self.drops
        if dropped and not self.late:
            raise serve_load.openai.APIConnectionError(request=None)

        async def chunks():
            for i in range(3):
                yield _Chunk("x", usage=type("U", (), {"completion_tokens": 3})() if i == 2 else None)
                if dropped:
                    raise serve_load.openai.APIConnectionError(request=None)
        return chunks()


def test_a_dropped_connection_is_retried_once():
    once = asyncio.run(serve_load.one_request(_Api(1), "m", [1, 2], 3))
    assert once["retried"] == 1 and once["tokens"] == 3 and len(once["itl"]) == 2
    for api in (_Api(2), _Api(1, late=True)):  # twice in a row, or after text arrived: the run fails
        with pytest.raises(serve_load.openai.APIConnectionError):
            asyncio.run(serve_load.one_request(api, "m", [1, 2], 3))


def test_clients_split_over_processes_and_merge():
    plan = [[[c, r] for r in range(2)] for c in range(10)]
    shares = serve_load.split(plan, 4)
    assert [len(s) for s in shares] == [3, 3, 2, 2] and sorted(c for s in shares for c in s) == sorted(plan)
    assert serve_load.split(plan[:2], 4) == [plan[:1], plan[1:2]]  # no empty share
    # (results by client, CPU s, start, end): wall from the first start to the last end, the busiest CPU share
    parts = [([[{"tokens": 1}], [{"tokens": 2}]], 1.5, 10.0, 13.0), ([[{"tokens": 3}]], 0.5, 10.5, 14.0)]
    flat, wall, cpu = serve_load.merge(parts)
    assert [r["tokens"] for r in flat] == [1, 2, 3] and wall == 4.0 and cpu == 1.5 / 4.0
