"""serve's engine running ahead on CUDA (engine.py: the next decode step launched, asynchronously, before
a step's events are handed out; its logits buffer is the next replay's): every stream equals the same
engine's without running ahead, in the batch-invariant kernels' steps (12 slots) and in dense steps
(40 slots, cuBLAS on the kept bf16 copies). Every request is queued before the engine starts, so both
runs admit the same prompts in the same passes and step the same rows together: the ids must be equal
bit for bit. (Each stream against the request alone: tests/test_engine.py on the CPU.)"""

from __future__ import annotations

import pytest
import torch

from localllm.config import ModelConfig
from localllm.engine import Engine, Request
from localllm.settings import SamplingSettings

CFG = ModelConfig(arch="llama", n_layers=3, dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=32,
                  vocab_size=512, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
CAP = 96
GREEDY = SamplingSettings(temperature=0)


@pytest.fixture(scope="module")
def runtime():
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    state, _ = synthetic_state(CFG, "Q4_K_M", "cpu", seed=3)
    rt = build_model(CFG, dict(state), "cuda", torch.bfloat16)
    assert isinstance(rt, CudaRuntime) and rt.steps_async
    return rt


def lengths(n: int) -> list[int]:
    """New ids of each request: 12 of 6..44 (a row ends almost every step), or 40 in three groups (20, 32,
    44: 19 steps of 40 rows with none ending, where steps of 32+ rows run ahead)."""
    return [6 + (7 * i) % 39 if n < 32 else 20 + 12 * (i % 3) for i in range(n)]


def served(rt, n: int, run_ahead: int) -> tuple[list[list[int]], int]:
    """n greedy requests of 12..20 prompt ids and lengths(n) new ids, queued, then served by n slots ->
    (each stream's ids, steps launched ahead)."""
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(1, CFG.vocab_size, (12 + i % 9,), generator=gen).tolist() for i in range(n)]
    eng = Engine(rt, frozenset(), n, CAP, max_queue=n, run_ahead=run_ahead)
    handles = [eng.submit(Request(p, GREEDY, m, ignore_eos=True)) for p, m in zip(prompts, lengths(n))]
    eng.start()
    try:
        return [[e.token for e in h if e.token is not None] for h in handles], eng.stats.ahead
    finally:
        eng.join()


@pytest.mark.parametrize("n, ahead_rows", [(12, 1), (40, 32)])
def test_running_ahead_streams_equal_the_engine_without(runtime, n, ahead_rows):
    ahead, launched = served(runtime, n, ahead_rows)
    plain, none = served(runtime, n, 0)
    assert launched > 5 and none == 0
    assert [len(s) for s in ahead] == lengths(n)
    assert ahead == plain
    assert len({tuple(s) for s in ahead}) > n // 2  # streams differ: a mix-up of rows would show
