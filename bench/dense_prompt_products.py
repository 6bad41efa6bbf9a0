"""Dense prompt products alone (issue 20): the C++ blocked GEMM (kernels/cpu_gemm.cpp) against the path it
replaced, torch's fp32 GEMM on rows decoded to fp32 (an F32 weight's rows as they are), one thread.

    python bench/dense_prompt_products.py [--type F16 BF16 F32] [-T 256] [--shape 576,1536,4] [-r 5]

Random weights of each type shaped as SmolLM2-style layers (dim, ffn, layers: per layer q o (dim x dim),
k v (dim/3 x dim), gate up (ffn x dim), down (dim x ffn)), held as the runtime holds them
(huge_page_copy), x (T, K) fp32. Each round times one pass over all matrices by each path (process CPU
time, best of 2 passes), the two paths interleaved; prints GFLOP/s per round and the median of the
per-round ratios (GEMM / torch). The results agree to fp32 rounding (checked once per type).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch
import torch.nn.functional as F

from localllm.kernels.cpu import load_extension
from localllm.kernels.cpu_memory import huge_page_copy
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
DTYPES = {"F32": (Q.F32, torch.float32), "F16": (Q.F16, torch.float16), "BF16": (Q.BF16, torch.bfloat16)}


def matrices(dim: int, ffn: int, layers: int) -> list[tuple[int, int]]:
    return [(dim, dim), (dim // 3, dim), (dim // 3, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)] * layers


def best_pass(fn, ws, reps: int = 2) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        for w in ws:
            fn(*w)
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", nargs="+", default=["F16", "BF16", "F32"], choices=sorted(DTYPES))
    ap.add_argument("-T", "--tokens", type=int, default=256)
    ap.add_argument("--shape", default="576,1536,4")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ext = load_extension(DEFAULT_CPU.cache_dir)
    dim, ffn, layers = (int(v) for v in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    for name in args.type:
        qtype, dtype = DTYPES[name]
        ws = []
        for N, K in matrices(dim, ffn, layers):
            raw = huge_page_copy((torch.randn(N, K, generator=g) * 0.05).to(dtype).view(torch.uint8).reshape(N, -1))
            ws.append((raw, torch.randn(args.tokens, K, generator=g), N, K))
        flops = sum(2 * args.tokens * N * K for _, _, N, K in ws)

        def gemm(raw, x, N, K):
            return ext.dense_gemm(x, raw, int(qtype), N, K, 1)

        def torch_path(raw, x, N, K):
            w = raw.view(torch.float32) if qtype == Q.F32 else ext.dequantize(raw, int(qtype), N, K, False, 0, N, 1)
            return F.linear(x, w)

        raw, x, N, K = ws[-1]
        ref = x.double() @ ext.dequantize(raw, int(qtype), N, K, False, 0, N, 1).double().T
        err = max(((f(*ws[-1]).double() - ref).abs().max() / ref.abs().max()).item() for f in (gemm, torch_path))
        ratios = []
        for r in range(args.rounds):
            a, b = best_pass(torch_path, ws), best_pass(gemm, ws)
            ratios.append(a / b)
            print(f"{name} T={args.tokens} round {r + 1}: torch {flops / a / 1e9:.1f} GFLOP/s, "
                  f"GEMM {flops / b / 1e9:.1f} GFLOP/s, {a / b:.2f}x", flush=True)
        print(f"{name}: median {statistics.median(ratios):.2f}x (max relative error against fp64 {err:.1e})")


if __name__ == "__main__":
    main()
