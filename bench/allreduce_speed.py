"""The decode step's all-reduce alone (issue 23): microseconds a reduction inside a CUDA graph, per kind.

    python bench/allreduce_speed.py [--kinds nccl,push-flags,push-ll] [--rows 1,16,64] [--cols 4096] [--rounds 3]

(re-executes itself under torch's launcher with 2 processes, NVLink multicast off). For each message of
(rows, cols) int64 (an 8B step's residual rows) and each reducer of backends/cuda_tp.py, one graph of 64
reductions in a row (take + reduce, as the decode graph captures them; the push reducer's two
protocols apart) is replayed 20 times; the rounds
alternate the kinds (drift shared alike) and the median of the rounds is printed, with the floor of 64
local kernels of the same size (kernels/triton_tp.add_fixed: what a reduction costs with no peer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localllm.backends.cuda_tp import make_reducer  # noqa: E402
from localllm.backends.launch import from_launcher  # noqa: E402
from localllm.kernels.triton_tp import LL_MAX, add_fixed  # noqa: E402
from localllm.parallel import launched, no_multicast_env  # noqa: E402

CHAIN = 64  # reductions a graph
REPLAYS = 20


def graph_us(body, tp) -> float:
    """Microseconds one call of body() takes, replayed CHAIN at a time in a graph (ranks start together)."""
    for _ in range(2):
        body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CHAIN):
            body()
    g.replay()
    torch.cuda.synchronize()
    torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    t0 = time.perf_counter()
    for _ in range(REPLAYS):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (REPLAYS * CHAIN) * 1e6


def measure(kind: str, rows: int, cols: int, tp) -> float:
    x = torch.zeros(rows, cols, dtype=torch.int64, device="cuda")
    kind, _, block = kind.partition("@")  # push-ll@256: programs of 256 values
    if kind == "push-ll" and rows * cols > LL_MAX:  # (LL's areas are sized for small messages only)
        return float("nan")
    if kind == "local":
        red = torch.zeros_like(x)
        return graph_us(lambda: add_fixed(x, red.add_(1)), tp)
    name = kind.split("-")[0]  # push-flags / push-ll: the push reducer
    r = make_reducer(tp, rows, cols, "cuda", name)
    assert r.name == name, f"{kind} fell back to {r.name}"
    if kind.startswith("push-"):  # push-flags / push-ll: that protocol whatever the size
        r.ll = kind == "push-ll"
    if block:
        r.block = int(block)

    def body():
        r.take().add_(1)  # the product's write (a local kernel, counted in the local floor too)
        r.reduce(x)

    us = graph_us(body, tp)
    r.check()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="nccl,push-flags,push-ll", help="reducers (push-flags / push-ll: "
                    "the push reducer with that protocol at every size; push: its own choice; @N: programs of N values)")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not launched():
        env = no_multicast_env()
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    tp = from_launcher("cuda")
    kinds = ["local"] + args.kinds.split(",")
    for rows in [int(r) for r in args.rows.split(",")]:
        got = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                got[k].append(measure(k, rows, args.cols, tp))
        if tp.rank == 0:
            med = {k: statistics.median(v) for k, v in got.items()}
            print(f"rows {rows:3} x {args.cols}: " + "  ".join(f"{k} {med[k]:6.2f} us" for k in kinds)
                  + "  (local: with the product's add; others: add + reduction)", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
