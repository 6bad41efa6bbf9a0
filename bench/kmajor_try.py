"""Experiment: a K-major (block-major) Q4_0 layout for the integer-dot matvec, against kernels/triton_q8.py.

Row-major planar fields make every thread load its own x words (per row of the tile). Stored block-major
((K/32, N, 16 bytes) quants, (K/32, N) scales), consecutive threads take consecutive rows of one block,
so a warp's weight load is one contiguous 512-byte run and the x words are the same for every thread
(one broadcast). Prints µs and share of copy bandwidth per 8B-layer shape for both layouts.

    python bench/kmajor_try.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from localllm.kernels import triton_q8
from localllm.kernels.triton_q8 import M4, _dp4a

DEV = "cuda"


@triton.jit
def _kmajor_q4_0(xq_ptr, xd_ptr, xs_ptr, out_ptr, QS, D, N, K, blocks_per_split,
                 BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r = rows[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    b_lo = tl.program_id(1) * blocks_per_split
    acc = tl.zeros((BK, BN), tl.float32)
    for b0 in range(b_lo, b_lo + blocks_per_split, BK):
        b = b0 + tl.arange(0, BK)
        b3 = b[:, None, None]
        w = tl.load(QS + (b3 * N + r).to(tl.int64) * 4 + j)  # (BK, BN, 4)
        s = _dp4a(w & M4, tl.load(xq_ptr + b3 * 8 + j), tl.zeros_like(w), ASM)
        s = tl.sum(_dp4a((w >> 4) & M4, tl.load(xq_ptr + b3 * 8 + 4 + j), s, ASM), 2)  # (BK, BN)
        sx = tl.load(xs_ptr + 2 * b) + tl.load(xs_ptr + 2 * b + 1)
        d = tl.load(D + (b[:, None] * N + rows[None, :]).to(tl.int64)).to(tl.float32)
        acc += (s - 8 * sx[:, None]).to(tl.float32) * (d * tl.load(xd_ptr + b)[:, None])
    y = tl.sum(acc, 0)
    if SPLIT > 1:
        tl.atomic_add(out_ptr + rows, y, sem="relaxed")
    else:
        tl.store(out_ptr + rows, y)


def kmajor(w) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    qs = w.parts["qs"].reshape(n, k // 32, 16).transpose(0, 1).contiguous().view(torch.int32)  # (K/32, N, 4)
    d = w.parts["d"].t().contiguous()  # (K/32, N)
    return qs, d


def run(xa, qs, d, n, k, bn, bk, warps, split, out):
    blocks = k // 32
    per = blocks // split
    _kmajor_q4_0[(n // bn, split)](xa[0].view(torch.int32), xa[1], xa[2], out, qs, d, n, k, per,
                                   BN=bn, BK=bk, SPLIT=split, ASM=not triton_q8.INTERPRET, num_warps=warps)


def main() -> None:
    import sys

    sys.path.insert(0, "bench")
    from q8_tune import LAYERS, Q, QWeight, graph_time, random_weight
    from localllm.commands.bench import copy_bandwidth

    copy = copy_bandwidth(torch.device(DEV)) / 1e9
    print(f"copy {copy:.0f} GB/s")
    for name, n, k, _, _ in LAYERS["8B"]:
        _, base = random_weight(min(n, 2048), k, Q.Q4_0, seed=n + k)
        w = QWeight.cat([base] * (n // base.shape[0]))
        copies = max(1, (400 << 20) // w.nbytes)
        ws = [QWeight.cat([w]) for _ in range(copies)]
        km = [kmajor(x) for x in ws]
        x = torch.randn(1, k, device=DEV)
        xa = triton_q8.quantize_act(x)
        ref = triton_q8.gemv_q8(xa, w, act_dtype=torch.float32)
        base_us = graph_time(lambda: [triton_q8.gemv_q8(xa, v, act_dtype=torch.float32) for v in ws]) * 1e3 / copies
        res = {}
        for bn, bk, warps, split in itertools.product((32, 64, 128), (4, 8), (1, 2, 4), (1, 2, 4)):
            if (k // 32) % (bk * split) or n % bn or (n // bn) * split < 132:
                continue
            out = torch.zeros(1, n, device=DEV)
            try:
                run(xa, *km[0], n, k, bn, bk, warps, split, out)
                err = ((out - ref).norm() / ref.norm()).item()
                outs = [torch.zeros(1, n, device=DEV) for _ in km]
                us = graph_time(lambda: [run(xa, q, dd, n, k, bn, bk, warps, split, o) for (q, dd), o in zip(km, outs)])
                res[(bn, bk, warps, split)] = (us * 1e3 / copies, err)
            except Exception as e:  # noqa: BLE001
                print(f"  {(bn, bk, warps, split)}: {type(e).__name__} {str(e)[:120]}")
        best = sorted(res.items(), key=lambda kv: kv[1][0])[:5]
        print(f"{name} {n}x{k}: row-major {base_us:.1f} µs ({w.nbytes / base_us / 1e3 / copy:.0%}); K-major best: "
              + "; ".join(f"{c} {t:.1f} µs ({w.nbytes / t / 1e3 / copy:.0%}, err {e:.0e})" for c, (t, e) in best),
              flush=True)
        ws = km = None  # free the copies before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
