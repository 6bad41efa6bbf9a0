"""Aggregate decode speed of B sequences decoded together (Runtime.decode_slots: `serve`'s continuous
batching step), against llama.cpp's batched decode (one llama_decode over B sequences of one context,
as llama-server runs its slots) on the same GGUF file and thread count.

    python bench/serve_batch.py [MODEL] [-b 1 4 16] [-t THREADS] [-p 64] [-n 32] [-r 3] [--cpu-time] [--no-llamacpp]
    python bench/serve_batch.py --device cuda --synthetic llama-3.1-8b --type Q4_K_M -b 1 4 16 64

Each side: B slots each prefilled with its own P-token prompt, then N steps in which every slot feeds
its previous argmax; the figure is B * N / the steps' wall time (generated tokens per second, all
streams together). Rounds alternate localllm and llama.cpp (llama-cpp-python, bench/llamacpp_env.py);
the median over rounds of each side and of the per-round ratio is printed. --cpu-time (with -t 1) times
both processes' CPU seconds instead of wall time: on a machine other jobs share, the work done.
--device cuda: CudaRuntime.decode_slots (backends/cuda_slots.py: a graph per bucket of slot counts;
each B's graph is captured by untimed steps first); llama.cpp's side here is its CPU build, so it is
left out, and each B's figure is also given as a multiple of B = 1's (issue 22: 64 streams >= 10x one).
--synthetic PRESET --type T: random weights of a models.toml shape preset (localllm/synthetic.py, as
`localllm bench --synthetic` builds them) instead of a file (no llama.cpp side either).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llamacpp_env import run_llamacpp
from localllm.device import pick_dtype
from localllm.load import load_model
from localllm.registry import resolve_model, shape_preset
from localllm.synthetic import synthetic_model

# Runs inside the llama.cpp venv: argv = path, threads, prompt length, steps, batch sizes (JSON), 1 to
# time CPU seconds (else wall time).
# Prints {B: tokens/s}.
LLAMA_CODE = r"""
import json, sys, time
import numpy as np
import llama_cpp as L

path, threads, p, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
batches = json.loads(sys.argv[5])
clock = time.process_time if int(sys.argv[6]) else time.perf_counter
L.llama_backend_init()
quiet = L.llama_log_callback(lambda *a: None)  # (kept referenced: llama.cpp calls it later)
L.llama_log_set(quiet, None)
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
out = {}
for B in batches:
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = B * (p + n + 8), B, True
    cp.n_batch = cp.n_ubatch = max(p, B)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(max(p, B), 0, 1)

    def put(i, token, pos, seq, logits):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
        batch.seq_id[i][0] = seq

    def argmax(i):
        return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(nv,))))

    rng = np.random.default_rng(0)
    last = []
    for s in range(B):  # each slot's prompt, one decode each
        prompt = rng.integers(100, nv - 100, p).tolist()
        for i, t in enumerate(prompt):
            put(i, t, i, s, i == p - 1)
        batch.n_tokens = p
        assert L.llama_decode(ctx, batch) == 0
        last.append(argmax(p - 1))
    t0 = clock()
    for step in range(n):
        for s in range(B):
            put(s, last[s], p + step, s, True)
        batch.n_tokens = B
        assert L.llama_decode(ctx, batch) == 0
        last = [argmax(s) for s in range(B)]
    out[B] = B * n / (clock() - t0)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
print(json.dumps(out))
"""


@torch.inference_mode()
def localllm_speed(rt, B: int, p: int, n: int, clock=time.perf_counter, warm: int = 0) -> float:
    """warm: untimed steps first (CUDA: the bucket's graph capture)."""
    slots = rt.new_slots(B, p + n + warm + 8)
    g = torch.Generator().manual_seed(0)
    last = []
    for s in range(B):
        prompt = torch.randint(100, rt.cfg.vocab_size - 100, (p,), generator=g).tolist()
        last.append(int(rt.prefill_slot(slots, s, prompt, 0).argmax()))
    which, tokens = list(range(B)), torch.tensor(last, device=rt.device)
    for _ in range(warm):
        tokens = rt.decode_slots(slots, which, tokens).argmax(-1)
    rt.sync()
    t0 = clock()
    for _ in range(n):
        tokens = rt.decode_slots(slots, which, tokens).argmax(-1)
    rt.sync()
    return B * n / (clock() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF path or models.toml name (default model)")
    ap.add_argument("-b", "--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("-p", "--prompt", type=int, default=64)
    ap.add_argument("-n", "--steps", type=int, default=32)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true", help="time CPU seconds, not wall time (with -t 1)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--synthetic", metavar="PRESET", help="random weights of a models.toml shape preset")
    ap.add_argument("--type", default="Q4_K_M", help="weight type of --synthetic (as `localllm bench --type`)")
    ap.add_argument("--dense-rows", type=int, nargs="+", default=None, metavar="N",
                    help="CUDA: the runtime's dense_decode_rows (settings.GpuSettings), each value in every "
                         "round, alternated (0: the batch-invariant kernels at every bucket)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.synthetic:
        rt, _ = synthetic_model(shape_preset(args.synthetic), args.type, args.device, pick_dtype(args.device))
        name = f"{args.synthetic} {args.type} (synthetic)"
    else:
        path = Path(resolve_model(args.model))
        rt, name = load_model(str(path), args.device).runtime, path.name
    if args.synthetic or args.device != "cpu":
        args.no_llamacpp = True  # no file, or llama.cpp's CPU build against a GPU
    warm = 2 if args.device != "cpu" else 0
    localllm_speed(rt, 2, 8, 2)  # warm-up (rope tables, first-touch of the kernels, compiles)
    if args.dense_rows:
        return dense_rounds(rt, args, clock, warm)
    ours: dict[int, list[float]] = {b: [] for b in args.batches}
    theirs: dict[int, list[float]] = {b: [] for b in args.batches}
    for r in range(args.rounds):
        for b in args.batches:
            ours[b].append(localllm_speed(rt, b, args.prompt, args.steps, clock, warm))
        if not args.no_llamacpp:
            got = json.loads(run_llamacpp(LLAMA_CODE, str(path), str(args.threads), str(args.prompt),
                                          str(args.steps), json.dumps(args.batches), str(int(args.cpu_time))))
            for b in args.batches:
                theirs[b].append(got[str(b)])
        print(f"round {r + 1}: " + "  ".join(
            f"B={b} {ours[b][-1]:.1f}" + (f"/{theirs[b][-1]:.1f}" if theirs[b] else "") for b in args.batches),
            flush=True)
    where = f"{args.threads} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"{name}, {where}, prompt {args.prompt}, {args.steps} steps; aggregate tok/s (median)")
    one = statistics.median(ours[args.batches[0]])
    for b in args.batches:
        line = f"B={b:3d}  localllm {statistics.median(ours[b]):8.1f}"
        if args.no_llamacpp:
            line += f"  x{statistics.median(ours[b]) / one:.2f} of B={args.batches[0]}"
        if theirs[b]:
            ratio = statistics.median(o / t for o, t in zip(ours[b], theirs[b]))
            line += f"  llama.cpp {statistics.median(theirs[b]):8.1f}  ratio {ratio:.2f}"
        print(line)


def dense_rounds(rt, args, clock, warm: int) -> None:
    """Each --dense-rows value in every round, alternated; medians, and each value's ratio to the first
    value's by round (median)."""
    got = {(d, b): [] for d in args.dense_rows for b in args.batches}
    for r in range(args.rounds):
        for d in args.dense_rows:
            rt.dense_decode_rows = d
            for b in args.batches:
                got[d, b].append(localllm_speed(rt, b, args.prompt, args.steps, clock, warm))
            print(f"round {r + 1} dense_rows {d}: " + "  ".join(f"B={b} {got[d, b][-1]:.1f}" for b in args.batches),
                  flush=True)
    print(f"{torch.cuda.get_device_name()}, prompt {args.prompt}, {args.steps} steps; aggregate tok/s (median)")
    first = args.dense_rows[0]
    for d in args.dense_rows:
        one = statistics.median(got[d, args.batches[0]])
        for b in args.batches:
            ratio = statistics.median(x / y for x, y in zip(got[d, b], got[first, b]))
            print(f"dense_rows {d:3d} B={b:3d}  {statistics.median(got[d, b]):8.1f}  x{statistics.median(got[d, b]) / one:.2f}"
                  f" of B={args.batches[0]}  x{ratio:.2f} of dense_rows {first}")


if __name__ == "__main__":
    main()
