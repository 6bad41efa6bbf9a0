"""The KV cache changes nothing: cached decoding, chunked prefill after an existing cache and rollback
all give the logits of recomputing the whole sequence from scratch (fp32, max abs diff <= 1e-4).

The oracle is our own model run without history: a fresh cache and every token from position 0.
"""

from __future__ import annotations

import pytest
import torch

from tiny_tokenizer import vocab_size
from conftest import GREEDY_TOKENS
from localllm.cache import make_cache
from localllm.generate import decode_one, generate
from localllm.load import load_model
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings

TOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@torch.inference_mode()
def recompute(model, cfg, seqs: list[list[int]]) -> torch.Tensor:
    """Logits (B, T, V) of whole sequences from position 0 with a fresh cache: the reference."""
    tokens = torch.tensor(seqs)
    return model(tokens, make_cache(cfg, tokens.shape[1], batch=tokens.shape[0]), 0)


@torch.inference_mode()
def run(model, cache, seqs: list[list[int]], start: int) -> torch.Tensor:
    return model(torch.tensor(seqs), cache, start)


# ---- tiny models: everything checked literally, step by step

TINY = [("llama", "gguf"), ("qwen2", "gguf"), ("qwen3", "safetensors"), ("llama3", "gguf")]


@pytest.fixture(scope="module", params=TINY, ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_lm(request, tiny):
    case, fmt = request.param
    path = tiny.gguf(case) if fmt == "gguf" else tiny.hf(case)
    return load_model(str(path), "cpu", torch.float32)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size(), (n,), generator=g).tolist()


@torch.inference_mode()
def test_tiny_greedy_cached_equals_recomputed_each_step(tiny_lm):
    model, cfg, rt = tiny_lm.model, tiny_lm.config, tiny_lm.runtime
    prompt = prompt_ids(7)
    cache = make_cache(cfg, 64)
    logits = run(model, cache, [prompt], 0)[0, -1]
    seq = list(prompt)
    for step in range(GREEDY_TOKENS):
        ref = recompute(model, cfg, [seq])[0, -1]
        assert max_diff(logits, ref) <= TOL, f"step {step}"
        seq.append(int(logits.argmax()))
        assert cache.length == len(seq) - 1
        logits = decode_one(rt, cache, torch.tensor(seq[-1]))
    # The library's generation loop takes the same greedy path.
    sampler = Sampler(SamplingSettings(temperature=0))
    ids = list(generate(rt, make_cache(cfg, 64), prompt, sampler, GREEDY_TOKENS))
    assert ids == seq[len(prompt):]


@torch.inference_mode()
def test_tiny_batched_decode_equals_recomputed(tiny_lm):
    model, cfg = tiny_lm.model, tiny_lm.config
    seqs = [prompt_ids(20, seed=1), prompt_ids(20, seed=2)]
    cache = make_cache(cfg, 32, batch=2)
    run(model, cache, [s[:12] for s in seqs], 0)
    ref = recompute(model, cfg, seqs)
    for pos in range(12, 20):
        got = run(model, cache, [[s[pos]] for s in seqs], pos)[:, 0]
        assert max_diff(got, ref[:, pos]) <= TOL, f"position {pos}"


@torch.inference_mode()
def test_tiny_prefill_after_cache_equals_recomputed(tiny_lm):
    model, cfg, rt = tiny_lm.model, tiny_lm.config, tiny_lm.runtime
    seq = prompt_ids(30, seed=3)
    ref = recompute(model, cfg, [seq])[0]
    cache = make_cache(cfg, 40)
    first = run(model, cache, [seq[:9]], 0)[0]
    assert max_diff(first, ref[:9]) <= TOL
    # A multi-token chunk at start > 0, then another, then one token.
    chunk = run(model, cache, [seq[9:20]], 9)[0]
    assert max_diff(chunk, ref[9:20]) <= TOL
    chunk = run(model, cache, [seq[20:29]], 20)[0]
    assert max_diff(chunk, ref[20:29]) <= TOL
    assert cache.length == 29
    assert max_diff(decode_one(rt, cache, torch.tensor(seq[29])), ref[29]) <= TOL


@torch.inference_mode()
def test_tiny_rollback_redecode(tiny_lm):
    model, cfg, rt = tiny_lm.model, tiny_lm.config, tiny_lm.runtime
    seq = prompt_ids(24, seed=4)
    ref = recompute(model, cfg, [seq])[0]
    cache = make_cache(cfg, 32)
    run(model, cache, [seq[:16]], 0)
    first = [decode_one(rt, cache, torch.tensor(t)) for t in seq[16:24]]
    # Roll back 6 positions and decode other tokens over the stale rows.
    cache.length = 18
    other = prompt_ids(4, seed=5)
    for i, t in enumerate(other):
        got = decode_one(rt, cache, torch.tensor(t))
        assert max_diff(got, recompute(model, cfg, [seq[:18] + other[: i + 1]])[0, -1]) <= TOL
    # Roll back again and re-decode the original tokens: the same logits as the first time.
    cache.length = 18
    for i, t in enumerate(seq[18:24]):
        got = decode_one(rt, cache, torch.tensor(t))
        assert max_diff(got, first[i + 2]) <= TOL and max_diff(got, ref[18 + i]) <= TOL
    # And a rolled-back multi-token chunk.
    cache.length = 10
    assert max_diff(run(model, cache, [seq[10:24]], 10)[0], ref[10:24]) <= TOL


# ---- the default model (SmolLM2-135M, 30 layers): the same checks on a real model


@pytest.fixture(scope="module")
def default_seq(default_greedy):
    """Prompt + the 32 greedy tokens, and the full-sequence logits recomputed from scratch."""
    prompt, ids, _ = default_greedy
    return prompt + ids


@pytest.fixture(scope="module")
def default_ref(default_lm, default_seq):
    return recompute(default_lm.model, default_lm.config, [default_seq])[0]


def test_default_greedy_cached_equals_recomputed(default_lm, default_greedy, default_ref):
    """Every step of the 32-token greedy generation (logits recorded inside generate()) against the
    from-scratch logits. The model is causal, so the logits of step i equal row P-1+i of one pass
    over the whole sequence; one prefix is also recomputed on its own to tie the two together."""
    prompt, ids, steps = default_greedy
    P = len(prompt)
    for i in range(GREEDY_TOKENS):
        assert max_diff(steps[i], default_ref[P - 1 + i]) <= TOL, f"step {i}"
    mid = 12
    alone = recompute(default_lm.model, default_lm.config, [prompt + ids[:mid]])[0, -1]
    assert max_diff(steps[mid], alone) <= TOL
    assert ids == [int(s.argmax()) for s in steps]


@torch.inference_mode()
def test_default_prefill_after_cache_and_rollback(default_lm, default_seq, default_ref):
    model, cfg, seq, ref = default_lm.model, default_lm.config, default_seq, default_ref
    rt = default_lm.runtime
    n = len(seq)
    cache = make_cache(cfg, 64)
    run(model, cache, [seq[:10]], 0)
    assert max_diff(run(model, cache, [seq[10:n]], 10)[0], ref[10:n]) <= TOL
    # Roll back and re-decode single tokens, then a chunk, over the stale rows.
    cache.length = n - 8
    for pos in range(n - 8, n - 5):
        assert max_diff(decode_one(rt, cache, torch.tensor(seq[pos])), ref[pos]) <= TOL
    cache.length = 20
    assert max_diff(run(model, cache, [seq[20:n]], 20)[0], ref[20:n]) <= TOL
