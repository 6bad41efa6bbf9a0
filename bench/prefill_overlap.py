"""A prompt's quantized products on CUDA, in the order of a forward: dequantize (kernels/triton_dequant.py)
then cuBLAS, one after the other (today) against the next weight decoded on a second stream while the
current product runs (a two-buffer pipeline), and against slabs of rows decoded into one small reused
buffer (--chunk-mib: the dense values meant to stay in L2). A measurement of ideas, not the runtime's code.

    python bench/prefill_overlap.py --preset llama-3.1-8b --type Q4_0 [--tokens 512] [--layers 8] [--chunk-mib 16 40]

Each schedule runs as one captured CUDA graph. Prints each schedule's time per layer and its share of
the bf16 matmul rate (measure.matmul_rate: 8192^3 bf16), with dense bf16 weights (no decode) as the
ceiling of the same products. Measured (docs/PERFORMANCE.md, 2026-11-28 tenth session): both the side
stream and the slabs are slower than the serial schedule.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.nn.functional as F

from localllm.backends.cuda_graph import captured
from localllm.backends.measure import matmul_rate, op_seconds
from localllm.footprint import linear_weights
from localllm.kernels.linear import dequantize_qweight
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_dequant import dequantize
from localllm.registry import shape_preset
from localllm.synthetic import synthetic_model


def chunked(ws: list, xs: list, mib: int, transposed: bool):
    """Each weight decoded a slab of rows at a time into one reused scratch buffer of `mib` MiB (small
    enough to stay in L2, so the dense values need never reach HBM), each slab's product taken at once:
    y[:, n0:n1] = x slab^T (cuBLAS writes the column range in place: ldc = N), or transposed: y^T's
    rows n0:n1 = slab x^T (contiguous rows)."""
    scratch = torch.empty(mib * 2**19, dtype=torch.bfloat16, device=xs[0].device)
    outs = [torch.empty((w.shape[0], x.shape[0]) if transposed else (x.shape[0], w.shape[0]),
                        dtype=torch.bfloat16, device=x.device) for w, x in zip(ws, xs)]

    def run():
        for w, x, y in zip(ws, xs, outs):
            if not isinstance(w, QWeight):
                F.linear(x, w)
                continue
            n, k = w.shape
            c = max(64, min(n, scratch.numel() // k // 64 * 64))
            for n0 in range(0, n, c):
                n1 = min(n, n0 + c)
                d = dequantize(w.rows(n0, n1), torch.bfloat16, out=scratch[:(n1 - n0) * k].view(n1 - n0, k))
                if transposed:
                    torch.mm(d, x.t(), out=y[n0:n1])
                else:
                    torch.mm(x, d.t(), out=y[:, n0:n1])
    return run


def schedules(ws: list, xs: list, streams: int, chunk_mib: list[int]):
    side = torch.cuda.Stream()
    dense = [dequantize_qweight(w, torch.bfloat16) if isinstance(w, QWeight) else w for w in ws]

    def serial():
        for w, x in zip(ws, xs):
            F.linear(x, dequantize_qweight(w, torch.bfloat16) if isinstance(w, QWeight) else w)

    def overlapped():
        main, n = torch.cuda.current_stream(), len(ws)
        side.wait_stream(main)
        ready, done, dec = [], [], []

        def issue(j):  # decode weight j on the side stream once product j - streams has read its buffer
            if j >= streams:
                side.wait_event(done[j - streams])
            with torch.cuda.stream(side):
                d = dequantize_qweight(ws[j], torch.bfloat16) if isinstance(ws[j], QWeight) else ws[j]
                e = torch.cuda.Event()
                e.record(side)
            d.record_stream(main)
            dec.append(d)
            ready.append(e)

        for j in range(min(streams, n)):
            issue(j)
        for i in range(n):
            main.wait_event(ready[i])
            F.linear(xs[i], dec[i])
            e = torch.cuda.Event()
            e.record(main)
            done.append(e)
            dec[i] = None
            if i + streams < n:
                issue(i + streams)
        main.wait_stream(side)

    def ceiling():
        for w, x in zip(dense, xs):
            F.linear(x, w)

    out = {"serial": serial, "overlapped": overlapped, "dense bf16": ceiling}
    for mib in chunk_mib:
        out[f"slabs {mib} MiB"] = chunked(ws, xs, mib, False)
        out[f"slabs^T {mib} MiB"] = chunked(ws, xs, mib, True)
    return out


def graphed(fn):
    """fn captured as one CUDA graph (after two warm-up calls: Triton compiles, cuBLAS picks its
    kernels) -> its replay: the schedules' many launches timed without the host's launch cost (a slab
    schedule's ~70 us of Python a slab hid the GPU's time when run eagerly)."""
    fn()  # the first of the two warm-up calls; captured() makes the second
    return captured(fn)[0].replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ahead", type=int, default=1, help="weights decoded ahead of the current product")
    ap.add_argument("--chunk-mib", type=int, nargs="*", default=[], help="slab schedules' scratch sizes (MiB)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = replace(shape_preset(args.preset), n_layers=args.layers)
    rt, types = synthetic_model(cfg, args.type, "cuda", torch.bfloat16)
    ws = [w for w in linear_weights(rt.model) if w.shape[0] < cfg.vocab_size]  # the layers' products
    xs = [torch.randn(args.tokens, w.shape[1], device=dev, dtype=torch.bfloat16) for w in ws]
    flop = sum(2 * args.tokens * w.shape[0] * w.shape[1] for w in ws)
    peak = matmul_rate(dev)
    print(f"{torch.cuda.get_device_name()} | {args.preset} {args.type} {dict(types)} | {len(ws)} products, "
          f"{args.tokens} tokens | bf16 matmul rate {peak / 1e12:.0f} TFLOP/s")
    for name, fn in schedules(ws, xs, args.ahead + 1, args.chunk_mib).items():
        try:
            fn = graphed(fn)
        except RuntimeError as e:  # timed eagerly then (host launch cost included)
            print(f"{name}: not captured ({str(e).splitlines()[0]}): eager")
        s = op_seconds(fn, dev, 3)
        print(f"{name:>12}: {s / args.layers * 1e6:8.1f} us a layer, {flop / s / peak * 100:5.1f}% of the matmul rate")


if __name__ == "__main__":
    main()
