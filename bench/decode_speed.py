"""Decode and prefill speed of a model on one device, through the same library calls as `complete`.

    python bench/decode_speed.py [MODEL] [--device cpu] [--dtype float16] [-p 32] [-n 128] [-r 3]

Prints prompt tokens/s and generated tokens/s (mean and spread over repetitions), the achieved weight
bandwidth (bytes of weights read per generated token x tokens/s) and, as the roofline, the memory
bandwidth of a large copy measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from localllm.backends.measure import copy_bandwidth
from localllm.footprint import weight_bytes_per_token
from localllm.generate import Stats, generate
from localllm.runner import open_model
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings


def run_once(lm, prompt_len: int, n_gen: int) -> Stats:
    rt = lm.runtime
    cache = rt.new_cache(prompt_len + n_gen + 1)
    prompt = [int(x) for x in torch.randint(100, lm.config.vocab_size - 100, (prompt_len,))]
    stats = Stats()
    # No stop ids: always generate exactly n_gen tokens.
    for _ in generate(rt, cache, prompt, Sampler(SamplingSettings(temperature=0), rt.device), n_gen, (), stats):
        pass
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("-p", "--prompt", type=int, default=32)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = open_model(args.model, args.device, args.dtype)
    run_once(lm, 8, 4)  # warm-up
    runs = [run_once(lm, args.prompt, args.gen) for _ in range(args.reps)]
    tg = [s.generate_tps() for s in runs]
    pp = [s.prompt_tps() for s in runs]
    rt = lm.runtime
    bw = copy_bandwidth(rt.device)
    wb = weight_bytes_per_token(rt.model)
    mean_tg = statistics.mean(tg)
    print(f"model {lm.path.name} | device {rt.device} | dtype {rt.dtype} | threads {torch.get_num_threads()}")
    print(f"pp{args.prompt}: {statistics.mean(pp):.1f} ± {statistics.pstdev(pp):.1f} tokens/s")
    print(f"tg{args.gen}: {mean_tg:.1f} ± {statistics.pstdev(tg):.1f} tokens/s (runs: {', '.join(f'{x:.1f}' for x in tg)})")
    print(
        f"weights {wb / 1e6:.0f} MB/token -> {wb * mean_tg / 1e9:.1f} GB/s read; "
        f"copy roofline {bw / 1e9:.1f} GB/s (read+write) = {wb * mean_tg / bw:.0%} of it"
    )


if __name__ == "__main__":
    main()
