"""The C++ dense row products alone, at one token (decode): a model's matrices, one thread.

    python bench/dense_products.py [--type F16] [--shape 576,1536,30,49152] [-r 5]

Makes random weights of the given type shaped as a SmolLM2-style model (dim, ffn, layers, vocab:
per layer q o (dim x dim), k v (dim/3 x dim), gate up (ffn x dim), down (dim x ffn), then the
vocabulary head), more bytes than any cache, held as the runtime holds them (kernels/cpu_memory.py
huge_page_copy; --plain-pages: torch's allocation), and times one pass over all of them through the
extension's qmatmul (x of one row, threads 1): ms a pass (process CPU time, the best of -r) and
the weight bytes streamed a second. No model file is read; the kernels build under ~/.cache/localllm.
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from localllm.kernels.cpu import load_extension
from localllm.kernels.cpu_memory import huge_page_copy
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
DTYPES = {"F32": (Q.F32, torch.float32), "F16": (Q.F16, torch.float16), "BF16": (Q.BF16, torch.bfloat16)}


def matrices(shape: tuple[int, int, int, int]) -> list[tuple[int, int]]:
    C, F, L, V = shape
    per_layer = [(C, C), (C // 3, C), (C // 3, C), (C, C), (F, C), (F, C), (C, F)]
    return per_layer * L + [(V, C)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="F16", choices=sorted(DTYPES))
    ap.add_argument("--shape", default="576,1536,30,49152")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--plain-pages", action="store_true", help="torch's allocation (4 KiB pages), not huge_page_copy")
    args = ap.parse_args()
    ext = load_extension(DEFAULT_CPU.cache_dir)
    qtype, dtype = DTYPES[args.type]
    g = torch.Generator().manual_seed(0)
    ws = []
    for N, K in matrices(tuple(int(v) for v in args.shape.split(","))):
        w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
        raw = w.view(torch.uint8).reshape(N, -1).contiguous()
        ws.append((raw if args.plain_pages else huge_page_copy(raw), torch.randn(1, K, generator=g), N, K))
    nbytes = sum(w.numel() for w, *_ in ws)
    best = float("inf")
    for _ in range(args.reps + 1):  # the first pass warms up
        t = time.process_time()
        for w, x, N, K in ws:
            ext.qmatmul(x, w, int(qtype), N, K, False, 1)
        best = min(best, time.process_time() - t)
    print(f"{args.type}: {best * 1e3:.1f} ms a pass, {nbytes / 1e6:.0f} MB, {nbytes / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
