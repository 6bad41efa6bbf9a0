"""Prompt products on block-major quantized weights without a dense copy (issue 20): y = x @ W.T + b with
W's blocks decoded inside the GEMM's K loop, in registers, straight into the tensor cores. The path it
replaces (kernels/linear.dequant_product: triton_dequant.dequantize to bf16, then cuBLAS) spends ~40% of
each product writing and re-reading the dense weight (docs/PERFORMANCE.md, "block-major dequant + cuBLAS").

Weights: block-major QWeight fields (kernels/qweight.py) of triton_dequant's types (Q8_0, Q4_0, Q4_K, Q6_K,
MXFP4, IQ4_NL, IQ4_XS). Each 128-value K step is decoded by triton_dequant.block_tile (the dense decoder's
own tile code, shared) in parts of W = WIDTH[type] columns (16 or 32): tiles lo, hi (BN, W) in the order
the bytes hold them, with their columns clo, chi; x's columns are loaded in that same order (runs of 16-32
contiguous values), so neither side is shuffled. The decoded values are dequantize_torch's, rounded to x's
dtype as the dense copy's were; only the fp32 summation order differs from F.linear(x, dequantize(w)).

What the compiled kernel does (Triton 3.6, the H100 machine's, compiled here for sm_90 and read in its IR
and SASS): the weight bytes and x's tiles are copied to shared memory by cp.async, num_stages deep; each
part's scales are one (BN, 1) load a row; the decode runs in the wgmma A operand's register layout, and
the dots are wgmma with A from registers. Three things in the source decide this: the weight tile is
the first dot operand (out^T (BN, BM) = W (BN, W) @ x^T (W, BM); Config.w_first=False, the other
orientation, stores every decoded tile to shared memory first); each part has one scale a row (a (BN, 64)
tile of four Q4_0 blocks loads its scales per element, and Triton then decodes it in a blocked layout
and copies the result through shared memory every step); the weight rows are masked, not clamped
(rn % N hides that the scales' rows are contiguous: no vector loads, no pipelining). The earlier attempt
(git show 20faf28:kernels/triton_qgemm.py, 5-11% of the bf16 peak) had all three the slow way, and
converted integers with I2F (an eighth of the float rate; block_tile now uses the exact 2^23 trick).
bench/qgemm_sweep.py times the configurations against decode + cuBLAS.

Not dispatched (kernels/linear.qlinear keeps decode + cuBLAS): on an H100 (2026-11-27, sixth session,
docs/PERFORMANCE.md) its best configuration ran a layer's products at 31% (Q4_0), 31% (Q4_K), 23% (Q6_K)
of the bf16 peak at M = 512 against decode + cuBLAS's 52 / 46 / 45%. Kept, with its tests and sweep, as
the measured baseline for the next attempt (the wgmma waits after every part: see the sweep's notes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .qweight import QWeight
from .triton_base import FUSION, INTERPRET
from .triton_dequant import FMT, Q6_K, STEP, UNIT, WIDTH, block_tile, field_args
from .triton_dequant import covers as block_major


@dataclass(frozen=True)
class Config:
    """One launch shape: bm x bn output tile (x rows, weight rows), steps 128-value K steps per loop
    iteration (BK = 128 steps), warps, software-pipeline stages, orientation, row tiles per sweep of
    the weight's column tiles (group: x's tiles stay in L2 while each weight tile is read once)."""

    bm: int = 128
    bn: int = 128
    steps: int = 1
    warps: int = 8
    stages: int = 3
    w_first: bool = True
    group: int = 8


# Per type, no autotuning (a first guess until bench/qgemm_sweep.py has been run on an H100):
# | type | bm | bn | steps | warps | stages | w_first |
# | all  | 128 | 128 | 1    | 8     | 3      | yes     |
DEFAULT = Config()
CONFIGS = {name: DEFAULT for name in FMT}
# Triton's interpreter takes time per program and per op, not per value: small tiles for the tests
INTERPRET_CONFIG = Config(bm=16, bn=32, warps=1, stages=1)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Program -> (row tile of x, row tile of W): GROUP row tiles of x walk the weight's tiles together
    (Triton's matmul tutorial order), so each weight tile is read from memory about once."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    per_group = GROUP * tl.cdiv(N, BN)
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_m - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _dot(acc, w, xrow, cols, K, W_FIRST: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """acc + w (BN, W) times x's columns `cols` (1, W) of the rows xrow (BM, 1) points at:
    acc (BN, BM) when W_FIRST, else (BM, BN)."""
    # every format's columns come in runs of >= 16 values starting at multiples of 16 (block_tile)
    cols = tl.max_contiguous(tl.multiple_of(cols, [1, 16]), [1, 16])
    if EVEN_K:
        xt = tl.load(xrow + cols)
    else:
        xt = tl.load(xrow + cols, mask=cols < K, other=0.0)
    w = w.to(xt.dtype)
    if IEEE:  # fp32 x, or the interpreter (whose bf16 tl.dot is wrong: triton_dense's rule): fp32 products
        w, xt = w.to(tl.float32), xt.to(tl.float32)
        if W_FIRST:
            acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
    elif W_FIRST:
        acc = tl.dot(w, tl.trans(xt), acc)
    else:
        acc = tl.dot(xt, tl.trans(w), acc)
    return acc


# sizes but N are not specialized (divisible by 16 or not): one compiled kernel serves the shapes of a config
# (N is: the row masks' runs of 16 let the scales' loads be vectors)
@triton.jit(do_not_specialize=["M", "K", "n_units", "iters"])
def _qgemm_kernel(x_ptr, out_ptr, bias_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4,
                  M, N, K, n_units, iters, x_stride, out_stride,
                  FMT: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STEPS: tl.constexpr,
                  GROUP: tl.constexpr, W_FIRST: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """out (M, N) = x (M, K) @ W.T (+ bias); one program per (BM, BN) tile of out."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # x rows past the end read earlier rows again (no mask on x); they are not stored. Weight rows take a
    # mask instead: a clamp (rn % N) would hide that the scales' rows are contiguous, and their loads would
    # neither be pipelined nor decoded in the dot operand's layout (the decoded tile would go through
    # shared memory every step)
    xrow = x_ptr + (rm % M).to(tl.int64)[:, None] * x_stride
    r = rn[:, None]
    if W_FIRST:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    for it in range(iters):
        for s in tl.static_range(STEPS):
            for p in tl.static_range(64 // W):  # (BN, W) tiles of one scale a row (see block_tile)
                lo, hi, clo, chi = block_tile(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, r,
                                              r < N, it * STEPS + s, n_units, p, W)
                acc = _dot(acc, lo, xrow, clo, K, W_FIRST, EVEN_K, IEEE)
                acc = _dot(acc, hi, xrow, chi, K, W_FIRST, EVEN_K, IEEE)
    if W_FIRST:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def covers(w: QWeight) -> bool:
    """Whether qgemm takes this weight: block-major fields of a type block_tile decodes."""
    return block_major(w)


def qgemm(x2d: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None,
          config: Config | None = None) -> torch.Tensor:
    """x2d (M, K) bf16 / fp16, w a block-major QWeight (N, K), bias (N,) or None -> (M, N) in x's dtype."""
    assert covers(w) and x2d.shape[1] == w.shape[1], (w.qtype.name, w.shape, x2d.shape)
    x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    out = torch.empty((x2d.shape[0], w.shape[0]), dtype=x2d.dtype, device=x2d.device)
    if out.numel():
        kernel, grid, args, options = launch(x2d, w, bias, out, config)
        kernel[grid](*args, **options, **FUSION)
    return out


def launch(x2d: torch.Tensor, w: QWeight, bias: torch.Tensor | None, out: torch.Tensor,
           config: Config | None = None) -> tuple[triton.JITFunction, tuple[int], list, dict]:
    """The kernel, its grid, arguments and constexpr / launch options for out = x2d @ w.T (+ bias)
    (bench/qgemm_inspect.py compiles the same launch for an H100 without one)."""
    fmt = FMT[w.qtype.name]
    (m, k), n = x2d.shape, w.shape[0]
    cfg = config or (INTERPRET_CONFIG if INTERPRET else CONFIGS[w.qtype.name])
    if fmt == Q6_K and k % (STEP * cfg.steps):  # block_tile reads every Q6_K step unmasked
        cfg = replace(cfg, steps=1)
    bk = STEP * cfg.steps
    ptrs, units, rows = field_args(w)
    args = [x2d, out, bias if bias is not None else out, *ptrs, *units, *rows, m, n, k, k // UNIT[fmt],
            triton.cdiv(k, bk), x2d.stride(0), out.stride(0)]
    options = dict(FMT=fmt, W=WIDTH[fmt], BM=cfg.bm, BN=cfg.bn, STEPS=cfg.steps, GROUP=cfg.group, W_FIRST=cfg.w_first,
                   EVEN_K=k % bk == 0, IEEE=INTERPRET or x2d.dtype == torch.float32, HAS_BIAS=bias is not None,
                   num_warps=cfg.warps, num_stages=cfg.stages)
    return _qgemm_kernel, (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),), args, options
