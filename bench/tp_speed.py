"""Tensor-parallel decode speed on CUDA (issue 23): TP=1 against TP=2 on the same machine, in one run.

    python bench/tp_speed.py [--rows 8b-bf16-tp1,8b-bf16-tp2,8b-Q4_K_M-tp1,8b-Q4_K_M-tp2,70b-bf16-tp2]
        [--reducers nccl,auto] [--steps 128] [--row-limit 150] [--limit 330] [--json OUT.json]

(re-executes itself under torch's launcher with 2 processes, NVLink multicast off). Prints, per row:
shape, weight type, TP degree, the decode all-reduce (nccl: torch.distributed's NCCL all_reduce;
push: the symmetric-memory kernel, backends/cuda_tp.py), greedy decode tokens/s, and the
weight bandwidth it achieves (weight bytes of every rank's step x tokens/s) as a share of the cards'
copy bandwidth (one card for TP=1, both for TP=2), measured in the same run on each card. Rows (--rows,
any subset, in the order given): llama-3.1-8b bf16 and Q4_K_M at TP=1 (each rank its own whole model on
its own GPU at the same time: rank 0's figure is the row, rank 1's is printed beside it) and TP=2 (one
build, each --reducers value in turn); llama-3.1-70b bf16 at TP=2 (it does not fit one card).
Goals (issue 23): 8B TP=2 >= 1.6x TP=1; 70B TP=2 >= 70% of two cards' copy bandwidth.

Every phase (weights, load + fuse, prefill, first step = kernel compilation + graph capture, warm steps,
timed decode) prints its seconds on rank 0 as it ends; a watchdog (bench/tp_watchdog.py) ends the run
with exit status 3 and every rank's row, phase and Python stacks when a row passes --row-limit seconds
or the run --limit: nothing stalls silently.

Weights are synthetic and each rank generates only its own shard (random per rank: speed only; the
correctness of TP=2 is tests/gpu/test_gpu_tp*.py's, through files); quantized weights are random valid
blocks (synthetic.RandomBlocks: no quantizing, which took minutes a row).
Before 2026-11-27's fifth session decode_rate's barrier also ran in rank 0's TP=1 row, a collective rank
1 did not match: every later collective paired with the wrong one, and the TP=2 row hung.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from localllm.config import ModelConfig  # noqa: E402
from localllm.footprint import weight_bytes_per_token  # noqa: E402
from localllm.backends.launch import from_launcher  # noqa: E402
from localllm.parallel import TensorParallel, launched, no_multicast_env  # noqa: E402
from localllm.registry import shape_preset  # noqa: E402
from tp_watchdog import Watchdog  # noqa: E402

PROMPT = 16
ROWS = ("8b-bf16-tp1", "8b-bf16-tp2", "8b-Q4_K_M-tp1", "8b-Q4_K_M-tp2", "70b-bf16-tp2")
SHAPES = {"8b": "llama-3.1-8b", "70b": "llama-3.1-70b"}


def preset_70b() -> ModelConfig:
    """models.toml's llama-3.1-70b, or the same shape from the 8B's (80 layers, 8192 wide, 64 heads)."""
    try:
        return shape_preset("llama-3.1-70b")
    except Exception:
        return replace(shape_preset("llama-3.1-8b"), n_layers=80, dim=8192, ffn_dim=28672, n_heads=64, n_kv_heads=8)


def parse_row(name: str) -> tuple[str, str, int]:
    """'8b-Q4_K_M-tp2' -> ('llama-3.1-8b', 'Q4_K_M', 2)."""
    if name not in ROWS:
        raise SystemExit(f"error: unknown row {name!r}: one of {', '.join(ROWS)}")
    shape, rest = name.split("-", 1)
    wtype, tp = rest.rsplit("-tp", 1)
    return SHAPES[shape], wtype, int(tp)


def build(cfg: ModelConfig, wtype: str, tp: TensorParallel | None, seed: int, wd: Watchdog):
    """CudaRuntime of this rank's shard (tp None: the whole model), fused (q|k|v, gate/up) after the
    generated tensors are dropped (fusing while they are still referenced would hold a second copy)."""
    from localllm.backends.cuda import CudaRuntime, fuse
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    class Unfused(CudaRuntime):
        prepare = staticmethod(lambda model: None)

    with wd.phase("weights"):  # dense tensors made in bf16 one at a time; quantized: random blocks
        state = synthetic_state(cfg, wtype, "cuda", seed, tp=tp, dense_dtype=torch.bfloat16, random_blocks=True)[0]
        torch.cuda.synchronize()
    with wd.phase("load + fuse"):
        kw = {"tp": tp} if tp is not None else {}
        rt = build_model(cfg, state, "cuda", torch.bfloat16, backend=Unfused, **kw)
        state.clear()
        gc.collect()
        fuse(rt.model)
        torch.cuda.synchronize()
    return CudaRuntime(rt.model)


@torch.inference_mode()
def decode_rate(rt, steps: int, wd: Watchdog) -> float:
    """Greedy tokens/s of the decode graph (one replay a token) after a 16-token prompt and 4 warm steps.
    A tensor-parallel runtime's ranks start the timed steps together (a barrier: theirs only, never in
    a TP=1 row, whose ranks run alone)."""
    with wd.phase("prefill"):
        cache = rt.new_cache(PROMPT + steps + 16)
        ids = torch.randint(100, 1000, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
        token = rt.prefill(cache, [ids])[0].argmax().view(1)
        torch.cuda.synchronize()
    with wd.phase("first step (kernel compilation, graph capture)"):
        token = rt.greedy_step(cache, token)
        torch.cuda.synchronize()
    with wd.phase("warm steps"):
        for _ in range(3):
            token = rt.greedy_step(cache, token)
        torch.cuda.synchronize()
        if rt.model.tp is not None:
            torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    with wd.phase(f"timed decode ({steps} steps)"):
        t0 = time.perf_counter()
        for _ in range(steps):
            token = rt.greedy_step(cache, token)
        torch.cuda.synchronize()
        return steps / (time.perf_counter() - t0)


def copy_bw() -> float:
    from localllm.backends.measure import copy_bandwidth

    return copy_bandwidth(torch.device("cuda"))


def row(shape, wtype, tp_n, reducer, tps, step_bytes, bw) -> dict:
    gbs = step_bytes * tps / 1e9
    return {"shape": shape, "type": wtype, "tp": tp_n, "all_reduce": reducer, "tokens_per_s": round(tps, 1),
            "weight_GBps": round(gbs, 1), "copy_GBps": round(bw / 1e9, 1), "share_of_copy": round(gbs * 1e9 / bw, 3)}


def summed(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    torch.distributed.all_reduce(t)
    return float(t.item())


def gathered(x) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def free(rt) -> None:
    if rt is not None:
        rt.decoders.clear()
        rt.prefill_graph = None
    gc.collect()
    torch.cuda.empty_cache()


def run_row(name: str, args, tp: TensorParallel, bws: list[float], wd: Watchdog) -> list[dict]:
    """One --rows entry on every rank (the same collectives in the same order on each)."""
    shape, wtype, n = parse_row(name)
    cfg = preset_70b() if shape == "llama-3.1-70b" else shape_preset(shape)
    steps = args.steps if shape != "llama-3.1-70b" else max(16, args.steps // 4)
    wd.enter_row(name, args.row_limit * (2 if shape == "llama-3.1-70b" else 1))
    out = []
    if n == 1:  # every rank its own whole model on its own GPU, at the same time: no collective inside
        rt = build(cfg, wtype, None, seed=0, wd=wd)
        tps = decode_rate(rt, steps, wd)
        nbytes = weight_bytes_per_token(rt.model)
        free(rt)
        del rt
        free(None)
        every = gathered(tps)
        out.append(row(shape, wtype, 1, "-", every[0], nbytes, bws[0]))
        wd.say(f"{out[-1]}  (GPU 1 alone at the same time: {every[1]:.1f} tokens/s)")
        return out
    rt = build(cfg, wtype, tp, seed=tp.rank, wd=wd)
    nbytes = summed(weight_bytes_per_token(rt.model))
    for reducer in args.reducers.split(","):
        wd.enter_row(f"{name} {reducer}", args.row_limit * (2 if shape == "llama-3.1-70b" else 1))
        rt.all_reduce = reducer
        tps = decode_rate(rt, steps, wd)
        out.append(row(shape, wtype, n, rt.all_reduce, tps, nbytes, sum(bws)))
        wd.say(str(out[-1]))
        free(rt)
    del rt
    free(None)
    return out


def report(rows: list[dict]) -> None:
    print(f"\n{'shape':15} {'type':7} {'tp':>2} {'all-reduce':>10} {'tok/s':>8} {'weights GB/s':>12} "
          f"{'copy GB/s':>9} {'share':>6}")
    for r in rows:
        print(f"{r['shape']:15} {r['type']:7} {r['tp']:>2} {r['all_reduce']:>10} {r['tokens_per_s']:>8} "
              f"{r['weight_GBps']:>12} {r['copy_GBps']:>9} {r['share_of_copy']:>6}")
    for wtype in sorted({r["type"] for r in rows if r["shape"] == "llama-3.1-8b"}):
        one = [r["tokens_per_s"] for r in rows if r["type"] == wtype and r["tp"] == 1 and r["shape"] == "llama-3.1-8b"]
        two = [r for r in rows if r["type"] == wtype and r["tp"] == 2 and r["shape"] == "llama-3.1-8b"]
        for r in two:
            if one:
                print(f"8B {wtype}: TP=2 ({r['all_reduce']}) / TP=1 = {r['tokens_per_s'] / one[0]:.2f}x (goal >= 1.6x)")
    for r in rows:
        if r["shape"] == "llama-3.1-70b":
            print(f"70B bf16 TP=2 ({r['all_reduce']}): {100 * r['share_of_copy']:.0f}% of two cards' copy bandwidth "
                  "(goal >= 70%)")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--reducers", default="nccl,auto", help="TP=2 rows' all-reduces (backends/cuda_tp.REDUCERS)")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps (70B: a quarter, >= 16)")
    ap.add_argument("--row-limit", type=float, default=150.0, help="seconds a row may take (70B: twice)")
    ap.add_argument("--limit", type=float, default=330.0, help="seconds the whole run may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    for name in names:
        parse_row(name)
    if not launched():  # re-execute under torch's launcher, 2 processes
        env = no_multicast_env()
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    wd = Watchdog(int(os.environ["RANK"]), args.row_limit, args.limit)
    wd.enter_row("set-up")
    with wd.phase("process group"):
        tp = from_launcher("cuda")
    rows = []
    try:
        with wd.phase("copy bandwidth (both cards at once)"):
            bws = gathered(copy_bw())
        wd.say(f"copy bandwidth per card (read + write): {', '.join(f'{b / 1e9:.0f} GB/s' for b in bws)}")
        for name in names:
            rows += run_row(name, args, tp, bws, wd)
        wd.enter_row("done")
        if tp.rank == 0:
            report(rows)
            if args.json:
                Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
