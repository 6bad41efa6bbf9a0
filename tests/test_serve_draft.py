"""`localllm serve --lookup N` / `--draft MODEL|self:TYPE`: speculative rounds in the engine's step
(localllm/engine_spec.py). Oracle: the same requests served without speculation (a plain server on the
same model, module-scoped), driven by the official `openai` client: greedy text, finish reasons and
usage must be identical, also when a stop string or max_tokens falls inside one round's accepted ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from typer.testing import CliRunner

from _bad_files import write_tiny_model
from cli_helpers import assert_one_error
from localllm.runner import open_model
from localllm.settings import DraftSettings

CTX = 256
PARALLEL = 4
# repetitive prompts: prompt lookup finds what follows, so rounds keep several ids (and reject some)
PROMPTS = [
    "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.",
    "Count: one two three four five six seven eight nine ten, one two three four five six",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


@pytest.fixture(scope="module")
def lm(default_path):
    return open_model(str(default_path), "cpu")


def start(lm, draft: DraftSettings | None):
    from localllm.commands.serve import build_served
    from localllm.server.run import serve_in_thread

    served = build_served(lm, None, PARALLEL, CTX, draft=draft or DraftSettings())
    srv, url = serve_in_thread(served)
    return srv, served, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def servers(lm):
    from localllm.server.run import stop_thread_server

    made = {name: start(lm, ds) for name, ds in (("plain", None), ("lookup", DraftSettings(lookup=3)),
                                                 ("self", DraftSettings(draft="self:Q4_0")))}
    yield made
    for srv, _, _ in made.values():
        stop_thread_server(srv)


def ask(client, served, prompt: str, **kw):
    r = client.completions.create(model=served.names[0], prompt=prompt, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens


def concurrently(server, requests):
    _, served, client = server
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda kw: ask(client, served, **kw), requests))


def test_verify_slots_rows_equal_decode_steps(lm):
    """Several ids per slot in one pass, slots in any order: the CPU's C++ rows give each row the bits of
    plain decode steps; the portable pass (Runtime's, prefill_slots' forward) agrees within rounding."""
    from localllm.runtime import Runtime

    rt = lm.runtime
    prompts, rows, order = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]], [[20, 21, 22], [30], [40, 41]], [2, 0, 1]
    caches = [rt.new_slots(3, 32) for _ in range(3)]
    for c in caches:
        rt.prefill_slots(c, [0, 1, 2], prompts, [0, 0, 0])
    steps = {s: torch.cat([rt.decode_slots(caches[0], [s], torch.tensor([t])) for t in rows[s]]) for s in range(3)}
    want = torch.cat([steps[s] for s in order])
    got = rt.verify_slots(caches[1], order, [rows[s] for s in order])
    assert torch.equal(got, want)
    portable = Runtime.verify_slots(rt, caches[2], order, [rows[s] for s in order])
    assert caches[1].lengths == caches[2].lengths == [8, 4, 6]
    assert (portable - want).abs().max() < 1e-2 * want.abs().max()
    assert torch.equal(portable.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", ["lookup", "self"])
def test_concurrent_greedy_requests_equal_plain_serve(servers, name):
    requests = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    want = [ask(servers["plain"][2], servers["plain"][1], **kw) for kw in requests]  # each served alone
    stats = servers[name][1].engine.stats
    before = (stats.speculative_steps, stats.drafted, stats.accepted)
    got = concurrently(servers[name], requests)
    assert got == want
    steps, drafted, accepted = (a - b for a, b in zip((stats.speculative_steps, stats.drafted, stats.accepted), before))
    assert steps > 0 and accepted > 0  # rounds kept drafts: several ids in one step
    assert drafted > accepted or name == "self"  # lookup's guesses are rejected at times


def test_stop_strings_and_max_tokens_inside_a_round(servers):
    plain = servers["plain"]
    text, _, _, _ = ask(plain[2], plain[1], PROMPTS[0], max_tokens=40)
    words = text.split()
    assert len(words) > 6, text
    stop = words[len(words) // 2]  # a word in the middle of the reply: many ids into it
    requests = [{"prompt": PROMPTS[0], "max_tokens": 40, "stop": [stop]}]
    requests += [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS[1:], (1, 5, 9))]
    want = [ask(plain[2], plain[1], **kw) for kw in requests]
    assert want[0][1] == "stop" and stop not in want[0][0]
    assert [w[2] for w in want[1:]] == [1, 5, 9] and all(w[1] == "length" for w in want[1:])
    stats = servers["lookup"][1].engine.stats
    accepted = stats.accepted
    assert concurrently(servers["lookup"], requests) == want
    assert stats.accepted > accepted


def test_sampled_requests_repeat_with_their_seed(servers):
    _, served, client = servers["self"]
    kw = {"model": served.names[0], "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.9, "seed": 7}
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b and a


def test_draft_of_another_vocabulary_fails_at_start(tiny, tmp_path):
    from localllm.cli import app

    other = write_tiny_model(tmp_path / "other-vocab.gguf")  # its own 260-token vocabulary
    result = CliRunner().invoke(app, ["serve", str(tiny.gguf("llama")), "--port", "0", "--draft", str(other)])
    assert_one_error(result, "does not share the target's vocabulary")
    result = CliRunner().invoke(app, ["serve", str(tiny.gguf("llama")), "--port", "0", "--draft", "x", "--lookup", "2"])
    assert_one_error(result, "exclude each other")
