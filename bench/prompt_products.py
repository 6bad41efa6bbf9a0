"""Prompt products on quantized weights (issue 20): dequantize to bf16 then cuBLAS, the block-major decoder
(kernels/triton_dequant.py) against the row-major copy + triton_gemv.dequantize path it replaced, and
cuBLAS on bf16 weights, on the 8B shape's layer products.

    python bench/prompt_products.py [--m 512] [--types Q8_0,Q4_0,Q4_K,Q6_K]

Weights are random bytes in each type's block-major layout (timing does not depend on the values).
Figures: TFLOP/s, the share of the peak measured in this run (cuBLAS bf16 on an 8192^3 product), and
the decoder's bytes (read + written) per second.
"""

from __future__ import annotations

import argparse

import gguf
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from localllm.kernels import triton_dequant
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_gemv import dequantize as dequantize_rows
from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType
# llama-3.1-8b: fused q|k|v, o, fused gate|up, down (N, K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def random_weight(qtype, n: int, k: int) -> QWeight:
    fmt = FORMATS[qtype]
    raw = torch.randint(0, 256, (n, k // fmt.block * fmt.nbytes), dtype=torch.uint8, device="cuda")
    w = QWeight.from_raw(raw, qtype).to_blocks()
    for name, t in w.parts.items():  # finite scales: fp16 fields get small values
        if t.dtype == torch.float16:
            t.copy_(torch.rand_like(t, dtype=torch.float32).mul_(1e-2).half())
    return w


def check(qtype) -> bool:
    """The decoder's bf16 values equal the reference's rounded ones (a real quantized weight)."""
    raw = torch.from_numpy(quantize_tensor(torch.randn(256, 1024), qtype))
    ref = dequantize_torch(raw, qtype).cuda().bfloat16()
    return torch.equal(triton_dequant.dequantize(QWeight.from_raw(raw.cuda(), qtype).to_blocks()), ref)


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    a = ap.parse_args()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = tflops(8192, 8192, 8192, do_bench(lambda: big @ big))
    print(f"{torch.cuda.get_device_name()}: cuBLAS bf16 8192^3 {peak:.0f} TFLOP/s (the peak below)")
    for name in a.types.split(","):
        qtype = Q[name]
        print(f"\n{name}: decoder equals the reference: {check(qtype)}")
        print("| product | M | bf16 cuBLAS | row copy + dequant + cuBLAS | block-major dequant + cuBLAS | decoder GB/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for pname, (n, k) in SHAPES.items():
            x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
            w = random_weight(qtype, n, k)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t = [do_bench(lambda: F.linear(x, dense)),
                 do_bench(lambda: F.linear(x, dequantize_rows(w.to_rows(), torch.bfloat16))),
                 do_bench(lambda: F.linear(x, triton_dequant.dequantize(w, torch.bfloat16)))]
            gbs = (w.nbytes + 2 * n * k) / do_bench(lambda: triton_dequant.dequantize(w, torch.bfloat16)) / 1e6
            f = [tflops(a.m, n, k, v) for v in t]
            cells = " | ".join(f"{v:.0f} ({100 * v / peak:.0f}%)" for v in f)
            print(f"| {pname} ({n}x{k}) | {a.m} | {cells} | {gbs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
