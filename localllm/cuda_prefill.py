"""Prefill on CUDA: a forward of a prompt shape seen before replays a captured CUDA graph.

A prefill of T tokens launches ~11 kernels a layer; on the device machines the host needs ~50 µs a
launch (Triton's dispatch most), so an 8B prefill of 512 tokens is bound by the host (~19 ms) while
its kernels take ~12 ms (H200, bench/prefill_cpu.py). When the same (T, start) comes again (a
benchmark's repetitions, a fixed-length batch job) the forward is captured once and replayed: one
launch. A new shape runs eagerly; the second time it is captured (eager warm-up, then capture), after
that replayed. One graph is kept per cache (the last shape captured).
Reference: Transformer.forward itself (the graph replays exactly its kernels); the cache rows
[start, start + T) are written by the replay as by the eager forward.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .model import Transformer


class PrefillGraph:
    def __init__(self, model: Transformer, cache: KVCache):
        self.model, self.cache = model, cache
        self.seen: tuple | None = None  # the last shape run eagerly
        self.key: tuple | None = None  # the captured shape
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _capture(self, tokens: torch.Tensor, start: int) -> None:
        self.graph = None  # free the previous graph's pool first
        self.tokens = tokens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
            self.model(self.tokens, self.cache, start, last_only=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model(self.tokens, self.cache, start, last_only=True)

    def run(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (B, T) at positions [start, start + T) -> logits (B, 1, V) of the last position."""
        key = (tuple(tokens.shape), start)
        if key != self.key and key == self.seen:
            self._capture(tokens, start)
            self.key = key
        if key == self.key:
            self.tokens.copy_(tokens)
            self.graph.replay()
            self.cache.length = start + tokens.shape[1]
            return self.logits.clone()
        self.seen = key
        return self.model(tokens, self.cache, start, last_only=True)


def prefill_graph_for(model: Transformer, cache: KVCache) -> PrefillGraph:
    """The model's prefill graph holder for this cache (one kept: a new cache replaces it)."""
    from .cuda_decode import held_for

    return held_for(model, "_prefill_graph", cache, PrefillGraph)
