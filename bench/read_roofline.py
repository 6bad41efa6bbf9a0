"""How close to the copy bandwidth a decode step's weight reads can get when each product is its own
kernel: a plain streaming-read kernel (sums its slice, nothing else) over the weights of a model
shape, one launch per product as the decode step makes them (q|k|v, o, gate/up, down per layer, then
the head), inside one CUDA graph with programmatic dependent launch. Against it: one read of the
same bytes as a single kernel, and the device-to-device copy the benchmarks measure.

    python bench/read_roofline.py [--presets llama-3.1-8b,llama-3.2-1b] [--bytes-per-weight 2,1.0625,0.5625]

This bounds what per-product kernels can reach (bench's share column) before any arithmetic.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from graph_timing import graph_seconds
from localllm.kernels.triton_base import PDL, _pdl_wait
from localllm.commands.bench import copy_bandwidth
from localllm.registry import shape_preset


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, PER, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p sums int32 words [p PER, (p + 1) PER) of src, BLOCK at a time."""
    _pdl_wait(PDL)
    p = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, PER, BLOCK):
        offs = p * PER + i + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + p, tl.sum(acc))


def read(buf: torch.Tensor, out: torch.Tensor, block: int, per_sm: int, sms: int) -> None:
    n = buf.numel()
    per = triton.cdiv(triton.cdiv(n, per_sm * sms), block) * block
    grid = triton.cdiv(n, per)
    _read_kernel[(grid,)](buf, out, n, per, BLOCK=block, PDL=PDL, num_warps=4, launch_pdl=PDL)


def layer_sizes(preset: str, bpw: float) -> list[int]:
    """Bytes of each product in decode order (int32 words, rounded up)."""
    c = shape_preset(preset)
    qkv = (c.q_dim + 2 * c.kv_dim) * c.dim
    sizes = [qkv, c.q_dim * c.dim, 2 * c.ffn_dim * c.dim, c.dim * c.ffn_dim] * c.n_layers + [c.vocab_size * c.dim]
    return [int(s * bpw + 3) // 4 for s in sizes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--bytes-per-weight", default="2,1.0625,0.5625")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e9:.0f} GB/s (read + written); PDL {PDL}")
    print("| shape | bytes/weight | GB a step | one kernel | one kernel per product | config |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    for preset in args.presets.split(","):
        for bpw in map(float, args.bytes_per_weight.split(",")):
            sizes = layer_sizes(preset, bpw)
            bufs = [torch.ones(s, dtype=torch.int32, device="cuda") for s in sizes]
            whole = torch.ones(sum(sizes), dtype=torch.int32, device="cuda")
            total = 4 * sum(sizes)
            best = None
            for block, per_sm in [(1024, 2), (2048, 2), (2048, 4), (4096, 2), (4096, 4), (1024, 8)]:
                t_one = graph_seconds(lambda: read(whole, out, block, per_sm, sms))
                t_each = graph_seconds(lambda: [read(b, out, block, per_sm, sms) for b in bufs])
                if best is None or t_each < best[1]:
                    best = (t_one, t_each, (block, per_sm))
            t_one, t_each, cfg = best
            print(f"| {preset} | {bpw} | {total / 1e9:.2f} | {total / t_one / bw:.1%} | {total / t_each / bw:.1%} "
                  f"({t_each * 1e3:.3f} ms) | {cfg} |", flush=True)
            del bufs, whole
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
