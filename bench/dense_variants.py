"""Structures of the one-row tensor-core product, alone in a CUDA graph over >= 400 MB of weight
copies (as bench/dense_tune.py), as a share of copy bandwidth: what limits kernels/triton_dense.py?

    python bench/dense_variants.py [--shapes 8b,1b]

Variants (all batch-invariant: the tiles and the split depend on (N, K) only):
  committed triton_dense.gemv_dense as the decode step calls it (bf16 x, into an int64 accumulator)
  split-fx  grid (tiles, split): plain split K, x bf16 straight into tl.dot (no register pass),
            parts added into an int64 fixed-point accumulator by integer atomics (order-free)
  split-ord the same, parts summed in part order by the last to finish (residual products)
(Before commit d540333 (2026-11-26) two more columns measured the stream-K
kernel then committed, fed fp32 x normalised in its loop ('current') or bf16 x ('bf16x'); their
figures are in docs/PERFORMANCE.md.)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from dense_tune import SHAPES
from graph_timing import graph_seconds
from localllm.kernels import triton_dense
from localllm.kernels.triton_dense import _tile_sums
from localllm.kernels.triton_base import PDL, _pdl_wait
from localllm.kernels.triton_epilogue import COUNTERS, FIXED_ONE, _last_part
from localllm.commands.bench import copy_bandwidth

MP = tl.constexpr(16)


@triton.jit
def _split_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, PER, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, FIXED: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    n = t * BN + tl.arange(0, BN)
    nmask = n < N
    m = tl.arange(0, MP)
    mmask = m < M
    acc = _tile_sums(x_ptr, w_ptr, n, nmask, m, mmask, K, K, K, s * PER, PER, BK, STAGES, False)
    omask = nmask[:, None] & mmask[None, :]
    if FIXED:
        tl.atomic_add(out_ptr + m[None, :] * N + n[:, None], (acc * FIXED_ONE).to(tl.int64), mask=omask, sem="relaxed")
    else:
        tile = ws_ptr + m[None, :] * N + n[:, None]
        tl.store(tile + s * MP * N, acc, mask=omask)
        if _last_part(cnt_ptr, t, S):
            acc = tl.zeros((BN, MP), tl.float32)
            for j in range(S):
                acc += tl.load(tile + j * MP * N, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + t, 0)
            o = out_ptr + m[None, :] * N + n[:, None]
            tl.store(o, tl.load(o, mask=omask, other=0.0) + acc, mask=omask)


def split_product(x, w, out, ws, counters, split, bn, bk, stages, warps, fixed):
    n, k = w.shape
    per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    grid = (triton.cdiv(n, bn), triton.cdiv(k, per))
    _split_kernel[grid](x, w, out, ws, counters, x.shape[0], n, k, per, BN=bn, BK=bk, STAGES=stages, FIXED=fixed,
                        PDL=PDL, num_warps=warps, launch_pdl=PDL)


def measure(n: int, k: int, bw: float, splits) -> list[str]:
    copies = max(2, (400 << 20) // (n * k * 2) + 1)
    ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x16 = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    counters = torch.zeros(COUNTERS, dtype=torch.int32, device="cuda")
    share = lambda t: f"{n * k * 2 / t / bw:.1%}"  # noqa: E731
    cells = []
    acc = torch.zeros(1, n, dtype=torch.int64, device="cuda")
    t = graph_seconds(lambda: [triton_dense.gemv_dense(x16, w, residual=acc, inplace=True) for w in ws]) / copies
    cells.append(f"committed {share(t)}")
    out = torch.zeros(1, n, device="cuda")
    for fixed in (True, False):
        best = None
        for split, bn, bk, stages, warps in splits(n, k):
            wsp = torch.empty(split, 16, n, device="cuda")
            try:
                t = graph_seconds(lambda: [split_product(x16, w, acc if fixed else out, wsp, counters, split, bn, bk,
                                                         stages, warps, fixed) for w in ws]) / copies
            except Exception as e:  # noqa: BLE001
                print(f"  failed {split, bn, bk, stages, warps}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, (split, bn, bk, stages, warps))
        cells.append(f"{'split-fx' if fixed else 'split-ord'} {share(best[0])} {best[1]}")
    return cells


def configs(n: int, k: int):
    for bn in (64, 128):
        for bk, stages in ((128, 3), (128, 4), (256, 3)):
            tiles = triton.cdiv(n, bn)
            for split in (1, 2, 4, 8, 16):
                if k // split >= bk and tiles * split <= 8 * 132:
                    yield split, bn, bk, stages, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b,1b")
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e9:.0f} GB/s")
    for group in args.shapes.split(","):
        for name, (n, k, _) in SHAPES[group].items():
            print(f"| {group} {name} {n}x{k} | " + " | ".join(measure(n, k, bw, configs)) + " |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
