"""Tile configs of the tensor-core dense products (kernels/triton_dense.py) at Llama 3.1 8B shapes, bf16,
for one x row (a decode step) and six (a verify pass of five drafts), as a share of copy bandwidth.

    python bench/dense_tune.py                 # sweep, then the chosen config per shape
    python bench/dense_tune.py --configs current
    python bench/dense_tune.py --shapes 1b     # the llama-3.2-1b shapes

x comes in bf16 (the norm kernel's output, as in the decode step); every product but the head adds
into an int64 fixed-point accumulator with K split (triton_dense.dense_split), the head writes fp32.

Each product runs over enough copies of its weight (>= 400 MB) that L2 holds none of it, inside one
CUDA graph (PDL between the kernels, as in the decode step); time per product = graph time / copies.
Share = weight bytes / time over the copy bandwidth (read + written bytes of a 1 GiB device copy)
measured in the same process.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from graph_timing import graph_seconds
from localllm.kernels import triton_dense
from localllm.commands.bench import copy_bandwidth

# name: (N, K, into an accumulator)
SHAPES = {
    "8b": {"q|k|v": (6144, 4096, True), "o": (4096, 4096, True), "gate/up": (28672, 4096, True),
           "down": (4096, 14336, True), "head": (128256, 4096, False)},
    "1b": {"q|k|v": (3072, 2048, True), "o": (2048, 2048, True), "gate/up": (16384, 2048, True),
           "down": (2048, 8192, True), "head": (128256, 2048, False)},
}


def time_product(shape, rows: int, config) -> float:
    """Seconds per product (mean over the copies, 3 replays)."""
    n, k, fixed = shape
    copies = max(2, (400 << 20) // (n * k * 2) + 1)
    ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    acc = torch.zeros(rows, n, dtype=torch.int64, device="cuda")

    def run():
        for w in ws:
            if fixed:
                triton_dense.gemv_dense(x, w, residual=acc, inplace=True, config=config)
            else:
                triton_dense.gemv_dense(x, w, out_dtype=torch.float32, config=config)

    return graph_seconds(run) / copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="sweep", choices=["sweep", "current"])
    ap.add_argument("--shapes", default="8b", choices=list(SHAPES))
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.configs == "current":
        grid = [(triton_dense.CONFIG, triton_dense.PROGRAMS_PER_SM)]
    else:
        grid = list(itertools.product(itertools.product((64, 128), (128,), (3, 4), (4,)), (1.0, 1.4, 2.0, 3.0)))
    print("| product | config (BN, BK, stages, warps), programs/SM | 1 row | 6 rows |\n| --- | --- | ---: | ---: |")
    for name, shape in SHAPES[args.shapes].items():
        n, k = shape[:2]
        best = None
        for config, per_sm in grid:
            triton_dense.PROGRAMS_PER_SM = per_sm
            try:
                t1 = time_product(shape, 1, config)
                t6 = time_product(shape, 6, config) if args.configs == "current" else t1
            except Exception as e:  # out of shared memory etc.
                print(f"| {name} | {config} | failed: {type(e).__name__} | |")
                continue
            share1, share6 = n * k * 2 / t1 / bw, n * k * 2 / t6 / bw
            split = triton_dense.dense_split(n, k, torch.device("cuda"), config) if shape[2] else 1
            print(f"| {name} | {config}, {per_sm} (split {split}) | {share1:.1%} ({t1 * 1e6:.1f} us) | {share6:.1%} |",
                  flush=True)
            if best is None or t1 + t6 < best[0]:
                best = (t1 + t6, (config, per_sm), share1, share6)
        if best:
            print(f"| **{name} best** | {best[1]} | {best[2]:.1%} | {best[3]:.1%} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
