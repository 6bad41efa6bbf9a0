"""Batched-decode products alone on CUDA (issue 22): the tensor-core kernel (kernels/triton_mma.py)
against the dp4a kernel (triton_q8.gemv_q8 with mma=False) at 16, 32 and 64 x rows, sweeping the
tensor-core configs (bench/mma_sweep.py), each as a share of copy bandwidth measured in the same run.

    PYTHONPATH=. python bench/mma_products.py [--types Q4_K Q6_K Q8_0 Q4_0] [--rows 16 32 64]
        [--quick] [--budget 165] [--workers N]

Each product is the decode step's use: += W @ x into an int64 fixed-point accumulator, K split as
the decode step splits it (auto_split), x random int8 rows; weights of the llama-3.1-8b shapes
(q|k|v 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336), random bytes; enough copies of
the weight that a graph of launches cycling through them reads >= 256 MB (no L2 reuse across
launches). Every kernel variant is first compiled in parallel processes; then per (type, rows) each
config of the first pass runs at mma_sweep.PER_SM programs per SM, the TOP fastest variants again at
mma_sweep.PER_SM_MORE. Every config's output is compared bit for bit with the dp4a kernel's before it
is timed ("BITS DIFFER" is a failure of the kernel, not of the config); a config that fails to
compile or launch is reported and skipped. Prints per (type, shape, rows) the dp4a kernel's, the
current CONFIGS entry's and the best config's time and % of copy bandwidth; per (type, rows) the best
config over the four shapes (their summed time: one layer); at the end a CONFIGS table of the best
configs to paste into kernels/triton_mma.py. --budget bounds the whole run (seconds): what would run
past it is skipped and said so.
"""

from __future__ import annotations

import argparse
import os
import time

import gguf
import torch
from mma_sweep import PER_SM_MORE, configs, likely_first, precompile, random_weight, variant

from localllm.kernels import triton_mma, triton_q8, triton_quant_act
from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MIN_BYTES = 256 << 20
TOP = 4  # first-pass variants per (type, rows) that try PER_SM_MORE


def copy_bandwidth() -> float:
    """bytes/s of a device-to-device copy of 1 GiB (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() / t


def timed(fn, reps: int) -> float:
    """Seconds per call of fn (a graph of `reps` calls, replayed twice after a warm-up, best)."""
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
    g.replay()
    best = float("inf")
    for _ in range(2):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3 / reps)
    return best


def product(xa, w, acc, mma) -> None:
    """One decode-step product: acc += W @ x, K split as the step splits it; mma: gemv_q8's."""
    triton_q8.gemv_q8(xa, w, residual=acc, inplace=True, split=None, mma=mma)


def random_act(m: int, k: int, device):
    """quantize_act's (q, d, s) of random rows (speed does not depend on the values)."""
    return triton_quant_act.quantize_act(torch.randn(m, k, device=device))


class Case:
    """One (shape, rows): weight copies, x, the dp4a kernel's output and time."""

    def __init__(self, ws, m: int):
        self.ws, self.w0 = ws, ws[0]
        n, k = self.w0.shape
        self.xa = random_act(m, k, self.w0.parts[FORMATS[self.w0.qtype].int_dot.args[0]].device)
        self.acc = torch.zeros(m, n, dtype=torch.int64, device=self.xa[0].device)
        self.want = self.run_once(False)
        self.dp4a = self.time(False)

    def run_once(self, mma) -> torch.Tensor:
        out = torch.zeros_like(self.acc)
        product(self.xa, self.w0, out, mma)
        torch.cuda.synchronize(out.device) if out.is_cuda else None
        return out

    def time(self, mma) -> float:
        it = iter(range(1 << 30))
        return timed(lambda: product(self.xa, self.ws[next(it) % len(self.ws)], self.acc, mma), len(self.ws))

    def share(self, t: float, bw: float) -> str:
        return f"{t * 1e6:8.1f} us {self.w0.nbytes / t / bw:6.1%}"


def try_config(case: Case, c, bad: dict) -> float:
    """Seconds per product of config c on case, or inf (reported) where it fails or differs in bits."""
    why = bad.get(variant(case.w0.qtype.name, c))
    if why is None:
        try:
            got = case.run_once(c)
            if not torch.equal(got, case.want):
                why = f"BITS DIFFER from dp4a ({(got != case.want).sum().item()} of {got.numel()} values)"
        except Exception as e:  # a config that does not compile or launch: skipped
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    if why is not None:
        bad.setdefault(variant(case.w0.qtype.name, c), why)
        return float("inf")
    return case.time(c)


def sweep(cases: dict[str, Case], cands: list, bad: dict, deadline: float) -> dict[tuple, list[float]]:
    """{config: per-shape seconds} for the candidates (inf: failed; configs past the deadline left out)."""
    times = {}
    for c in cands:
        if time.perf_counter() > deadline:
            print(f"  budget spent: {len(cands) - len(times)} configs not measured", flush=True)
            break
        times[c] = [try_config(case, c, bad) for case in cases.values()]
    return times


def report(tname: str, m: int, cases: dict[str, Case], times: dict, bw: float) -> tuple | None:
    """Print each shape's dp4a / default / best and the best config over the layer -> that config."""
    default = triton_mma.config_for(Q[tname], m)
    good = {c: sum(ts) for c, ts in times.items() if sum(ts) < float("inf")}
    best = min(good, key=good.get) if good else None
    for i, (sname, case) in enumerate(cases.items()):
        row = f"{tname:5} {sname:8} M={m:3} dp4a {case.share(case.dp4a, bw)}"
        if default in times:
            row += f" | default {case.share(times[default][i], bw)}"
        if best is not None:
            t = times[best][i]
            row += f" | best {case.share(t, bw)} x{case.dp4a / t:5.2f}"
        print(row, flush=True)
    base = sum(case.dp4a for case in cases.values())
    if best is None:
        print(f"BEST {tname} M={m}: none (every config failed)")
        return None
    dflt = f"{good[default] * 1e6:.1f} us" if default in good else "failed / not run"
    print(f"BEST {tname} M={m}: {best} layer {good[best] * 1e6:.1f} us (x{base / good[best]:.2f} dp4a "
          f"{base * 1e6:.1f} us; default {default} {dflt})", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--quick", action="store_true", help="4 warps, 2 stages only (a smaller sweep)")
    ap.add_argument("--budget", type=float, default=165.0, help="seconds for the run after its imports")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 4) - 2)))
    args = ap.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    rows = sorted(args.rows, reverse=True)
    first = {(t, m): configs(m, not args.quick) + [triton_mma.config_for(Q[t], m)] for t in args.types for m in rows}
    first = {key: list(dict.fromkeys(cs)) for key, cs in first.items()}
    defaults = {triton_mma.config_for(Q[t], m) for t in args.types for m in rows}
    jobs = sorted(((t, m, c) for (t, m), cs in first.items() for c in cs),
                  key=lambda j: (j[2] not in defaults, likely_first(j[2])))
    bad = precompile(jobs, args.workers, 0.55 * args.budget)
    for key, why in sorted(bad.items()):
        print(f"  variant {key}: {why}")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {bw / 1e9:.0f} GB/s", flush=True)
    table = {}
    for tname in args.types:
        weights = {}
        for sname, (n, k) in SHAPES.items():
            w0 = random_weight(Q[tname], n, k)
            weights[sname] = [w0] + [random_weight(Q[tname], n, k) for _ in range(-(-MIN_BYTES // w0.nbytes) - 1)]
        for m in rows:
            cases = {sname: Case(ws, m) for sname, ws in weights.items()}
            times = sweep(cases, first[(tname, m)], bad, deadline)
            ranked = sorted((c for c in times if sum(times[c]) < float("inf")), key=lambda c: sum(times[c]))
            more = [(*c[:6], p) for c in ranked[:TOP] for p in PER_SM_MORE]
            times.update(sweep(cases, [c for c in dict.fromkeys(more) if c not in times], bad, deadline))
            best = report(tname, m, cases, times, bw)
            if best is not None:
                table.setdefault(tname, {})[m] = best
        weights.clear()
    for key, why in sorted(bad.items()):
        if why.startswith("BITS"):
            print(f"  variant {key}: {why}")
    # every type and bucket: the measured best, else the entry as it is
    names = sorted(t.name for t in triton_mma.MMA_TYPES)
    rows_of = {t: {**triton_mma.CONFIGS[Q[t]], **table.get(t, {})} for t in names}
    print("CONFIGS = {" + ", ".join(f"Q.{t}: {dict(sorted(rows_of[t].items()))}" for t in names) + "}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
