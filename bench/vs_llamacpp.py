"""localllm against llama.cpp on the CPU: the same GGUF file, prompt length, thread count and token counts.

    python bench/vs_llamacpp.py [MODEL ...] [-t THREADS] [-p 512] [-n 128] [-r 3] [--cpu-time]

llama.cpp runs through llama-cpp-python, built from source into a cached virtual environment
(bench/llamacpp_env.py: several minutes the first time). Both sides are timed the way
llama-bench does: ppP = a P-token prompt into an empty context, tgN = N single-token steps from an
empty context (each step feeds the previous step's argmax), after one warm-up of each; the mean
over repetitions is printed, with the ratio localllm / llama.cpp. --cpu-time (with -t 1) times both
processes' CPU seconds instead of wall time: on a machine other jobs share, the work done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llamacpp_env import run_llamacpp
from localllm.load import load_model
from localllm.registry import resolve_model

# Runs inside the llama.cpp venv: argv = path, threads, prompt length, generated tokens, repetitions,
# 1 to time CPU seconds (else wall time).
LLAMA_CODE = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama

path, threads, p, n, reps, cpu = sys.argv[1], *map(int, sys.argv[2:])
clock = time.process_time if cpu else time.perf_counter
llm = Llama(model_path=path, n_ctx=p + n + 8, n_batch=p, n_ubatch=p, n_threads=threads,
            n_threads_batch=threads, verbose=False)
prompt = np.random.default_rng(0).integers(100, llm.n_vocab() - 100, p).tolist()

def pp():
    llm.reset()
    t = clock()
    llm.eval(prompt)
    return p / (clock() - t)

def tg():
    llm.reset()
    token = prompt[0]
    t = clock()
    for _ in range(n):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return n / (clock() - t)

pp(), tg()  # warm-up
print(json.dumps({"pp": [pp() for _ in range(reps)], "tg": [tg() for _ in range(reps)]}))
"""


def localllm_speeds(path: Path, threads: int, p: int, n: int, reps: int,
                    clock=time.perf_counter) -> dict[str, list[float]]:
    torch.set_num_threads(threads)
    rt = load_model(str(path), "cpu").runtime
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, rt.cfg.vocab_size - 100, (1, p), generator=g)
    cache = rt.new_cache(p + n + 8)

    @torch.inference_mode()
    def pp() -> float:
        t = clock()
        rt.forward(prompt, cache, 0, last_only=True)
        return p / (clock() - t)

    @torch.inference_mode()
    def tg() -> float:
        token, cache.length = prompt[0, :1], 0
        t = clock()
        for _ in range(n):
            token = rt.decode(cache, token).argmax(-1)
        return n / (clock() - t)

    pp(), tg()  # warm-up (and the C++ kernels' build, the first time)
    return {"pp": [pp() for _ in range(reps)], "tg": [tg() for _ in range(reps)]}


def llamacpp_speeds(path: Path, threads: int, p: int, n: int, reps: int,
                    cpu_time: bool = False) -> dict[str, list[float]]:
    out = run_llamacpp(LLAMA_CODE, str(path), str(threads), str(p), str(n), str(reps), str(int(cpu_time)))
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    from localllm.kernels.cpu import physical_cores

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=[None], help="GGUF files or model names (default: the default model)")
    ap.add_argument("-t", "--threads", type=int, default=physical_cores())
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true", help="time CPU seconds of each process (use with -t 1)")
    args = ap.parse_args()
    print(f"threads {args.threads}; tokens per {'CPU' if args.cpu_time else 'wall'} second, mean ± sd over "
          f"{args.reps} runs")
    print("| model | test | llama.cpp | localllm | ratio |\n| --- | --- | ---: | ---: | ---: |")
    for spec in args.models:
        path = resolve_model(spec)
        theirs = llamacpp_speeds(path, args.threads, args.prompt, args.gen, args.reps, args.cpu_time)
        ours = localllm_speeds(path, args.threads, args.prompt, args.gen, args.reps,
                               time.process_time if args.cpu_time else time.perf_counter)
        for key, name in (("pp", f"pp{args.prompt}"), ("tg", f"tg{args.gen}")):
            a, b = theirs[key], ours[key]
            ratio = statistics.mean(b) / statistics.mean(a)
            print(f"| {path.name} | {name} | {statistics.mean(a):.1f} ± {statistics.pstdev(a):.1f} "
                  f"| {statistics.mean(b):.1f} ± {statistics.pstdev(b):.1f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
