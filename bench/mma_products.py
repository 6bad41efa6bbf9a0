"""Batched-decode products alone on CUDA (issue 22): the tensor-core kernel (kernels/triton_mma.py)
against the dp4a kernel (triton_q8.gemv_q8 with mma=False) at 16 and 64 x rows, with a sweep of the
tensor-core tile configs, each as a share of copy bandwidth measured in the same run.

    python bench/mma_products.py [--types Q4_K Q6_K Q8_0 Q4_0] [--rows 16 64] [--quick]

Each product is the decode step's use: += W @ x into an int64 fixed-point accumulator, K split as
the decode step splits it (auto_split), x quantize_act's int8 rows; weights of the llama-3.1-8b
shapes (q|k|v 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336), random; enough copies of
the weight that a graph of launches cycling through them reads >= 400 MB (no L2 reuse across
launches). Prints per (type, shape, rows): dp4a us and % of copy, the best tensor-core config's us and
%, and the speed-up; then the best config per (type, rows) over all shapes (summed time), to put in
triton_mma.CONFIGS. Each config's output is checked bit for bit against the dp4a kernel's first.
"""

from __future__ import annotations

import argparse
import itertools

import gguf
import torch

from localllm.kernels import triton_mma, triton_q8
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_epilogue import plan, to_fixed
from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MIN_BYTES = 400 << 20


def copy_bandwidth() -> float:
    """bytes/s of a device-to-device copy of 1 GiB (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() / t


def timed(fn, reps: int) -> float:
    """Seconds per call of fn (a graph of `reps` calls, replayed 3 times, best)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3 / reps)
    return best


def random_weight(qtype, n: int, k: int) -> QWeight:
    """Random bytes in the type's fields (scales kept small and finite): speed does not depend on them."""
    fmt = FORMATS[qtype]
    nbytes = n * k // fmt.block * fmt.nbytes
    raw = torch.randint(0, 256, (n, nbytes // n), dtype=torch.uint8, device="cuda")
    w = QWeight.from_raw(raw, qtype)
    for name, p in w.parts.items():
        if p.dtype == torch.float16:
            p.copy_(torch.rand_like(p, dtype=torch.float32).mul_(1e-3).half())
    return w.to_blocks()


def product(xa, w, acc, config, mma: bool):
    """One decode-step product: acc += W @ x (split as the step splits it)."""
    if not mma:
        return triton_q8.gemv_q8(xa, w, residual=acc, inplace=True, split=None, mma=False)
    q = xa[0]
    m, k = q.shape
    bn, bk, _ = triton_q8.CONFIGS[w.qtype]
    L = plan(m, w.shape[0], bn, k // triton_q8.UNIT[w.qtype], bk, False, None, acc, True, None, torch.bfloat16,
             q.device, None)
    return triton_mma.gemv_mma(xa, w, L, bk, None, acc, torch.bfloat16, config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--quick", action="store_true", help="the default config only (no sweep)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {bw / 1e9:.0f} GB/s")
    sweep = [(64, bn, wp, st) for bn, wp, st in itertools.product((64, 128), (4, 8), (2, 3))]
    best_of = {}
    for tname in args.types:
        qtype = Q[tname]
        for m in sorted(args.rows, reverse=True):
            default = triton_mma.CONFIGS[qtype]
            configs = [default] if args.quick or m < 64 else [default] + [c for c in sweep if c != default]
            if m < 64 and qtype in best_of:  # fewer rows: the default and the best config of 64 rows
                configs += [c for c in [best_of[qtype]] if c != default]
            totals = {c: 0.0 for c in configs}
            base_total = 0.0
            for sname, (n, k) in SHAPES.items():
                w0 = random_weight(qtype, n, k)
                copies = max(1, -(-MIN_BYTES // w0.nbytes))
                ws = [w0] + [random_weight(qtype, n, k) for _ in range(copies - 1)]
                x = torch.randn(m, k, device="cuda")
                xa = triton_q8.quantize_act(x)
                acc = to_fixed(torch.zeros(m, n, device="cuda"))
                it = {"i": 0}

                def run(config, mma):
                    def f():
                        product(xa, ws[it["i"] % copies], acc, config, mma)
                        it["i"] += 1
                    return f

                base = timed(run(None, False), 2 * copies)
                base_total += base
                want = acc.zero_().clone()
                product(xa, w0, want, None, False)
                row = f"{tname:5} {sname:8} M={m:3} dp4a {base * 1e6:8.1f} us {w0.nbytes / base / bw:6.1%}"
                best = None
                for c in configs:
                    got = acc.zero_().clone()
                    try:
                        product(xa, w0, got, c, True)
                        torch.cuda.synchronize()
                    except Exception as e:  # a config that does not compile (resources): skipped
                        print(f"  config {c}: {type(e).__name__}")
                        totals[c] = float("inf")
                        continue
                    if not torch.equal(got, want):
                        print(f"  config {c}: bits differ from dp4a ({(got != want).sum().item()} values)")
                    t = timed(run(c, True), 2 * copies)
                    totals[c] += t
                    if best is None or t < best[0]:
                        best = (t, c)
                if best:
                    t, c = best
                    row += f" | mma {t * 1e6:8.1f} us {w0.nbytes / t / bw:6.1%} x{base / t:5.2f} {c}"
                print(row, flush=True)
                ws.clear()  # free the copies before the next shape
            good = {c: t for c, t in totals.items() if t < float("inf")}
            if good:
                c = min(good, key=good.get)
                best_of.setdefault(qtype, c)
                print(f"BEST {tname} M={m}: {c} (all shapes {good[c] * 1e6:.1f} us vs dp4a {base_total * 1e6:.1f} us, "
                      f"default {triton_mma.CONFIGS[qtype]} {totals[triton_mma.CONFIGS[qtype]] * 1e6:.1f} us)",
                      flush=True)


if __name__ == "__main__":
    main()
