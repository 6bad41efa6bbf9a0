"""Timing a sequence of GPU launches as one replayed CUDA graph (the decode step's conditions: no host
work between kernels, programmatic dependent launch inside the graph), for the bench scripts."""

from __future__ import annotations

import torch


def graph_seconds(run, reps: int = 3) -> float:
    """Seconds per replay of a CUDA graph capturing run() (mean of reps replays after one warm-up;
    run() is called once eagerly first, to compile its kernels)."""
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / reps
