"""Prompt products on quantized weights (issue 20): kernels/triton_qgemm.qgemm against today's path
(dequantize to bf16, then cuBLAS) and against cuBLAS on bf16 weights, on the 8B shape's layer products.

    python bench/qgemm.py [--m 512] [--types Q8_0,Q4_0,Q4_K,Q6_K] [--configs all]

Weights are random bytes in each type's block-major layout (timing does not depend on the values); a
small quantized weight checks the kernel against the decoded matmul first. Figures: TFLOP/s, and the
share of the peak measured in this run (cuBLAS bf16 on an 8192^3 product), the roofline of issue 20's
"quantized prefill >= 55% of peak" goal.
"""

from __future__ import annotations

import argparse

import gguf
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from localllm.kernels import triton_qgemm
from localllm.kernels.linear import dequantize_qweight
from localllm.kernels.qweight import QWeight
from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType
# llama-3.1-8b: fused q|k|v, o, fused gate|up, down (N, K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [(128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (256, 128, 8, 3),
           (128, 128, 8, 4), (64, 256, 8, 3)]


def random_weight(qtype, n: int, k: int) -> QWeight:
    fmt = FORMATS[qtype]
    raw = torch.randint(0, 256, (n, k // fmt.block * fmt.nbytes), dtype=torch.uint8, device="cuda")
    w = QWeight.from_raw(raw, qtype).to_blocks()
    for name, t in w.parts.items():  # finite scales: fp16 fields get small values
        if t.dtype == torch.float16:
            t.copy_(torch.rand_like(t, dtype=torch.float32).mul_(1e-2).half())
    return w


def check(qtype) -> float:
    w = torch.randn(256, 1024)
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    ref = dequantize_torch(raw, qtype).cuda()
    qw = QWeight.from_raw(raw.cuda(), qtype).to_blocks()
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    got = triton_qgemm.qgemm(x, qw).float()
    want = x.float() @ ref.bfloat16().float().T
    return ((got - want).norm() / want.norm()).item()


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--configs", default="all", help="all, or BM:BN:WARPS:STAGES[,...]")
    a = ap.parse_args()
    configs = CONFIGS if a.configs == "all" else [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",")]
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = tflops(8192, 8192, 8192, do_bench(lambda: big @ big))
    print(f"{torch.cuda.get_device_name()}: cuBLAS bf16 8192^3 {peak:.0f} TFLOP/s (the peak below)")
    for name in a.types.split(","):
        qtype = Q[name]
        print(f"\n{name}: kernel vs decoded matmul, rel. error {check(qtype):.2e}")
        print("| product | M | bf16 cuBLAS | dequant + cuBLAS | qgemm best | config | % of peak |")
        print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
        for pname, (n, k) in SHAPES.items():
            x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
            w = random_weight(qtype, n, k)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t_dense = do_bench(lambda: F.linear(x, dense))
            t_deq = do_bench(lambda: F.linear(x, dequantize_qweight(w, torch.bfloat16)))
            best = None
            for bm, bn, warps, stages in configs:
                try:
                    t = do_bench(lambda: triton_qgemm.qgemm(x, w, bm=bm, bn=bn, num_warps=warps, num_stages=stages))
                except Exception as e:  # out of shared memory / registers for this config
                    print(f"  ({bm},{bn},{warps},{stages}): {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, (bm, bn, warps, stages))
            f = [tflops(a.m, n, k, t) for t in (t_dense, t_deq, best[0])]
            print(f"| {pname} ({n}x{k}) | {a.m} | {f[0]:.0f} | {f[1]:.0f} | {f[2]:.0f} | {best[1]} | "
                  f"{100 * f[2] / peak:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
