"""backends/cuda_prompt.py's padded one-prompt forward, on the CPU (the forward the CUDA graphs
capture, run eagerly on the portable backend): a prompt padded to its bucket gives the logits and cache
rows of the same prompt prefilled alone (Runtime.prefill_slot, the reference), within the products'
rounding, writes only its own slot's rows at and after its start, and which prompts a graph takes.
The captures themselves run on the GPU (tests/gpu/test_gpu_prompt_graphs.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_slots import BASE, CONFIGS, TOL, noisy_slots, synthetic

from localllm.backends import cuda_prompt
from localllm.runtime import Runtime


def by_slot(t: torch.Tensor) -> torch.Tensor:
    """A cache buffer (L, n, Hkv, S, D) -> (n, L Hkv, S, D)."""
    return t.transpose(0, 1).flatten(1, 2)


def padded(rt: Runtime, slots, slot: int, ids: list[int], start: int, rows: int) -> torch.Tensor:
    """The forward a bucket of `rows` captures, on the inputs its graph's set() writes."""
    g = cuda_prompt.PromptGraph(rt.model, rows)
    g.set(slot, ids, start)
    return cuda_prompt.padded_forward(rt.model, slots, g.tokens, g.pos, g.slot, g.last)[0]


@pytest.mark.parametrize("name", ["llama", "moe"])
@pytest.mark.parametrize("slot, start, n", [(2, 5, 7), (0, 0, 3), (1, 0, 16)])
def test_padded_prompt_equals_the_prompt_alone(name, slot, start, n):
    rt = synthetic(CONFIGS[name], Runtime)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, rt.cfg.vocab_size, (5,), generator=g).tolist()
    ids = torch.randint(0, rt.cfg.vocab_size, (n,), generator=g).tolist()
    alone, want_cache = noisy_slots(rt, prefix)
    want = rt.prefill_slot(alone, slot, ids, start)
    got_slots, got_cache = noisy_slots(rt, prefix)
    noise = [t.clone() for t in got_cache]
    rows = cuda_prompt.bucket(n)
    assert rows >= n and start + rows <= got_slots.capacity
    with torch.inference_mode():
        got = padded(rt, got_slots, slot, ids, start, rows)
    assert got.shape == want.shape == (rt.cfg.vocab_size,) and got.dtype == torch.float32
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert torch.equal(got.argmax(), want.argmax())
    for old, new, ref in zip(*(map(by_slot, c) for c in (noise, got_cache, want_cache))):
        # the prompt's rows as prefilled alone; the padding's rows past it; nothing else touched
        end = start + n
        assert (new[slot, :, :end] - ref[slot, :, :end]).abs().max() <= TOL * ref[slot, :, :end].abs().max()
        changed = (old != new).any(-1).any(1).nonzero().tolist()  # (slot, position) pairs
        assert changed and all(s == slot and start <= p < start + rows for s, p in changed)


@pytest.mark.parametrize("name", ["llama", "moe"])
def test_several_padded_prompts_equal_their_eager_pass(name):
    """Three prompts (one after slot 2's prefix) through a graph of 4 prompts of 16 rows, the last
    repeated as padding: logits and cache rows of the eager prefill_slots pass within the products'
    rounding; nothing written outside each prompt's slot from its start, within its 16 rows."""
    rt = synthetic(CONFIGS[name], Runtime)
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, rt.cfg.vocab_size, (5,), generator=g).tolist()
    which, starts, lens = [2, 0, 3], [5, 0, 0], [7, 16, 1]
    prompts = [torch.randint(0, rt.cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    alone, want_cache = noisy_slots(rt, prefix)
    want = rt.prefill_slots(alone, which, prompts, starts)
    got_slots, got_cache = noisy_slots(rt, prefix)
    noise = [t.clone() for t in got_cache]
    graphs = cuda_prompt.PromptGraphs(rt.model, got_slots.capacity)
    assert graphs.many_bucket(prompts, starts, 48) == (3, 16) and graphs.many_bucket(prompts, starts, 47) is None
    assert graphs.many_bucket(prompts + prompts[:2], starts + starts[:2], 96) == (6, 16)  # 5 prompts: 6's graph
    assert graphs.many_bucket(prompts[:1], starts[:1], 64) is None  # one prompt: its own graph
    gr = cuda_prompt.PromptGraph(rt.model, 16, 4)
    gr.set(which, prompts, starts)
    with torch.inference_mode():
        got = cuda_prompt.padded_forward(rt.model, got_slots, gr.tokens, gr.pos, gr.slot, gr.last)
    assert got.shape == (4, rt.cfg.vocab_size) and torch.equal(got[3], got[2])  # the padding: prompt 3 again
    assert (got[:3] - want).abs().max() <= TOL * want.abs().max()
    assert torch.equal(got[:3].argmax(-1), want.argmax(-1))
    for old, new, ref in zip(*(map(by_slot, c) for c in (noise, got_cache, want_cache))):
        for s, st, n in zip(which, starts, lens):
            assert (new[s, :, :st + n] - ref[s, :, :st + n]).abs().max() <= TOL * ref[s, :, :st + n].abs().max()
        changed = (old != new).any(-1).any(1).nonzero().tolist()
        spans = {s: (st, st + 16) for s, st in zip(which, starts)}
        assert changed and all(s in spans and spans[s][0] <= p < spans[s][1] for s, p in changed)


def test_which_prompts_a_graph_takes():
    rt = synthetic(BASE, Runtime)
    graphs = cuda_prompt.PromptGraphs(rt.model, 40)
    assert [cuda_prompt.bucket(t) for t in (1, 4, 5, 16, 17, 512)] == [1, 4, 16, 16, 32, 512]
    assert cuda_prompt.bucket(513) is None
    assert graphs.takes(7, 24) and not graphs.takes(7, 25)  # 25 + 16 rows past the 40 positions
    assert graphs.takes(3, 37) and not graphs.takes(3, 38) and not graphs.takes(0, 0)
    assert cuda_prompt.covers(rt.model)
    slots = rt.new_slots(2, 40)
    held = cuda_prompt.prompt_graphs(rt.model, slots)
    assert held is cuda_prompt.prompt_graphs(rt.model, slots) and held.capacity == 40


def test_graphs_die_with_their_slots_without_the_garbage_collector():
    """No reference cycle through the Slots: dropped, its graphs go at once, never inside a later
    capture (PromptGraphs' docstring says why)."""
    rt = synthetic(BASE, Runtime)
    gc.disable()
    try:
        slots = rt.new_slots(2, 40)
        graphs = weakref.ref(cuda_prompt.prompt_graphs(rt.model, slots))
        held = weakref.ref(slots)
        del slots
        assert held() is None and graphs() is None
    finally:
        gc.enable()
    for name in ("gemma2", "gemma3"):  # sliding windows: the eager pass
        assert not cuda_prompt.covers(synthetic(CONFIGS[name], Runtime).model)


def test_a_bucket_without_memory_for_its_graph_runs_eagerly(monkeypatch):
    """A capture that runs out of memory: run() says so (None), the bucket is never taken again, and
    capture_all skips it."""
    rt = synthetic(BASE, Runtime)
    slots = rt.new_slots(2, 40)
    graphs = cuda_prompt.PromptGraphs(rt.model, slots.capacity)
    tried = []

    def no_memory(self, slots, pool):
        tried.append(self.rows)
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(cuda_prompt.PromptGraph, "capture", no_memory)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    assert graphs.takes(9, 0)
    assert graphs.run(slots, 1, list(range(9)), 0) is None
    assert not graphs.takes(9, 0) and not graphs.takes(16, 3) and graphs.takes(17, 0)
    assert graphs.capture_all(slots, 32) == 0 and tried == [16, 1, 2, 3, 4, 32, 16]  # then 2 prompts of 16

    def ended(self, slots, pool):  # the capture's end failing while the allocator's error propagates
        try:
            raise torch.OutOfMemoryError("out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(cuda_prompt.PromptGraph, "capture", ended)
    assert graphs.run(slots, 1, list(range(40)), 0) is None and not graphs.takes(40, 0)

    def invalid(self, slots, pool):  # any other failure is not swallowed
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_prompt.PromptGraph, "capture", invalid)
    with pytest.raises(RuntimeError, match="capturing"):
        graphs.run(slots, 1, [1, 2], 0)


def test_captured_warms_up_on_a_side_stream_restores_then_captures(monkeypatch):
    """backends/cuda_graph.captured, the capture every CUDA graph of the runtime takes (decode steps,
    slot steps, prompts): the run once on a side stream, restore(), then the run inside the capture with
    the pool given; returns the graph and the captured run's output. (torch.cuda's objects replaced by
    recorders: no GPU here.)"""
    from contextlib import contextmanager

    from localllm.backends import cuda_graph

    events = []

    class Stream:
        def __init__(self, device=None):
            events.append(("stream", device))

        def wait_stream(self, other):
            events.append(("wait", type(other).__name__))

    @contextmanager
    def on(stream):
        events.append(("on side",))
        yield
        events.append(("off side",))

    @contextmanager
    def graph(g, pool=None):
        events.append(("capture", pool))
        yield
        events.append(("captured",))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    runs = iter(["warm", "static"])
    g, out = cuda_graph.captured(lambda: events.append(("run",)) or next(runs), pool=(0, 7),
                                 restore=lambda: events.append(("restore",)), device="cuda:1")
    assert (g, out) == ("graph", "static")
    assert events == [("stream", "cuda:1"), ("stream", "cuda:1"), ("wait", "Stream"), ("on side",), ("run",),
                      ("off side",), ("stream", "cuda:1"), ("wait", "Stream"), ("restore",), ("capture", (0, 7)),
                      ("run",), ("captured",)]
