"""After `serve`'s warm-up on CUDA (commands/serve.warm_up -> CudaRuntime.warm_up_slots: the prompt shapes
of backends/cuda_warmup.py, then every decode bucket's graph) no request compiles a Triton kernel or
captures a CUDA graph (issue 22: a fresh server's first single-prompt request waited 9.6 s for four
compilations). Counted: the compiled variants held by every @triton.jit function of localllm (each
JITFunction's per-device kernel cache: a new entry is a compilation, or a load from Triton's disk
cache) and every CUDAGraph capture. Requests: one prompt of 7 ids, one of 128, the same again (one new
id after a cached prefix), one sharing only its first id with a slot, one longer than a prefill pass (in
parts), a burst of 8 prompts of 1..100 ids ending at different steps (decode steps of 8 down to 1
slots), a burst of 12 (a queue). With --draft self:Q8_0 the rounds verify drafts (verify_slots) and the
draft model catches up, on its own warmed slots. Run: `pytest -m cuda -s tests/gpu/test_gpu_warmup_compiles.py`."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from .gpu_helpers import random_ids
from localllm.settings import DEFAULT_SERVE, DraftSettings, SamplingSettings

PARALLEL = 8
CTX = 512
GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
LIMITS = replace(DEFAULT_SERVE, prefill_tokens=256)  # a 300-id prompt takes two passes


def compiled() -> dict[str, int]:
    """Compiled variants of each @triton.jit function of localllm, by name (kernel_cache: the first of
    each device's entry in JITFunction.device_caches, triton/runtime/jit.py)."""
    from triton.runtime.jit import JITFunction

    fns = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith("localllm") and mod is not None
           for v in vars(mod).values() if isinstance(v, JITFunction)}
    counts = {f"{f.fn.__module__}.{f.fn.__name__}": sum(len(c[0]) for c in f.device_caches.values())
              for f in fns.values()}
    return {k: v for k, v in counts.items() if v}


@pytest.fixture
def captures(monkeypatch) -> list[int]:
    """Counts every CUDA graph capture from now on."""
    count = [0]
    original = torch.cuda.CUDAGraph.capture_begin

    def counting(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting)
    return count


def serve(engine, prompts: list[list[int]], budgets: list[int]) -> None:
    from localllm.engine_requests import Request

    handles = [engine.submit(Request(p, GREEDY, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, budgets)]
    for h, n in zip(handles, budgets):
        events = list(h)
        assert events[-1].finish == "length", events[-1]
        assert sum(e.token is not None for e in events) == n


@pytest.mark.parametrize("wtype, draft", [("Q4_K_M", None), ("bf16", None), ("Q4_K_M", "self:Q8_0")])
def test_requests_after_warm_up_compile_nothing(synthetic_files, captures, wtype, draft):
    from localllm.commands.serve import build_served
    from localllm.runner import open_model

    path = synthetic_files.gguf("llama-3.2-1b", wtype, layers=2, random_blocks=True)
    lm = open_model(str(path), "cuda")
    lines = []
    served = build_served(lm, None, PARALLEL, CTX, limits=LIMITS, notify=lines.append,
                          draft=DraftSettings(draft=draft, max_draft=4 if draft else None))
    engine = served.engine
    try:
        warm, graphs = compiled(), captures[0]
        print(f"\n{wtype} draft={draft}: {[line for line in lines if line.startswith('warmed up')]}, "
              f"{sum(warm.values())} Triton variants, {graphs} graphs captured")
        assert warm and graphs > 0  # the counters see the warm-up's work
        assert engine.slots.lengths == [0] * PARALLEL
        vocab = lm.runtime.cfg.vocab_size
        p128 = random_ids(vocab, 128, 1)
        for prompt in (random_ids(vocab, 7, 0), p128, p128, p128[:1] + random_ids(vocab, 20, 2),
                       random_ids(vocab, 300, 3)):
            serve(engine, [prompt], [4])
        lengths, budgets = [1, 2, 3, 5, 16, 33, 100, 61], [3, 9, 5, 12, 7, 15, 4, 10]
        serve(engine, [random_ids(vocab, n, 10 + i) for i, n in enumerate(lengths)], budgets)
        serve(engine, [random_ids(vocab, 10 + i, 30 + i) for i in range(12)], [6] * 12)
        if draft is not None:  # the rounds verified drafts
            assert engine.stats.speculative_steps > 0 and engine.stats.drafted > 0, engine.stats
        after = compiled()
        assert {k: (warm.get(k, 0), v) for k, v in after.items() if v != warm.get(k, 0)} == {}
        assert captures[0] == graphs
    finally:
        engine.stop()
        engine.join(30)
