"""`localllm serve` on CUDA (the default model): 16 concurrent greedy streams each equal to the same
request served alone, and a seeded sampled request repeats itself beside others (batch invariance of
decode_slots on the GPU, through the HTTP layer and the openai client)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

PARALLEL = 16


@pytest.fixture(scope="module")
def client(default_path):
    from localllm.commands.serve import build_served
    from localllm.runner import open_model
    from localllm.server.run import serve_in_thread, stop_thread_server

    lm = open_model(str(default_path), "cuda")
    served = build_served(lm, None, PARALLEL, 512)
    server, url = serve_in_thread(served)
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300), served.names[0]
    stop_thread_server(server)


def test_16_concurrent_greedy_streams_equal_each_served_alone(client):
    api, model = client
    prompts = [f"Fact number {i} about the sea:" for i in range(16)]

    def run(prompt):
        chunks = api.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    alone = [run(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    assert len(set(alone)) > 8


def test_seeded_request_repeats_beside_others(client):
    api, model = client

    def sample(seed):
        return api.completions.create(model=model, prompt="Once upon a time", max_tokens=32, temperature=1.0,
                                      seed=seed).choices[0].text

    alone = sample(7)
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(sample, s) for s in range(1, 8)]
        again = pool.submit(sample, 7).result()
        texts = {f.result() for f in others}
    assert again == alone and len(texts | {alone}) > 1
