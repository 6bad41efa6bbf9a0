"""`serve`'s start-up warm-up on CUDA (commands/serve.warm_up -> CudaRuntime.warm_up_slots): after
build_served, every batch bucket up to --parallel has its decode graph, and a burst of 16 concurrent
requests captures no new graph (counted by each SlotDecoder's captures); the requests still give the
greedy ids of each served alone (the warm-up's cache rows are overwritten). Run:
`pytest -m cuda tests/gpu/test_gpu_serve_warmup.py` (under a minute on one H100)."""

from __future__ import annotations

import pytest
import torch

from localllm.settings import SamplingSettings

PARALLEL = 16
GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def captures(slots) -> dict[int, int]:
    from localllm.backends import cuda_slots

    return {b: d.captures for b, d in cuda_slots.decoders(slots).items()}


@pytest.mark.parametrize("wtype", ["Q4_K_M", "bf16"])
def test_burst_after_warm_up_captures_nothing(synthetic_files, wtype):
    from localllm.commands.serve import build_served
    from localllm.engine_requests import Request
    from localllm.runner import open_model

    path = synthetic_files.gguf("llama-3.2-1b", wtype, layers=2, random_blocks=True)
    lm = open_model(str(path), "cuda")  # as `localllm serve` opens it
    lines = []
    served = build_served(lm, None, PARALLEL, 256, notify=lines.append)
    engine = served.engine
    try:
        # other notices may come first (a model without a chat template says so)
        start = lines.index(f"warming up {PARALLEL} slots ...")
        assert lines[start + 1].startswith("warmed up in "), lines
        warm = captures(engine.slots)
        # quantized products: one graph per bucket 1..16; bf16 (passes of at most 16 rows): the same buckets
        assert set(warm) == {1, 2, 4, 8, 16} and set(warm.values()) == {1}, warm
        assert engine.slots.lengths == [0] * PARALLEL
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(3, 32000, (5 + i,), generator=g).tolist() for i in range(PARALLEL)]
        handles = [engine.submit(Request(p, GREEDY, max_tokens=12, ignore_eos=True)) for p in prompts]
        burst = [[e.token for e in h if e.token is not None] for h in handles]
        assert all(len(ids) == 12 for ids in burst)
        assert captures(engine.slots) == warm  # no graph captured by the burst
        alone = engine.submit(Request(prompts[5], GREEDY, max_tokens=12, ignore_eos=True))
        assert [e.token for e in alone if e.token is not None] == burst[5]
    finally:
        engine.stop()
        engine.join(30)
