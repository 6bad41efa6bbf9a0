"""Experiment: Q8_0 decode products on int8 tensor cores, against the committed integer-dot kernel
(kernels/triton_q8.py), at Llama 3.1 8B shapes, each alone in a CUDA graph over >= 400 MB of weights.

    python bench/q8_tensorcore.py

The tensor-core form keeps Q8_0's planar layout (qs int8 (N, K), d fp16 (N, K/32)) and quantize_act's
int8 x: per 32-value block, tl.dot(W block (BN, 32) int8, x block (32, 16) int8) -> int32 (exact, as
dp4a sums), times d_w d_x into fp32; K split into an int64 fixed-point accumulator as
triton_dense does. A third column decodes whole (BN, BK) tiles in registers (q * d rounded to bf16)
and takes bf16 x, one tl.dot per tile. Each column's error is against the fp64 product of the
values it multiplies (dequantized W; int8 x, or bf16 x).
Not used by localllm: it measures whether this structure would lift the quantized decode bars.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graph_timing import graph_seconds
from localllm.kernels import triton_q8
from localllm.kernels.qweight import Q, QWeight
from localllm.kernels.triton_base import PDL, _pdl_start
from localllm.kernels.triton_epilogue import FIXED_ONE, from_fixed
from localllm.commands.bench import copy_bandwidth
from localllm.quantize import dequantize_torch, quantize_tensor

SHAPES = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
MP = tl.constexpr(16)


@triton.jit
def _q8tc_kernel(xq_ptr, xd_ptr, wq_ptr, wd_ptr, out_ptr, M, N, K, PER, BN: tl.constexpr, BLOCKS: tl.constexpr,
                 STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (tile t, part s): rows [t BN, (t + 1) BN) over K [s PER, (s + 1) PER), BLOCKS 32-value
    blocks an iteration -> added into the int64 accumulator out (M, N)."""
    _pdl_start(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    n = t * BN + tl.arange(0, BN)
    m = tl.arange(0, MP)
    mmask = m < M
    i = tl.arange(0, 32)
    KB = K // 32
    acc = tl.zeros((BN, MP), tl.float32)
    k0 = s * PER
    for k1 in tl.range(k0, tl.minimum(k0 + PER, K), 32 * BLOCKS, num_stages=STAGES):
        for j in tl.static_range(BLOCKS):
            kb = k1 // 32 + j
            w = tl.load(wq_ptr + n.to(tl.int64)[:, None] * K + (kb * 32 + i)[None, :])
            x = tl.load(xq_ptr + m[:, None] * K + (kb * 32 + i)[None, :], mask=mmask[:, None], other=0)
            wd = tl.load(wd_ptr + n.to(tl.int64) * KB + kb).to(tl.float32)
            xd = tl.load(xd_ptr + m * KB + kb, mask=mmask, other=0.0)
            dot = tl.dot(w, tl.trans(x), out_dtype=tl.int32)
            acc += dot.to(tl.float32) * wd[:, None] * xd[None, :]
    o = out_ptr + m[None, :] * N + n[:, None]
    tl.atomic_add(o, (acc * FIXED_ONE).to(tl.int64), mask=mmask[None, :], sem="relaxed")


@triton.jit
def _q8tile_kernel(x_ptr, wq_ptr, wd_ptr, out_ptr, M, N, K, PER, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr, PDL: tl.constexpr):
    """The other structure: a whole (BN, BK) int8 tile decoded in registers (q * d, rounded to bf16)
    and multiplied with bf16 x (the norm kernel's output, as triton_dense takes it) in one tl.dot."""
    _pdl_start(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    n = t * BN + tl.arange(0, BN)
    m = tl.arange(0, MP)
    mmask = m < M
    KB = K // 32
    acc = tl.zeros((BN, MP), tl.float32)
    k0 = s * PER
    for k1 in tl.range(k0, tl.minimum(k0 + PER, K), BK, num_stages=STAGES):
        k = k1 + tl.arange(0, BK)
        w = tl.load(wq_ptr + n.to(tl.int64)[:, None] * K + k[None, :])
        wd = tl.load(wd_ptr + n.to(tl.int64)[:, None] * KB + (k1 // 32 + tl.arange(0, BK // 32))[None, :])
        wv = tl.reshape(tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * wd.to(tl.float32)[:, :, None], (BN, BK))
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None], other=0.0)
        acc = tl.dot(wv.to(tl.bfloat16), tl.trans(x), acc)
    o = out_ptr + m[None, :] * N + n[:, None]
    tl.atomic_add(o, (acc * FIXED_ONE).to(tl.int64), mask=mmask[None, :], sem="relaxed")


def q8tile(x16: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor, config) -> None:
    n, k = qs.shape
    bn, bk, stages, warps, split = config
    per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    _q8tile_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        x16, qs, d, out, x16.shape[0], n, k, per, BN=bn, BK=bk, STAGES=stages, PDL=PDL, num_warps=warps,
        launch_pdl=PDL)


TILE_CONFIGS = [(bn, bk, stages, warps, split) for bn in (64, 128) for bk in (64, 128) for stages in (3, 4)
                for warps in (4, 8) for split in (1, 2, 4)]


def q8tc(xa, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor, config) -> None:
    q, xd, _ = xa
    n, k = qs.shape
    bn, blocks, stages, warps, split = config
    per = triton.cdiv(triton.cdiv(k, split), 32 * blocks) * 32 * blocks
    _q8tc_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        q, xd, qs, d, out, q.shape[0], n, k, per, BN=bn, BLOCKS=blocks, STAGES=stages, PDL=PDL, num_warps=warps,
        launch_pdl=PDL)


CONFIGS = [(bn, blocks, stages, 4, split) for bn in (64, 128) for blocks in (2, 4) for stages in (3, 4, 6)
           for split in (1, 2, 4)]


def sweep(configs, product, acc: torch.Tensor, ref: torch.Tensor, copies: int):
    """-> (seconds per product, config, relative error vs ref) of the fastest config that runs."""
    best = None
    for cfg in configs:
        try:
            acc.zero_()
            product(cfg)
            e = ((from_fixed(acc).double() - ref).norm() / ref.norm()).item()
            t = graph_seconds(lambda: [product(cfg) for _ in range(copies)]) / copies
        except Exception as ex:  # noqa: BLE001 (out of shared memory, ...)
            print(f"  {cfg}: {type(ex).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg, e)
    return best


def main() -> None:
    dev = "cuda"
    bw = copy_bandwidth(torch.device(dev))
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e9:.0f} GB/s")
    print("| product | integer-dot (committed) | int8 tensor cores per block (BN, blocks, stages, warps, split) | "
          "tiles decoded to bf16, bf16 x (BN, BK, stages, warps, split) |")
    print("| --- | ---: | --- | --- |")
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        base = torch.randn(2048, k, device=dev, generator=g)
        raw = torch.from_numpy(quantize_tensor(base, Q.Q8_0)).to(dev).repeat(n // 2048, 1)
        planar = QWeight.from_raw(raw, Q.Q8_0)
        qs, d = planar.parts["qs"].view(torch.int8), planar.parts["d"]
        blocks = planar.to_blocks()
        copies = max(2, (400 << 20) // (n * k) + 1)
        x = torch.randn(1, k, device=dev)
        xa = triton_q8.quantize_act(x)
        ref = (triton_q8.quantize_act(x)[0].double() * xa[1].double().repeat_interleave(32, 1)) @ \
            dequantize_torch(raw, Q.Q8_0).double().T
        acc = torch.zeros(1, n, dtype=torch.int64, device=dev)
        t_int = graph_seconds(lambda: [triton_q8.gemv_q8(xa, blocks, residual=acc, split=None, inplace=True)
                                       for _ in range(copies)]) / copies
        acc.zero_()
        triton_q8.gemv_q8(xa, blocks, residual=acc, split=None, inplace=True)
        e_int = ((from_fixed(acc).double() - ref).norm() / ref.norm()).item()
        best = sweep(CONFIGS, lambda cfg: q8tc(xa, qs, d, acc, cfg), acc, ref, copies)
        x16 = x.to(torch.bfloat16)
        ref16 = x16.double() @ dequantize_torch(raw, Q.Q8_0).double().T
        tile = sweep(TILE_CONFIGS, lambda cfg: q8tile(x16, qs, d, acc, cfg), acc, ref16, copies)
        share = lambda t: f"{n * k * 1.0625 / t / bw:.1%}"  # noqa: E731
        print(f"| {name} {n}x{k} | {share(t_int)} ({t_int * 1e6:.1f} us, err {e_int:.1e}) | "
              f"{share(best[0])} ({best[0] * 1e6:.1f} us, err {best[2]:.1e}) {best[1]} | "
              f"{share(tile[0])} ({tile[0] * 1e6:.1f} us, err {tile[2]:.1e}) {tile[1]} |", flush=True)


if __name__ == "__main__":
    main()
