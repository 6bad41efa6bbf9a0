"""The decode step's expert products alone (kernels/triton_moe.expert_products) on CUDA: time per call
and share of the copy bandwidth measured in the same run, over splits of K and tile configs.

    python bench/moe_products.py --shape gpt-oss-20b [--splits 1,2,4,8,16] [--configs 32x2x1,64x2x2]

A shape is (experts E, used k, model dim C, expert width F, gate/up type, down type); the weights are
random blocks (timing only: values do not matter). The bytes counted are the k chosen experts' rows,
what a decode token reads (gate|up: 2 F rows of C, down: C rows of F). Calls are captured in a CUDA
graph (--calls a replay) so launch time is not counted. Prints one row per (product, split, config).
"""

from __future__ import annotations

import argparse

import torch

from localllm.kernels import triton_moe
from localllm.kernels.qweight import INT_DOT_TYPES, Q, QWeight
from localllm.kernels.triton_quant_act import quantize_act
from localllm.quantize.formats import FORMATS

SHAPES = {  # E, k, C, F, gate/up type, down type (the presets' expert types at Q4_K_M / MXFP4_MOE)
    "gpt-oss-20b": (32, 4, 2880, 2880, "MXFP4", "MXFP4"),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "Q4_K", "Q6_K"),
    "qwen3-30b-a3b-q4k": (128, 8, 2048, 768, "Q4_K", "Q4_K"),
    "mixtral": (8, 2, 4096, 14336, "Q4_K", "Q6_K"),
}


def random_weight(rows: int, k: int, qtype: Q) -> QWeight:
    fmt = FORMATS[qtype]
    raw = torch.randint(0, 256, (rows, k // fmt.block * fmt.nbytes), dtype=torch.uint8, device="cuda")
    w = QWeight.from_raw(raw, qtype)
    return w.to_blocks() if qtype in INT_DOT_TYPES else w


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (read + write bytes / s), the roofline."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 20 / (start.elapsed_time(end) / 1e3) / 1e9


def time_call(fn, calls: int, sets: int) -> float:
    """Seconds a call: `calls` calls fn(i % sets) captured in one graph, replayed."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    p.add_argument("--splits", default="0,1,2,4,8,16", help="parts of K (0: the kernel's own choice)")
    p.add_argument("--configs", default="", help="BNxBKxWARPS,... (empty: the type's default)")
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--types", default="", help="GATE_UP,DOWN types instead of the shape's")
    a = p.parse_args()
    E, k, C, F, tg, td = SHAPES[a.shape]
    if a.types:
        tg, td = a.types.split(",")
    gbs = copy_gbs()
    print(f"{torch.cuda.get_device_name()}  copy {gbs:.0f} GB/s  shape {a.shape}: E={E} k={k} C={C} F={F}")
    t = a.tokens
    # E // k disjoint id sets, one per call in turn: the calls read every expert (more than L2 holds)
    perm = torch.randperm(E, device="cuda")
    id_sets = [perm[i * k:(i + 1) * k].sort().values.repeat(t).int() for i in range(E // k)]
    x = torch.randn(t, C, device="cuda", dtype=torch.bfloat16)
    hq = quantize_act(x)
    gu = random_weight(2 * E * F, C, Q[tg])
    dw = random_weight(E * C, F, Q[td])
    a_in = quantize_act(torch.randn(t * k, F, device="cuda", dtype=torch.bfloat16))
    gate_up = torch.zeros(t * k, 2 * F, dtype=torch.int64, device="cuda")
    down = torch.zeros(t * k, C, dtype=torch.int64, device="cuda")
    configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",") if c] or [None]
    cases = [("gate|up", tg, lambda s, c, i: triton_moe.expert_products(hq, gu, id_sets[i], gate_up, k, split=s, config=c,
                                                                       stacks=2), k * 2 * F * C),
             ("down", td, lambda s, c, i: triton_moe.expert_products(a_in, dw, id_sets[i], down, k, per_slot=True, split=s,
                                                                    config=c), k * C * F)]
    for name, qt, fn, values in cases:
        nbytes = values / FORMATS[Q[qt]].block * FORMATS[Q[qt]].nbytes
        for cfg in configs:
            for s in (int(v) for v in a.splits.split(",")):
                sec = time_call(lambda i: fn(s or None, cfg, i), a.calls, len(id_sets))
                print(f"{name:8s} {qt:6s} config {cfg or 'default'!s:14s} split {s or 'auto':>4}: "
                      f"{sec * 1e6:8.1f} us  {nbytes / sec / 1e9:7.0f} GB/s  {nbytes / sec / 1e9 / gbs:6.1%} of copy")


if __name__ == "__main__":
    main()
