"""The fused quantized prompt GEMM (kernels/triton_qgemm.qgemm) over a sweep of launch configurations,
against the path it would replace (kernels/linear.dequant_product: block-major decode to bf16, then
cuBLAS) and cuBLAS on dense bf16 weights, on llama-3.1-8b's layer products (issue 20).

    python bench/qgemm_sweep.py [--m 512 2048] [--types Q8_0,Q4_0,Q4_K,Q6_K] [--quick] [--json FILE]

Weights: synthetic.RandomBlocks (random valid blocks; timing does not depend on the values). Each cell:
% of the peak measured in this run (cuBLAS bf16, 8192^3); "layer": the four products' summed times as one
rate (a layer's linear work at that M). Configs a type cannot launch (too much shared memory) show "-".
Check: max |fused - decode + cuBLAS| / max |decode + cuBLAS| over every cell of a config (bf16 outputs:
~1e-2 is a rounding difference, ~1 a wrong product). Whole run ~2-3 minutes on an H100 (--quick: one
config, M 512). Configs compile in --jobs processes first (Triton's disk cache), then run here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import gguf
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from localllm.kernels import linear, triton_qgemm
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_qgemm import Config
from localllm.synthetic import RANDOM_BLOCK_TYPES, RandomBlocks
from prompt_products import SHAPES, random_weight, tflops

Q = gguf.GGMLQuantizationType
# (bm, bn, steps (BK = 128 steps), warps, stages, w_first): the default first. W@xT keeps a warpgroup (4
# warps) a 64-row slice of bn: other ratios decode through shared memory (read in the compiled IR)
SWEEP = [Config(), Config(stages=4), Config(stages=2), Config(steps=2), Config(bm=256), Config(bm=256, stages=2),
         Config(bn=64, warps=4), Config(bn=64, warps=4, stages=2), Config(bm=64, bn=64, warps=4),
         Config(bm=256, bn=64, warps=4, stages=2), Config(bn=256, warps=16), Config(w_first=False)]


def weight(qtype, n: int, k: int) -> QWeight:
    if qtype not in RANDOM_BLOCK_TYPES:  # MXFP4: random bytes, every exponent 2^-7
        w = random_weight(qtype, n, k)
        w.parts["e"].fill_(120)
        return w
    raw = RandomBlocks("cuda", torch.Generator("cuda").manual_seed(n + k)).get(n, k, qtype)
    return QWeight.from_raw(raw, qtype).to_blocks()


def name(c: Config) -> str:
    return f"{c.bm}x{c.bn}x{128 * c.steps} w{c.warps} s{c.stages} {'W@xT' if c.w_first else 'x@WT'}"


def warm(job: tuple[str, Config]) -> str:
    """Compile one (type, config) in a worker: a small product of the same specialization (sizes are not
    specialized; every stride and N divisible by 16, as the 8B shapes')."""
    qtype, cfg = Q[job[0]], job[1]
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        triton_qgemm.qgemm(x, weight(qtype, 256, 4096), config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 (too much shared memory for this type: reported in the table)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def precompile(types: list[str], sweep: list[Config], jobs: int) -> dict:
    jobs_list = [(t, c) for t in types for c in sweep]
    if jobs <= 1:
        return dict(zip(jobs_list, map(warm, jobs_list)))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(jobs_list, pool.map(warm, jobs_list)))


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40)


def measure_peak() -> float:
    """cuBLAS bf16 on an 8192^3 product, TFLOP/s: the peak every figure is a share of."""
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return tflops(8192, 8192, 8192, bench(lambda: big @ big))


def sweep_type(qtype, ms: list[int], sweep: list[Config], peak: float, errors: dict) -> list[dict]:
    """Rows of one type: per (shape, M) the two baselines and every config."""
    rows = []
    for pname, (n, k) in SHAPES.items():
        w = weight(qtype, n, k)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = linear.dequant_product(x, w)
            base = dict(type=qtype.name, shape=pname, n=n, k=k, m=m)
            for path, fn in (("cublas_bf16", lambda: F.linear(x, dense)),
                             ("dequant_cublas", lambda: linear.dequant_product(x, w))):
                t = bench(fn)
                rows.append(base | dict(path=path, ms=t, tflops=tflops(m, n, k, t), pct=100 * tflops(m, n, k, t) / peak))
            for cfg in sweep:
                row = base | dict(path="fused", config=asdict(cfg))
                if errors.get((qtype.name, cfg)):
                    rows.append(row | dict(error=errors[(qtype.name, cfg)]))
                    continue
                try:
                    y = triton_qgemm.qgemm(x, w, config=cfg)
                    t = bench(lambda: triton_qgemm.qgemm(x, w, config=cfg))
                except Exception as e:  # noqa: BLE001
                    rows.append(row | dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                    continue
                diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                rows.append(row | dict(ms=t, tflops=tflops(m, n, k, t), pct=100 * tflops(m, n, k, t) / peak,
                                       rel_diff=diff))
    return rows


def layer_pct(rows: list[dict], m: int, peak: float) -> float | None:
    """The four products' summed time at M as a share of the peak (None if any is missing)."""
    cells = [r for r in rows if r["m"] == m and "ms" in r]
    if len(cells) != len(SHAPES):
        return None
    flops = sum(2 * m * r["n"] * r["k"] for r in cells)
    return 100 * flops / sum(r["ms"] for r in cells) / 1e9 / peak


def print_table(qtype: str, rows: list[dict], ms: list[int], sweep: list[Config], peak: float) -> None:
    cols = [(p, m) for m in ms for p in SHAPES]
    head = " | ".join(f"{p} M{m}" for p, m in cols) + " | " + " | ".join(f"layer M{m}" for m in ms)
    print(f"\n{qtype} (% of the {peak:.0f} TFLOP/s peak)\n| path | {head} | max|d|/max|y| |")
    print("| --- |" + " ---: |" * (len(cols) + len(ms) + 1))
    labels = [("cublas_bf16", None, "bf16 cuBLAS (dense)"), ("dequant_cublas", None, "decode + cuBLAS (now)")]
    labels += [("fused", asdict(c), "fused " + name(c)) for c in sweep]
    for path, cfg, label in labels:
        mine = [r for r in rows if r["path"] == path and r.get("config") == cfg]
        cells = []
        for p, m in cols:
            r = next((r for r in mine if r["shape"] == p and r["m"] == m), {})
            cells.append(f"{r['pct']:.1f}" if "pct" in r else "-")
        for m in ms:
            v = layer_pct([r for r in mine if r["m"] == m], m, peak)
            cells.append("-" if v is None else f"**{v:.1f}**")
        diffs = [r["rel_diff"] for r in mine if "rel_diff" in r]
        cells.append(f"{max(diffs):.1e}" if diffs else "")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    errs = {r["error"] for r in rows if "error" in r}
    for e in sorted(errs):
        print(f"  (-: {e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--quick", action="store_true", help="the default config only, M 512: a smoke run")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the configs first (1: none)")
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    sweep, ms = ([SWEEP[0]], [512]) if a.quick else (SWEEP, a.m)
    types = a.types.split(",")
    t0 = time.time()
    errors = precompile(types, sweep, a.jobs)
    print(f"compiled {len(errors)} (type, config) pairs in {time.time() - t0:.0f} s", file=sys.stderr)
    peak = measure_peak()
    print(f"{torch.cuda.get_device_name()}: cuBLAS bf16 8192^3 {peak:.0f} TFLOP/s (the peak below)")
    rows = []
    for t in types:
        mine = sweep_type(Q[t], ms, sweep, peak, errors)
        print_table(t, mine, ms, sweep, peak)
        rows += mine
    print(f"\nwhole run {time.time() - t0:.0f} s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), peak_tflops=peak, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
