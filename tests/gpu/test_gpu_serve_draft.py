"""`localllm serve --lookup` on CUDA (the default model): concurrent greedy replies equal to the same
requests served without speculation. verify_slots has no CUDA override yet: the portable pass
(slots.verify_slots, prefill_slots' forward) checks the drafts, whose rows may round differently from the
decode graphs' (this test says whether greedy replies stay exact on the GPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

PARALLEL = 4
PROMPTS = ["Count: one two three four five six seven eight nine ten, one two three four five six",
           "The cat sat on the mat. The dog sat on the log. The cat sat on the",
           "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]


@pytest.fixture(scope="module")
def servers(default_path):
    from localllm.commands.serve import build_served
    from localllm.runner import open_model
    from localllm.server.run import serve_in_thread, stop_thread_server
    from localllm.settings import DraftSettings

    lm = open_model(str(default_path), "cuda")
    made = []
    for ds in (DraftSettings(), DraftSettings(lookup=3)):
        served = build_served(lm, None, PARALLEL, 512, draft=ds)
        server, url = serve_in_thread(served)
        made.append((server, served, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)))
    yield made
    for server, _, _ in made:
        stop_thread_server(server)


def test_lookup_greedy_equals_plain_on_cuda(servers):
    (_, plain, api0), (_, spec, api1) = servers

    def run(api, served, prompt):
        return api.completions.create(model=served.names[0], prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text

    alone = [run(api0, plain, p) for p in PROMPTS]
    with ThreadPoolExecutor(PARALLEL) as pool:
        together = list(pool.map(lambda p: run(api1, spec, p), PROMPTS))
    assert together == alone
    assert spec.engine.stats.accepted > 0
