"""The batched-decode products at 1, 16 and 64 x rows on CUDA, each alone, as the decode step takes them
(kernels/triton_q8.gemv_q8 with the tensor-core kernel where it applies: triton_mma.CONFIGS), over the
llama-3.1-8b shapes, as a share of copy bandwidth measured in the same process; or one product for a
profiler (issue 22: why the 64-row products are slow).

    PYTHONPATH=.:bench python bench/mma_rows.py [--types Q4_K Q6_K Q8_0] [--rows 1 16 64]
    ncu --clock-control none --kernel-name regex:_mma_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        python bench/mma_rows.py --one Q4_K:gate_up:64

Weights: random valid blocks (bench/mma_sweep.random_weight), enough copies that a graph of launches
cycling through them reads >= 256 MB (no L2 reuse); times from bench/mma_products.timed.
"""

from __future__ import annotations

import argparse

import gguf
import torch
from mma_products import SHAPES, copy_bandwidth, product, random_act, timed
from mma_sweep import random_weight

from localllm.kernels import triton_mma

Q = gguf.GGMLQuantizationType
MIN_BYTES = 256 << 20


def one(spec: str) -> None:
    """TYPE:SHAPE:ROWS: that product 5 times (the profiler skips the first launches: compilation)."""
    tname, shape, rows = spec.split(":")
    (n, k), m = SHAPES[shape], int(rows)
    w = random_weight(Q[tname], n, k)
    xa = random_act(m, k, "cuda")
    acc = torch.zeros(m, n, dtype=torch.int64, device="cuda")
    for _ in range(5):
        product(xa, w, acc, True)
    torch.cuda.synchronize()
    print(f"{spec}: config {triton_mma.config_for(Q[tname], m) if m >= triton_mma.MMA_ROWS else 'dp4a'}")


def shape_times(qtype, n: int, k: int, rows: list[int], bw: float) -> list[tuple[int, float, float]]:
    """[(x rows, seconds a product, share of copy bandwidth)] of an (n, k) weight of qtype."""
    first = random_weight(qtype, n, k)
    ws = [first] + [random_weight(qtype, n, k) for _ in range(MIN_BYTES // first.nbytes)]
    out = []
    for m in rows:
        xa = random_act(m, k, "cuda")
        acc = torch.zeros(m, n, dtype=torch.int64, device="cuda")
        it = iter(range(1 << 30))
        s = timed(lambda: product(xa, ws[next(it) % len(ws)], acc, True), len(ws))
        out.append((m, s, first.nbytes / s / bw))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--one", metavar="TYPE:SHAPE:ROWS", help="run one product for a profiler, time nothing")
    a = ap.parse_args()
    if a.one:
        return one(a.one)
    bw = copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s")
    for tname in a.types:
        for name, (n, k) in SHAPES.items():
            for m, s, share in shape_times(Q[tname], n, k, a.rows, bw):
                print(f"{tname:5s} {name:8s} m={m:3d} {s * 1e6:8.1f} us {share:6.1%} of copy", flush=True)


if __name__ == "__main__":
    main()
