"""Tile configs of the tensor-core dense products (kernels/triton_dense.py) at Llama 3.1 8B shapes, bf16,
for one x row (a decode step) and six (a verify pass of five drafts), as a share of copy bandwidth.

    python bench/dense_tune.py                 # sweep, then the chosen config per shape
    python bench/dense_tune.py --configs current

Each product runs over enough copies of its weight (>= 400 MB) that L2 holds none of it, inside one
CUDA graph (PDL between the kernels, as in the decode step); time per product = graph time / copies.
Share = weight bytes / time over the copy bandwidth (read + written bytes of a 1 GiB device copy)
measured in the same process.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kernels import triton_dense

# name: (N, K, glu, norm, residual in place, fp32 out)
SHAPES = {
    "q|k|v": (6144, 4096, False, True, False, False),
    "o": (4096, 4096, False, False, True, False),
    "gate/up": (28672, 4096, True, True, False, False),
    "down": (4096, 14336, False, False, True, False),
    "head": (128256, 4096, False, True, False, True),
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def time_product(name: str, rows: int, config) -> float:
    """Seconds per product (mean over the copies, 3 replays)."""
    n, k, glu, norm, res, f32 = SHAPES[name]
    copies = max(2, (400 << 20) // (n * k * 2) + 1)
    ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda")
    nw = torch.ones(k, dtype=torch.bfloat16, device="cuda") if norm else None
    resid = torch.zeros(rows, n, device="cuda") if res else None
    counters = torch.zeros(triton_dense.COUNTERS, dtype=torch.int32, device="cuda")

    def run():
        for w in ws:
            triton_dense.gemv_dense(x, w, residual=resid, norm_weight=nw, eps=1e-5, glu=glu, act_dtype=torch.bfloat16,
                                    out_dtype=torch.float32 if f32 else None, inplace=res, counters=counters,
                                    config=config)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(3):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    del g
    return start.elapsed_time(end) * 1e-3 / (3 * copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="sweep", choices=["sweep", "current"])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.configs == "current":
        grid = [triton_dense.CONFIG]
    else:
        grid = list(itertools.product((32, 64), (128, 256), (3, 4), (4,), (2, 3, 4)))
    print("| product | config (BN, BK, stages, warps, programs/SM) | 1 row | 6 rows |\n| --- | --- | ---: | ---: |")
    for name in args.shapes.split(","):
        n, k = SHAPES[name][:2]
        best = None
        for config in grid:
            try:
                t1 = time_product(name, 1, config)
                t6 = time_product(name, 6, config) if args.configs == "current" else t1
            except Exception as e:  # out of shared memory etc.
                print(f"| {name} | {config} | failed: {type(e).__name__} | |")
                continue
            share1, share6 = n * k * 2 / t1 / bw, n * k * 2 / t6 / bw
            print(f"| {name} | {config} | {share1:.1%} ({t1 * 1e6:.1f} us) | {share6:.1%} |", flush=True)
            if best is None or t1 + t6 < best[0]:
                best = (t1 + t6, config, share1, share6)
        if best:
            print(f"| **{name} best** | {best[1]} | {best[2]:.1%} | {best[3]:.1%} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
