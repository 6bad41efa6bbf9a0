"""Integer-dot matvec kernels (kernels/triton_q8.py) on the GPU: correctness at real shapes, a tile-config
sweep, then the decode bench with the best configs, all in one process (one device call):

    python bench/q8_tune.py [--out DIR] [--bench-types Q8_0,Q4_0,Q4_K_M] [--shapes llama-3.1-8b,...]

1. quantize_act's kernel against quantize.act.quantize_act (equal q and d, with and without the fused
   RMSNorm); gemv_q8 with dp4a against dequantize_torch(W) @ dequantize_act(q, d) (fp64), against the
   emulated dp4a compiled for the GPU (must be equal: the integer sums are exact), and against W @ x
   (the activation-quantization error);
2. per type, each config's time for one layer of Llama 3.1 8B (qkv, o + residual, gate/up + GLU,
   down + residual, K split as in decode) replayed in a CUDA graph over enough weight copies to
   defeat the 50 MB L2; GB/s of weight bytes against the device-to-device copy measured here;
3. localllm.commands.bench.run_bench with the best configs (the table the issue asks for).
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import torch

from localllm.kernels import triton_epilogue, triton_gemv, triton_q8
from localllm.kernels.qweight import QWeight
from localllm.commands.bench import copy_bandwidth, run_bench
from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.act import dequantize_act, quantize_act

Q = gguf.GGMLQuantizationType
DEV = "cuda"
# split products' per-program counters, kept across calls as the decode step keeps them (triton_epilogue.split_buffers)
CNT = torch.zeros(triton_epilogue.COUNTERS, dtype=torch.int32, device=DEV) if torch.cuda.is_available() else None
TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K)
CANDIDATES = {  # (BN rows, BK units per iteration, warps)
    Q.Q8_0: [(32, 4, 1), (64, 4, 2), (128, 4, 4), (64, 2, 2), (32, 8, 2), (64, 8, 4)],
    Q.Q4_0: [(32, 4, 1), (64, 4, 2), (128, 4, 4), (32, 8, 2), (64, 8, 4), (64, 2, 2)],
    Q.Q4_K: [(32, 2, 1), (64, 2, 2), (128, 2, 4), (32, 4, 2), (64, 4, 4), (64, 1, 2), (128, 1, 4), (256, 1, 8)],
    Q.Q6_K: [(32, 1, 1), (64, 1, 2), (128, 1, 4), (32, 2, 2), (64, 2, 4), (16, 1, 1), (32, 1, 2)],
}
# One decode layer: (name, N, K, glu, residual); 8B and 1B.
LAYERS = {
    "8B": [("qkv", 6144, 4096, False, False), ("o", 4096, 4096, False, True),
           ("gate_up", 28672, 4096, True, False), ("down", 4096, 14336, False, True)],
    "1B": [("qkv", 3072, 2048, False, False), ("o", 2048, 2048, False, True),
           ("gate_up", 16384, 2048, True, False), ("down", 2048, 8192, False, True)],
}


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_weight(n: int, k: int, qtype: Q, seed: int = 0) -> tuple[torch.Tensor, QWeight]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.from_numpy(quantize_tensor(torch.randn(n, k, device=DEV, generator=g), qtype)).to(DEV)
    return raw, QWeight.from_raw(raw, qtype).to_blocks()


def check() -> list[str]:
    out = ["| type | shape | act q equal (plain / normed: share differing) | vs fp64 ref | dp4a == emulated | vs W @ x |",
           "| --- | --- | --- | --- | --- | --- |"]
    for qtype in TYPES:
        for n, k in ((1024, 4096), (512, 14336)):
            raw, w = random_weight(n, k, qtype)
            ref = dequantize_torch(raw, qtype)
            x = torch.randn(2, k, device=DEV) * 3
            q, d, s = triton_q8.quantize_act(x)
            qr, dr, sr = quantize_act(x)
            plain = torch.equal(q, qr) and torch.equal(d, dr) and torch.equal(s, sr)
            nw = 1 + 0.1 * torch.randn(k, device=DEV)
            qn, _, _ = triton_q8.quantize_act(x, nw, 1e-5)
            qnr, _, _ = quantize_act(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw)
            y = triton_q8.gemv_q8((q, d, s), w, act_dtype=torch.float32)
            e_ref = rel(y, dequantize_act(q, d).double() @ ref.double().T)
            y_emu = emulated(q, d, s, w)
            out.append(f"| {qtype.name} | {n}x{k} | {plain} / {(qn != qnr).float().mean().item():.1e} | {e_ref:.1e} "
                       f"| {torch.equal(y, y_emu)} | {rel(y, x.double() @ ref.double().T):.1e} |")
    return out


def emulated(q, d, s, w) -> torch.Tensor:
    """gemv_q8 compiled with the shift emulation of dp4a (ASM=False) on the GPU."""
    import triton

    bn, bk, warps = triton_q8.CONFIGS[w.qtype]
    ptrs, strides, step = triton_q8.weight_args(w)
    n, k = w.shape
    out = torch.empty((q.shape[0], n), dtype=torch.float32, device=DEV)
    units = k // triton_q8.UNIT[w.qtype]
    triton_q8._q8_gemv_kernel[(triton.cdiv(n, bn), q.shape[0], 1)](
        q.view(torch.int32), d, s, out, out, out, out, *ptrs, *strides, step, n, k, out.stride(0), units,
        FMT=triton_q8.FMT[w.qtype], UNIT=triton_q8.UNIT[w.qtype], BN=bn, BK=bk, GLU=False, HAS_BIAS=False,
        HAS_RES=False, ROUND=False, SPLIT=1, ASM=False, EVEN=n % bn == 0 and units % bk == 0, PDL=False,
        num_warps=warps)
    return out


def graph_time(fn, reps: int = 20) -> float:
    """ms per call of fn (a sequence of launches) replayed as one CUDA graph (median of reps)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def layer_case(qtype: Q, layer: list, min_bytes: int = 400 << 20):
    """Weights for one layer repeated over copies totalling > min_bytes; -> (bytes per layer, calls(cfg))."""
    ws, per_layer = [], 0
    for name, n, k, glu, res in layer:
        _, base = random_weight(min(n, 2048), k, qtype, seed=n + k)
        w1 = QWeight.cat([base] * (n // base.shape[0]))
        per_layer += w1.nbytes
        ws.append((w1, k, glu, res))
    copies = max(1, min_bytes // per_layer)
    weights = [[(QWeight.cat([w]), k, glu, res) for (w, k, glu, res) in ws] for _ in range(copies)]
    xs = {k: torch.randn(1, k, device=DEV) for (_, k, _, _) in ws}
    acc = torch.zeros(1, 28672, device=DEV)

    def calls(cfg):
        def run():  # as localllm/cuda_decode.py: every product split over K into an fp32 accumulator
            for layer_ws in weights:
                for w, k, glu, res in layer_ws:
                    xa = triton_q8.quantize_act(xs[k])
                    out = acc[:, :w.shape[0]]
                    if not res and not glu:
                        out.zero_()
                    triton_q8.gemv_q8(xa, w, residual=out, config=cfg, split=None, inplace=True, counters=CNT)
                    if glu:
                        triton_q8.quantize_act(out, glu_dtype=torch.bfloat16)
        return run

    return per_layer, copies, calls


def breakdown(copy_gbs: float) -> list[str]:
    """Each kernel of an 8B layer alone (graph over weight copies): µs and share of copy bandwidth."""
    out = ["| type | kernel | µs | MB | share of copy |", "| --- | --- | ---: | ---: | ---: |"]
    for qtype in (Q.Q4_0, Q.Q8_0, None):
        for name, n, k, glu, res in LAYERS["8B"]:
            if qtype is None:
                w1 = torch.randn(n, k, device=DEV).bfloat16()
                nb = w1.numel() * 2
            else:
                _, base = random_weight(min(n, 2048), k, qtype, seed=n + k)
                w1 = QWeight.cat([base] * (n // base.shape[0]))
                nb = w1.nbytes
            copies = max(1, (400 << 20) // nb)
            ws = [w1.clone() if qtype is None else QWeight.cat([w1]) for _ in range(copies)]
            x = torch.randn(1, k, device=DEV)
            xa = triton_q8.quantize_act(x)
            r = torch.zeros(1, n, device=DEV)
            if qtype is None:
                fn = lambda: [triton_gemv.gemv(x, w, residual=r if res else None, glu=glu, act_dtype=torch.bfloat16,
                                               split=None if res else 1, inplace=res, counters=CNT) for w in ws]
            else:  # the decode step's form: split K, atomics into an fp32 accumulator
                fn = lambda: [triton_q8.gemv_q8(xa, w, residual=r, split=None, inplace=True, counters=CNT) for w in ws]
            us = graph_time(fn) * 1000 / copies
            tname = qtype.name if qtype else "bf16"
            out.append(f"| {tname} | {name} {n}x{k} | {us:.1f} | {nb / 1e6:.1f} | {nb / us / 1e3 / copy_gbs:.0%} |")
            print(out[-1], flush=True)
            fn = ws = None  # free the copies before the next shape
            torch.cuda.empty_cache()
    for k, norm in ((4096, True), (14336, False)):
        xs = [torch.randn(1, k, device=DEV) for _ in range(64)]
        nw = torch.ones(k, device=DEV) if norm else None
        us = graph_time(lambda: [triton_q8.quantize_act(x, nw, 1e-5) for x in xs]) * 1000 / 64
        out.append(f"| act | quantize_act K={k} norm={norm} | {us:.1f} | - | - |")
        print(out[-1], flush=True)
    empty = torch.zeros(1, device=DEV)
    us = graph_time(lambda: [empty.add_(1) for _ in range(256)]) * 1000 / 256
    out.append(f"| - | a tiny kernel (graph step) | {us:.2f} | - | - |")
    print(out[-1], flush=True)
    return out


def product_copies(qtype: Q, n: int, k: int):
    """An 8B product's weight repeated over >= 400 MB of copies, a quantized x and an fp32 accumulator
    -> (bytes of one copy, time(**gemv_q8 keywords) in µs a product, the decode step's split K form)."""
    _, base = random_weight(min(n, 2048), k, qtype, seed=n + k)
    w1 = QWeight.cat([base] * (n // base.shape[0]))
    copies = max(1, (400 << 20) // w1.nbytes)
    ws = [QWeight.cat([w1]) for _ in range(copies)]
    xa = triton_q8.quantize_act(torch.randn(1, k, device=DEV))
    r = torch.zeros(1, n, device=DEV)

    def time_us(**kw) -> float:
        return graph_time(lambda: [triton_q8.gemv_q8(xa, w, residual=r, inplace=True, counters=CNT, **kw)
                                   for w in ws]) * 1000 / copies

    return w1.nbytes, time_us


def split_sweep(copy_gbs: float) -> None:
    """µs of each 8B product (Q4_0, Q8_0) for explicit K splits against the automatic choice."""
    for qtype in (Q.Q4_0, Q.Q8_0):
        for name, n, k, glu, res in LAYERS["8B"]:
            nbytes, time_us = product_copies(qtype, n, k)
            bn, bk, _ = triton_q8.CONFIGS[qtype]
            auto = triton_epilogue.split_k(None, False, n // bn, k // triton_q8.UNIT[qtype], bk, torch.device(DEV))[0]
            res_us = {sp: time_us(split=sp) for sp in (1, 2, 4, 8, 16, 32, 64)
                      if k // triton_q8.UNIT[qtype] >= sp * bk}
            print(f"| {qtype.name} | {name} | auto {auto} | " + ", ".join(
                f"{sp}: {t:.1f} µs ({nbytes / t / 1e3 / copy_gbs:.0%})" for sp, t in res_us.items()) + " |", flush=True)
            time_us = None
            torch.cuda.empty_cache()


def product_sweep(copy_gbs: float, types: list[Q]) -> None:
    """Each candidate config on each 8B product alone (graph over weight copies, the decode step's
    split K into an fp32 accumulator): whether products of one type would want different tiles."""
    for qtype in types:
        for name, n, k, glu, res in LAYERS["8B"]:
            nbytes, time_us = product_copies(qtype, n, k)
            res_us = {cfg: time_us(split=None, config=cfg) for cfg in CANDIDATES[qtype]}
            best = min(res_us, key=res_us.get)
            print(f"| {qtype.name} | {name} {n}x{k} | best {best} {res_us[best]:.1f} µs "
                  f"({nbytes / res_us[best] / 1e3 / copy_gbs:.0%}) | " + ", ".join(
                      f"{c}: {t:.1f}" for c, t in res_us.items()) + " |", flush=True)
            time_us = None
            torch.cuda.empty_cache()


def sweep(copy_gbs: float) -> tuple[dict, list[str]]:
    best, out = {}, ["| type | layer | config (BN, BK, warps) | µs per layer | GB/s | share of copy | all configs (µs) |",
                     "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for qtype in TYPES:
        for shape, layer in LAYERS.items():
            nbytes, copies, calls = layer_case(qtype, layer)
            res = {}
            for cfg in CANDIDATES[qtype]:
                try:
                    res[cfg] = graph_time(calls(cfg)) * 1000 / copies
                except Exception as e:  # noqa: BLE001 (a config that does not compile)
                    print(f"{qtype.name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
            cfg = min(res, key=res.get)
            if shape == "8B":
                best[qtype] = cfg
            gbs = nbytes / res[cfg] / 1e3
            out.append(f"| {qtype.name} | {shape} | {cfg} | {res[cfg]:.1f} | {gbs:.0f} | {gbs / copy_gbs:.0%} | "
                       + ", ".join(f"{c}: {t:.1f}" for c, t in res.items()) + " |")
            print(out[-1], flush=True)
            torch.cuda.empty_cache()
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--bench-types", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="time each kernel of an 8B layer alone")
    ap.add_argument("--split-sweep", action="store_true", help="time the 8B products at explicit K splits")
    ap.add_argument("--product-sweep", default="", help="types (e.g. Q4_K,Q6_K) whose configs to time per 8B product")
    ap.add_argument("--configs", help="a q8_configs.json of an earlier sweep, or 'current' (kernels/triton_q8.CONFIGS): skip the sweep")
    args = ap.parse_args()
    t0 = time.time()
    copy_gbs = copy_bandwidth(torch.device(DEV)) / 1e9
    print(f"device: {torch.cuda.get_device_name()}; copy {copy_gbs:.0f} GB/s\n", flush=True)
    if not args.skip_check:
        print("\n".join(check()), flush=True)
    if args.configs == "current":
        pass
    elif args.configs:
        with open(args.configs) as f:
            triton_q8.CONFIGS.update({Q[name]: tuple(c) for name, c in json.load(f).items()})
    else:
        best, table = sweep(copy_gbs)
        triton_q8.CONFIGS.update(best)
        with open(f"{args.out}/q8_configs.json", "w") as f:
            json.dump({t.name: c for t, c in best.items()}, f)
        print(f"\nbest configs: { {t.name: c for t, c in best.items()} } ({time.time() - t0:.0f} s)\n", flush=True)
    if args.breakdown:
        breakdown(copy_gbs)
    if args.split_sweep:
        split_sweep(copy_gbs)
    if args.product_sweep:
        product_sweep(copy_gbs, [Q[t] for t in args.product_sweep.split(",")])
    if args.bench_types:
        text = run_bench([], args.shapes.split(","), args.bench_types.split(","), [512], [128], [0], 3, DEV)
        print(text, flush=True)
        with open(f"{args.out}/bench.md", "w") as f:
            f.write(text)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
