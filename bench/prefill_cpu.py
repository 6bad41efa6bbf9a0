"""Is a CUDA prefill bound by the host? Time to enqueue it (the call returning, no sync) against the
time to finish it, for a synthetic model after a decode graph exists (as in `localllm bench`), and
the top Python functions by own time (cProfile).

    python bench/prefill_cpu.py [--preset llama-3.1-8b] [--type bf16] [-p 512]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from localllm.cache import make_cache
from localllm.generate import decode_one, prefill
from localllm.registry import shape_preset
from localllm.synthetic import synthetic_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--type", default="bf16")
    ap.add_argument("-p", type=int, default=512)
    args = ap.parse_args()
    cfg = shape_preset(args.preset)
    model, _ = synthetic_model(cfg, args.type, "cuda", torch.bfloat16)
    cache = make_cache(cfg, args.p + 129, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (args.p,)).tolist()
    for _ in range(3):
        cache.length = 0
        tok = prefill(model, cache, ids).argmax()
        for _ in range(4):
            tok = decode_one(model, cache, tok).argmax()
    torch.cuda.synchronize()
    for _ in range(5):
        cache.length = 0
        t0 = time.perf_counter()
        logits = prefill(model, cache, ids)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"enqueue {1e3 * (t1 - t0):.2f} ms, finish {1e3 * (t2 - t0):.2f} ms", flush=True)
    cache.length = 0
    prof = cProfile.Profile()
    prof.enable()
    prefill(model, cache, ids)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    from localllm.commands.bench import one_run

    for n in (0, 2, 128):  # as `localllm bench` times it: prefill right after the previous run's decode
        print(f"one_run -n {n}: prefill ms", [round(1e3 * one_run(model, args.p, n, 0, cache, seed=s)[0], 2)
                                             for s in range(4)], flush=True)
    del logits


if __name__ == "__main__":
    main()
