"""Helpers of the `localllm serve` tests: raw HTTP calls (urllib, for bodies no client would send) and the
references the server's answers are checked against (generate() alone on a fresh cache)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from localllm.generate import generate
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings

GREEDY = SamplingSettings(temperature=0)


def post(url: str, body, key: str | None = None, raw: bytes | None = None, method: str = "POST"):
    """-> (status, headers, parsed JSON body)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def assert_error(result, status: int, needle: str, param: str | None = "?"):
    """OpenAI's error JSON with this status, a message naming `needle`."""
    got, _, body = result
    assert got == status, (got, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert needle in err["message"], err["message"]
    if param != "?":
        assert err["param"] == param, err


def reference(lm, ids: list[int], max_tokens: int, capacity: int, sampling: SamplingSettings = GREEDY) -> list[int]:
    """The ids generate() produces for this prompt alone, on a fresh cache (the oracle of the server)."""
    cache = lm.runtime.new_cache(capacity)
    return list(generate(lm.runtime, cache, ids, Sampler(sampling), max_tokens, lm.tokenizer.stop_ids))


@torch.inference_mode()
def reference_logprobs(lm, ids: list[int], out: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at each generated position (teacher-forced) -> (len(out), V), as
    generation computes them: the prompt's prefill, then one decode step per id (a T-row forward sums in
    another order: up to a few 1e-3 apart in log-probability on the CPU path)."""
    rt = lm.runtime
    cache = rt.new_cache(len(ids) + len(out))
    rows = [rt.prefill(cache, [ids])[0].float().clone()]
    for t in out[:-1]:
        rows.append(rt.decode(cache, torch.tensor([t]))[0].float().clone())
    return torch.stack(rows).log_softmax(-1)
