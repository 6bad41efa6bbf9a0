"""Tensor-parallel decode speed on CUDA (issue 23): TP=1 against TP=2 on the same machine, in one run.

    python bench/tp_speed.py [--types bf16,Q4_K_M] [--steps 128] [--no-70b] [--json OUT.json]

(re-executes itself under torch's launcher with 2 processes, NVLink multicast off). Prints, per row:
shape, weight type, TP degree, the decode all-reduce (nccl: torch.distributed's NCCL all_reduce;
p2p: the one-shot symmetric-memory kernel, backends/cuda_tp.py), greedy decode tokens/s, and the
weight bandwidth it achieves (weight bytes of every rank's step x tokens/s) as a share of the cards'
copy bandwidth (one card for TP=1, both for TP=2), measured in the same run on each card. Rows:
llama-3.1-8b bf16 and Q4_K_M at TP=1 (rank 0's GPU alone) and TP=2 (nccl, p2p); llama-3.1-70b bf16
at TP=2 (it does not fit one card). Goals (issue 23): 8B TP=2 >= 1.6x TP=1; 70B TP=2 >= 70% of two
cards' copy bandwidth.

Weights are synthetic and each rank generates only its own shard (random per rank: speed only; the
correctness of TP=2 is tests/gpu/test_gpu_tp.py's, through files).
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

from localllm.config import ModelConfig  # noqa: E402
from localllm.footprint import weight_bytes_per_token  # noqa: E402
from localllm.backends.launch import from_launcher  # noqa: E402
from localllm.parallel import TensorParallel, launched, no_multicast_env  # noqa: E402
from localllm.registry import shape_preset  # noqa: E402

PROMPT = 16


def preset_70b() -> ModelConfig:
    """models.toml's llama-3.1-70b, or the same shape from the 8B's (80 layers, 8192 wide, 64 heads)."""
    try:
        return shape_preset("llama-3.1-70b")
    except Exception:
        return replace(shape_preset("llama-3.1-8b"), n_layers=80, dim=8192, ffn_dim=28672, n_heads=64, n_kv_heads=8)


def build(cfg: ModelConfig, wtype: str, tp: TensorParallel | None, seed: int):
    """CudaRuntime of this rank's shard, fused (q|k|v, gate/up) after the generated tensors are dropped
    (fusing while they are still referenced would hold a second copy)."""
    from localllm.backends.cuda import CudaRuntime, fuse
    from localllm.load import build_model

    class Unfused(CudaRuntime):
        prepare = staticmethod(lambda model: None)

    from localllm.synthetic import synthetic_state

    # this rank's shard only (per-rank random), dense tensors made in bf16 one at a time
    state = synthetic_state(cfg, wtype, "cuda", seed, tp=tp, dense_dtype=torch.bfloat16)[0]
    kw = {"tp": tp} if tp is not None else {}
    rt = build_model(cfg, state, "cuda", torch.bfloat16, backend=Unfused, **kw)
    state.clear()
    gc.collect()
    fuse(rt.model)
    return CudaRuntime(rt.model)


@torch.inference_mode()
def decode_rate(rt, steps: int) -> float:
    """Greedy tokens/s of the decode graph (one replay a token) after a 16-token prompt and 8 warm steps."""
    cache = rt.new_cache(PROMPT + steps + 16)
    ids = torch.randint(100, 1000, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    token = rt.prefill(cache, [ids])[0].argmax().view(1)
    for _ in range(8):
        token = rt.greedy_step(cache, token)
    torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
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


def run(args, tp: TensorParallel) -> list[dict]:
    rows = []
    bws = [None] * tp.world
    torch.distributed.all_gather_object(bws, copy_bw())  # both cards at once
    say = print if tp.rank == 0 else (lambda *a, **k: None)
    say(f"copy bandwidth per card (read + write): {', '.join(f'{b / 1e9:.0f} GB/s' for b in bws)}", flush=True)
    cfg8 = shape_preset("llama-3.1-8b")
    for wtype in args.types.split(","):
        if tp.rank == 0:  # TP=1: the whole model on GPU 0
            rt = build(cfg8, wtype, None, seed=0)
            tps = decode_rate(rt, args.steps)
            rows.append(row("llama-3.1-8b", wtype, 1, "-", tps, weight_bytes_per_token(rt.model), bws[0]))
            say(rows[-1], flush=True)
            del rt
            gc.collect()
            torch.cuda.empty_cache()
        torch.distributed.barrier()
        rt = build(cfg8, wtype, tp, seed=tp.rank)
        nbytes = summed(weight_bytes_per_token(rt.model))
        for reducer in ("nccl", "auto"):
            rt.all_reduce = reducer
            tps = decode_rate(rt, args.steps)
            rows.append(row("llama-3.1-8b", wtype, 2, rt.all_reduce, tps, nbytes, sum(bws)))
            say(rows[-1], flush=True)
            rt.decoders.clear()
            rt.prefill_graph = None
        del rt
        gc.collect()
        torch.cuda.empty_cache()
    if not args.no_70b:
        cfg70 = preset_70b()
        rt = build(cfg70, "bf16", tp, seed=tp.rank)
        nbytes = summed(weight_bytes_per_token(rt.model))
        for reducer in ("nccl", "auto"):
            rt.all_reduce = reducer
            tps = decode_rate(rt, max(16, args.steps // 4))
            rows.append(row("llama-3.1-70b", "bf16", 2, rt.all_reduce, tps, nbytes, sum(bws)))
            say(rows[-1], flush=True)
            rt.decoders.clear()
            rt.prefill_graph = None
    return rows


def report(rows: list[dict]) -> None:
    print(f"\n{'shape':15} {'type':7} {'tp':>2} {'all-reduce':>10} {'tok/s':>8} {'weights GB/s':>12} "
          f"{'copy GB/s':>9} {'share':>6}")
    for r in rows:
        print(f"{r['shape']:15} {r['type']:7} {r['tp']:>2} {r['all_reduce']:>10} {r['tokens_per_s']:>8} "
              f"{r['weight_GBps']:>12} {r['copy_GBps']:>9} {r['share_of_copy']:>6}")
    for wtype in {r["type"] for r in rows if r["shape"] == "llama-3.1-8b"}:
        one = [r["tokens_per_s"] for r in rows if r["type"] == wtype and r["tp"] == 1 and r["shape"] == "llama-3.1-8b"]
        two = [r for r in rows if r["type"] == wtype and r["tp"] == 2 and r["shape"] == "llama-3.1-8b"]
        for r in two:
            if one:
                print(f"8B {wtype}: TP=2 ({r['all_reduce']}) / TP=1 = {r['tokens_per_s'] / one[0]:.2f}x (goal >= 1.6x)")
    for r in rows:
        if r["shape"] == "llama-3.1-70b":
            print(f"70B bf16 TP=2 ({r['all_reduce']}): {100 * r['share_of_copy']:.0f}% of two cards' copy bandwidth "
                  "(goal >= 70%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="bf16,Q4_K_M")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--no-70b", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not launched():  # re-execute under torch's launcher, 2 processes
        env = no_multicast_env()
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    tp = from_launcher("cuda")
    try:
        rows = run(args, tp)
        if tp.rank == 0:
            report(rows)
            if args.json:
                Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
