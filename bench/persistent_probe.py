"""Can a persistent decode kernel reach issue 20's decode bars? A probe, run on the GPU.

One Triton kernel streams every layer's product weights of a model shape (q|k|v, o, gate/up, down, then
the head) through the real integer-dot units (kernels/triton_units.py) against a fixed int8 x, with a
grid-wide barrier after each product and `--extra` empty barriers a layer (where a real persistent step
would normalise, attend and combine), its programs resident all along (grid = SMs x --per-sm). Each
product is split stream-K: every program takes an equal run of the (row tile, unit step) sequence and
adds its partial sums into an int64 fixed-point output by atomics (as the decode step's accumulators).
Each barrier case runs twice: without and with a preload (a program loads its first step of the next
product before it waits at the barrier: weights never depend on the step, so the wait overlaps
streaming). `--light` takes a one-level barrier (a release atomic a program, volatile polling) instead
of the two-level counters; `--per-sm/--warps/--bk/--bn/--stages` shape the programs.

What it bounds: a persistent kernel of this design does at least this work (no attention, norms or
quantizers; x never changes), so its share of the copy roofline is at most this probe's. The same
products as one launch each (the same stream-K program, no barrier) in a CUDA graph stand for the
kernel-a-product structure. Each case is timed as 20 launches back to back (backends/measure.op_seconds),
so a launch's host work overlaps the GPU; shares are of the copy bandwidth measured in the same process
(backends/measure.copy_bandwidth), bytes = the fields' bytes read.

  python bench/persistent_probe.py --shape llama-3.2-1b --types Q4_0 --per-sm 4 --warps 4 --bk 2 --bn 4

Measured on an H200 (docs/PERFORMANCE.md, 2026-11-29, sixteenth session): with the barriers 30.3% of
copy at best, without them 59.6%; a grid barrier costs ~3.3-4.7 µs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localllm.kernels.qweight import Q, QWeight  # noqa: E402
from localllm.kernels.triton_base import INTERPRET  # noqa: E402
from localllm.kernels.triton_epilogue import FIXED_ONE  # noqa: E402
from localllm.kernels.triton_units import FMT, UNIT, unit_dot, unit_weights, weight_args  # noqa: E402
from localllm.quantize.formats import FORMATS  # noqa: E402

# (row tile BN, units a step BK) per type: triton_q8.CONFIGS' tiles
TILES = {Q.Q8_0: (32, 2), Q.Q4_0: (32, 2), Q.Q4_K: (64, 2), Q.Q6_K: (32, 1)}
# a preset's product types: q|k|v, o, gate/up, down, head (Q4_K_M: its Q6_K down and head, all layers)
PRESETS = {"Q8_0": (Q.Q8_0,) * 5, "Q4_0": (Q.Q4_0,) * 5,
           "Q4_K_M": (Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K)}
# (layers, dim, q rows, k and v rows each, ffn, vocab)
SHAPES = {"llama-3.2-1b": (16, 2048, 2048, 512, 8192, 128256), "llama-3.1-8b": (32, 4096, 4096, 1024, 14336, 128256)}
INTERPRET_JIT = tl.constexpr(INTERPRET)


@triton.jit
def _flush(acc, out, rows):
    """Add a row tile's partial sums (BK, BN, 1) into the int64 fixed-point output rows."""
    y = tl.sum(tl.sum(acc, 2), 0)
    tl.atomic_add(out + rows, (y * FIXED_ONE).to(tl.int64), sem="relaxed")
    return tl.zeros_like(acc)


@triton.jit
def _product(F: tl.constexpr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, row0, N, K, xq, xd, xs, out, pid, G, bar,
             target, WAIT: tl.constexpr, PRE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             UNIT: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, LIGHT: tl.constexpr):
    """This program's run of a (N, K) product of rows row0.. of the fields (stream-K over G programs):
    its first step's weights loaded, then (WAIT) the barrier waited for, then its steps."""
    spt = (K // UNIT) // BK  # unit steps a row tile
    total = (N // BN) * spt
    lo = (pid * total) // G
    hi = ((pid + 1) * total) // G
    acc = tl.zeros((BK, BN, 1), tl.float32)
    if PRE:
        rows = (lo // spt) * BN + tl.arange(0, BN)
        u3 = ((lo % spt) * BK + tl.arange(0, BK))[:, None, None]
        W = unit_weights(F, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, (row0 + rows)[None, :, None], None, True)
        if WAIT:
            _wait(bar, target, LIGHT)
        if lo < hi:  # (a program with no steps loaded a step of row tile `lo // spt`: in range, unused)
            acc += unit_dot(F, W, xq, xd, xs, u3, None, ASM, True)
            if (lo % spt == spt - 1) | (lo == hi - 1):
                acc = _flush(acc, out, rows)
            lo += 1
    elif WAIT:
        _wait(bar, target, LIGHT)
    for s in tl.range(lo, hi, num_stages=STAGES):  # (Triton's software pipelining of the loads)
        rows = (s // spt) * BN + tl.arange(0, BN)
        u3 = ((s % spt) * BK + tl.arange(0, BK))[:, None, None]
        W = unit_weights(F, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, (row0 + rows)[None, :, None], None, True)
        acc += unit_dot(F, W, xq, xd, xs, u3, None, ASM, True)
        if (s % spt == spt - 1) | (s == hi - 1):
            acc = _flush(acc, out, rows)


@triton.jit
def _arrive(bar, n, pid, S: tl.constexpr, GS, LIGHT: tl.constexpr):
    """LIGHT: the program's threads meet, then one release atomic adds its arrival to bar[0] (as CUDA's
    grid sync: the release after bar.sync orders the program's writes). Else: this program's writes
    fenced (every thread's), then its arrival at barrier n (counted from 1 over every launch) at its
    group's counter (program pid % S, on its own 128-byte line: one address for every program
    serialised thousands of atomics), whose last arrival of the n-th round adds one to bar[0]."""
    if LIGHT:
        tl.debug_barrier()
        tl.atomic_add(bar, 1, sem="release")
    else:
        _fence()
        tl.debug_barrier()
        if tl.atomic_add(bar + 32 * (1 + pid % S), 1, sem="acq_rel") == n * GS - 1:
            tl.atomic_add(bar, 1, sem="release")


@triton.jit
def _fence():
    if not INTERPRET_JIT:  # every thread's fence.acq_rel.gpu
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [tl.zeros((32,), tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _phase_done(bar, n, pid, S: tl.constexpr, GS, LIGHT: tl.constexpr, BARRIERS: tl.constexpr):
    """With BARRIERS: this program's arrival at barrier n + 1 -> n + 1 (the next phase waits for it)."""
    if BARRIERS:
        n += 1
        _arrive(bar, n, pid, S, GS, LIGHT)
    return n


@triton.jit
def _wait(bar, target, LIGHT: tl.constexpr):
    """Until bar[0] (LIGHT: arrivals; else groups done, S a barrier) reaches target."""
    v = tl.load(bar, volatile=True)
    while v < target:  # (polled by plain volatile loads: atomics from every program slowed the others)
        v = tl.load(bar, volatile=True)
    if LIGHT:
        _fence()
    else:
        tl.atomic_add(bar, 0, sem="acquire")  # the other programs' writes are visible after it
    tl.debug_barrier()


@triton.jit(do_not_specialize=["base"])
def _step_kernel(A0, A1, A2, A3, A4, AU0, AU1, AU2, AU3, AU4, B0, B1, B2, B3, B4, BU0, BU1, BU2, BU3, BU4,
                 C0, C1, C2, C3, C4, CU0, CU1, CU2, CU3, CU4, D0, D1, D2, D3, D4, DU0, DU1, DU2, DU3, DU4,
                 H0, H1, H2, H3, H4, HU0, HU1, HU2, HU3, HU4, xq, xd, xs, out, bar, base, L, DIM, NQKV, FFN, VOCAB,
                 FA: tl.constexpr, FB: tl.constexpr, FC: tl.constexpr, FD: tl.constexpr, FH: tl.constexpr,
                 TA: tl.constexpr, TB: tl.constexpr, TC: tl.constexpr, TD: tl.constexpr, TH: tl.constexpr,
                 KA: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr,
                 UA: tl.constexpr, UB: tl.constexpr, UC: tl.constexpr, UD: tl.constexpr, UH: tl.constexpr,
                 EXTRA: tl.constexpr, PRE: tl.constexpr, BARRIERS: tl.constexpr, ASM: tl.constexpr, S: tl.constexpr,
                 STAGES: tl.constexpr, LIGHT: tl.constexpr):
    """Every layer's four products then the head, one persistent grid: with BARRIERS each program
    arrives after each product and EXTRA small phases a layer, and the next waits until the counter
    holds every program's arrivals (base: those of the launches before). F*: each product's type
    (triton_units.FMT), T*: its BN, K*: its BK, U*: its unit."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    GS = G // S  # programs a group
    WT = G if LIGHT else S  # bar[0]'s count a barrier
    n = base
    for layer in range(L):  # (layer 0's wait is met at once: the launches before arrived base times)
        _product(FA, A0, A1, A2, A3, A4, AU0, AU1, AU2, AU3, AU4, layer * NQKV, NQKV, DIM, xq, xd, xs, out, pid, G,
                 bar, n * WT, BARRIERS, PRE, TA, KA, UA, ASM, STAGES, LIGHT)
        n = _phase_done(bar, n, pid, S, GS, LIGHT, BARRIERS)
        if BARRIERS:
            for e in tl.static_range(EXTRA):  # a small phase: wait for the one before, signal the next
                _wait(bar, n * WT, LIGHT)
                n = _phase_done(bar, n, pid, S, GS, LIGHT, BARRIERS)
        _product(FB, B0, B1, B2, B3, B4, BU0, BU1, BU2, BU3, BU4, layer * DIM, DIM, DIM, xq, xd, xs, out, pid, G,
                 bar, n * WT, BARRIERS, PRE, TB, KB, UB, ASM, STAGES, LIGHT)
        n = _phase_done(bar, n, pid, S, GS, LIGHT, BARRIERS)
        _product(FC, C0, C1, C2, C3, C4, CU0, CU1, CU2, CU3, CU4, layer * 2 * FFN, 2 * FFN, DIM, xq, xd, xs, out,
                 pid, G, bar, n * WT, BARRIERS, PRE, TC, KC, UC, ASM, STAGES, LIGHT)
        n = _phase_done(bar, n, pid, S, GS, LIGHT, BARRIERS)
        _product(FD, D0, D1, D2, D3, D4, DU0, DU1, DU2, DU3, DU4, layer * DIM, DIM, FFN, xq, xd, xs, out, pid, G,
                 bar, n * WT, BARRIERS, PRE, TD, KD, UD, ASM, STAGES, LIGHT)
        n = _phase_done(bar, n, pid, S, GS, LIGHT, BARRIERS)
    _product(FH, H0, H1, H2, H3, H4, HU0, HU1, HU2, HU3, HU4, 0, VOCAB, DIM, xq, xd, xs, out, pid, G, bar, n * WT,
             BARRIERS, PRE, TH, KH, UH, ASM, STAGES, LIGHT)


@triton.jit
def _one_kernel(P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, row0, N, K, xq, xd, xs, out, F: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, UNIT: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr):
    """One product as its own launch (the kernel-a-product structure), the same stream-K programs."""
    _product(F, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, row0, N, K, xq, xd, xs, out, tl.program_id(0),
             tl.num_programs(0), out, 0, False, False, BN, BK, UNIT, ASM, STAGES, False)


def product(w: QWeight, xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, grid: int, warps: int = 1,
            row0: int = 0, n: int | None = None, out: torch.Tensor | None = None, bk_times: int = 1,
            bn_times: int = 1, stages: int = 1) -> torch.Tensor:
    """Rows row0.. (n of them, default all) of block-major w times one quantized x row (xq int32 words,
    xd block scales, xs 16-value sums: quantize_act's) in one stream-K launch of `grid` programs, added
    into out (int64 fixed point; default zeros) -> out."""
    n = n or w.shape[0]
    out = torch.zeros(n, dtype=torch.int64, device=xq.device) if out is None else out
    ptrs, strides, step = weight_args(w)
    assert step == 1
    bn, bk = TILES[w.qtype]
    bk, bn = bk * bk_times, bn * bn_times
    assert n % bn == 0 and w.shape[1] // UNIT[w.qtype] % bk == 0, "whole row tiles and unit steps"
    _one_kernel[(grid,)](*ptrs, *strides, row0, n, w.shape[1], xq, xd, xs, out, F=FMT[w.qtype], BN=bn, BK=bk,
                         UNIT=UNIT[w.qtype], ASM=not INTERPRET, STAGES=stages, num_warps=warps)
    return out


def random_weight(qtype: Q, n: int, k: int, device) -> QWeight:
    """A block-major (n, k) weight of random block bytes (scales made small finite fp16)."""
    f = FORMATS[qtype]
    raw = torch.randint(0, 256, (n, k // f.block * f.nbytes), dtype=torch.uint8, device=device)
    w = QWeight.from_raw(raw, qtype).to_blocks()
    for name in ("d", "dmin"):
        if name in w.parts:
            w.parts[name].copy_((torch.rand_like(w.parts[name], dtype=torch.float32) * 1e-3).half())
    return w


class Probe:
    """A model shape's stacked product weights (every layer's rows of one product in one QWeight), the
    activation and output buffers, and both launches."""

    def __init__(self, shape: tuple, preset: str, device, per_sm: int = 4, warps: int = 1, bk_times: int = 1,
                 bn_times: int = 1, stages: int = 1, light: bool = False):
        self.L, self.dim, q, kv, self.ffn, self.vocab = shape  # (layers, dim, q rows, k rows, ffn, vocab)
        self.nqkv = q + 2 * kv
        types = PRESETS[preset]
        L, d, f = self.L, self.dim, self.ffn
        dims = [(L * self.nqkv, d), (L * d, d), (L * 2 * f, d), (L * d, f), (self.vocab, d)]
        self.ws = [random_weight(t, n, k, device) for t, (n, k) in zip(types, dims)]
        self.ks = [d, d, d, f, d]
        self.ns = [self.nqkv, d, 2 * f, d, self.vocab]
        self.bytes = sum(w.nbytes for w in self.ws)  # the fields' bytes, each read once a step
        kmax = max(d, f)
        self.xq = torch.randint(-2**31, 2**31 - 1, (kmax // 4,), dtype=torch.int32, device=device)
        self.xd = torch.rand(kmax // 32, device=device) * 1e-2
        self.xs = torch.randint(-2000, 2000, (kmax // 16,), dtype=torch.int32, device=device)
        self.out = torch.zeros(max(self.ns), dtype=torch.int64, device=device)
        self.bar = torch.zeros(32 * 13, dtype=torch.int32, device=device)  # _arrive's counters
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.grid, self.warps, self.done = sms * per_sm, warps, 0
        self.groups = 12 if self.grid % 12 == 0 else 1  # _arrive's S
        self.bk, self.bn = bk_times, bn_times  # TILES' BK and BN times these: more bytes in flight a step
        self.stages = stages  # the product loops' num_stages
        self.light = light  # _arrive's one-level barrier
        self.args, self.const = [], {}  # step()'s weight fields, strides and per-product constexprs
        for w, name in zip(self.ws, "ABCDH"):
            ptrs, strides, step = weight_args(w)
            assert step == 1
            self.args += ptrs + strides
            bn, bk = TILES[w.qtype]
            self.const.update({f"F{name}": FMT[w.qtype], f"T{name}": bn * bn_times, f"K{name}": bk * bk_times,
                               f"U{name}": UNIT[w.qtype]})

    def step(self, extra: int = 3, preload: bool = True, barriers: bool = True) -> None:
        """One persistent launch over the whole step (the barrier counter continues from the last)."""
        base = self.done  # barriers of the launches before
        _step_kernel[(self.grid,)](*self.args, self.xq, self.xd, self.xs, self.out, self.bar, base, self.L, self.dim,
                                   self.nqkv, self.ffn, self.vocab, EXTRA=extra, PRE=preload, BARRIERS=barriers,
                                   ASM=not INTERPRET, S=self.groups, STAGES=self.stages,
                                   LIGHT=self.light, num_warps=self.warps, **self.const)
        self.done += self.L * (4 + extra) if barriers else 0

    def one_by_one(self) -> None:
        """Each product of each layer as its own launch (capture it in a graph to time it)."""
        for layer in range(self.L):
            for j in range(4):
                self.one(j, layer * self.ns[j])
        self.one(4, 0)

    def one(self, j: int, row0: int) -> None:
        """Product j's rows row0.. (ns[j] of them) as one launch."""
        product(self.ws[j], self.xq, self.xd, self.xs, self.grid, self.warps, row0, self.ns[j], self.out, self.bk,
                self.bn, self.stages)


def main() -> None:
    from localllm.backends.measure import copy_bandwidth, op_seconds

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M")
    ap.add_argument("--per-sm", default="4,8,16", help="programs an SM (comma list)")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--bk", type=int, default=1, help="units a step: TILES' BK times this")
    ap.add_argument("--bn", type=int, default=1, help="rows a tile: TILES' BN times this")
    ap.add_argument("--light", action="store_true", help="one-level barrier (_arrive's LIGHT)")
    ap.add_argument("--stages", type=int, default=1, help="the product loops' num_stages (software pipelining)")
    ap.add_argument("--cases", default="graph,nobar,bar", help="which launches to time")
    ap.add_argument("--extra", default="0,3", help="empty barriers a layer beyond the four products")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e9:.0f} GB/s", flush=True)
    for preset in args.types.split(","):
        for per_sm in map(int, args.per_sm.split(",")):
            p = Probe(SHAPES[args.shape], preset, dev, per_sm, args.warps, args.bk, args.bn, args.stages, args.light)
            g = torch.cuda.CUDAGraph()
            p.one_by_one()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                p.one_by_one()
            cases = {}
            if "graph" in args.cases:
                cases["kernel a product (graph)"] = g.replay
            if "nobar" in args.cases:
                cases["one kernel, no barrier"] = lambda: p.step(barriers=False)
            for extra in map(int, args.extra.split(",")) if "bar" in args.cases.split(",") else ():
                for pre in (False, True):
                    cases[f"persistent, {4 + extra} barriers a layer, preload {int(pre)}"] = (
                        lambda e=extra, q=pre: p.step(e, q))
            for name, fn in cases.items():
                t = op_seconds(fn, dev, 20)  # back-to-back launches: the host's launch work overlaps the GPU
                share = p.bytes / t / bw
                print(f"{args.shape} {preset} per_sm {per_sm} warps {args.warps} bk x{args.bk} bn x{args.bn} stages "
                      f"{args.stages} light {int(args.light)}: {name}: {t * 1e6:.1f} us, {share * 100:.1f}% of copy, "
                      f"{(t - p.bytes / bw) / p.L * 1e6:.2f} us a layer beyond its bytes", flush=True)
            cases.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
