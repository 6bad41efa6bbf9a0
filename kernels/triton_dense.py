"""Dense (bf16 / f16 / f32) products of a few x rows on tensor cores: the decode step's matrix-vector
products and speculative decoding's verify pass (up to MP = 16 rows), batch-invariant and deterministic.

out[m, n] = sum_k W[n, k] x[m, k] as tl.dot(W tile (BN, BK), x tile (BK, MP)). x comes in W's dtype
(the decode step feeds a norm kernel's or the attention's output): its tiles go from memory to the
tensor cores by the same asynchronous copies as W's, with no pass through registers (a register
pass to scale or cast x cost copy bandwidth at 8B shapes: docs/PERFORMANCE.md, CUDA changelog).
The x tile always has MP rows, the missing ones masked to zero, and the tile shapes and the split of
K depend on (N, K) only: row m's output is the same bits whatever the other rows are, so a verify
pass of several tokens reproduces plain decode steps.

Split K (grid (tiles, split)) adds the parts into an int64 fixed-point accumulator with integer
atomics (triton_epilogue.FIXED_ONE): the same sum in any order, so it needs no ordered reduction
(whose fence and counter cost bandwidth on the small products: docs/PERFORMANCE.md). The decode step keeps its residual
stream and the q|k|v and gate/up sums in such accumulators. Any other output (the head's logits, a
bf16 product) takes one part per tile and the epilogue (bias, rounding, silu(gate) * up, residual).

Reference: x.float() @ W.float().T (within fp32 summation order); with an int64 output, the sum is
added unrounded; otherwise the epilogue does what triton_epilogue.epilogue does, on (BN, MP) tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, INTERPRET, PDL, pdl_start, round_act
from .triton_epilogue import FIXED_ONE

ROWS = 16  # x rows per tile: the smallest tensor-core operand width
MP = tl.constexpr(ROWS)
# (rows per tile BN, K per iteration BK, pipeline stages, warps): the fastest at 8B and 1B shapes on Hopper
# in the tile sweep (docs/PERFORMANCE.md, CUDA changelog).
CONFIG = (64, 128, 4, 4)
if INTERPRET:
    CONFIG = (64, 64, 1, 4)
PROGRAMS_PER_SM = 1.4  # split K until tiles x parts reaches this many programs per SM (fastest in the sweep)


@triton.jit
def _dense_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, act_ptr, M, N, K, x_stride, w_stride, out_stride, PER,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                  GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
                  IEEE: tl.constexpr, PDL: tl.constexpr):
    """Program (tile t, part s): rows [t BN, (t + 1) BN) of W over K [s PER, (s + 1) PER) (PER a
    multiple of BK) -> with an int64 out, its sum added in fixed point (atomically when SPLIT > 1; part
    0 adds the bias); else (SPLIT 1) the finished tile through _finish."""
    pdl_start(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    n = t * BN + tl.arange(0, BN)
    nmask = n < N
    m = tl.arange(0, MP)
    mmask = m < M
    acc = _tile_sums(x_ptr, w_ptr, n, nmask, m, mmask, K, x_stride, w_stride, s * PER, PER, BK, STAGES, IEEE)
    omask = nmask[:, None] & mmask[None, :]
    o = out_ptr + m[None, :] * out_stride + n[:, None]
    if out_ptr.dtype.element_ty == tl.int64:
        if HAS_BIAS:
            if s == 0:
                acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        q = (acc * FIXED_ONE).to(tl.int64)
        if SPLIT > 1:
            tl.atomic_add(o, q, mask=omask, sem="relaxed")
        else:
            tl.store(o, tl.load(o, mask=omask, other=0) + q, mask=omask)
    else:
        _finish(acc, t, n, nmask, m, mmask, out_ptr, bias_ptr, res_ptr, N, out_stride, act_ptr.dtype.element_ty, BN,
                GLU, HAS_BIAS, HAS_RES, ROUND)


@triton.jit
def _tile_sums(x_ptr, w_ptr, n, nmask, m, mmask, K, x_stride, w_stride, k0, PER, BK: tl.constexpr,
               STAGES: tl.constexpr, IEEE: tl.constexpr):
    """(BN, MP) fp32 sums over K [k0, k0 + PER) of W rows n times x rows m, BK at a time."""
    WT: tl.constexpr = w_ptr.dtype.element_ty
    acc = tl.zeros((n.shape[0], MP), tl.float32)
    for k1 in tl.range(k0, tl.minimum(k0 + PER, K), BK, num_stages=STAGES):
        k = k1 + tl.arange(0, BK)
        kmask = k < K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * w_stride + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:  # fp32 weights, or the interpreter (whose bf16 dot is wrong): the same values in fp32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(WT).to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x.to(WT)), acc)
    return acc


@triton.jit
def _finish(acc, t, n, nmask, m, mmask, out_ptr, bias_ptr, res_ptr, N, out_stride, ACT: tl.constexpr,
            BN: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr):
    """acc (BN, MP) fp32 sums -> out rows m < M: + bias, rounded, GLU or + residual (out may be the
    residual itself: in place)."""
    y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    y = round_act(y, ACT, ROUND)
    if GLU:  # rows (gate_i, up_i) interleaved -> out[m, i]
        gate, up = tl.split(tl.permute(tl.reshape(y, (BN // 2, 2, MP)), (0, 2, 1)))
        silu = round_act(gate / (1.0 + tl.exp(-gate)), ACT, ROUND)
        half = t * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + m[None, :] * out_stride + half[:, None], round_act(silu * up, ACT, ROUND),
                 mask=(half < N // 2)[:, None] & mmask[None, :])
    else:
        mask = nmask[:, None] & mmask[None, :]
        if HAS_RES:
            y += tl.load(res_ptr + m[None, :] * out_stride + n[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m[None, :] * out_stride + n[:, None], y, mask=mask)


def dense_split(n: int, k: int, device: torch.device) -> int:
    """Parts of K, from (N, K) and the device alone (batch invariance): doubled until the grid has
    PROGRAMS_PER_SM programs per SM, each part keeping at least two iterations (the interpreter: up
    to 4 parts, so that tests cut K)."""
    bn, bk = CONFIG[:2]
    most = max(1, min(16, k // (2 * bk)))
    if device.type != "cuda":
        return min(4, most)
    target = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    while triton.cdiv(n, bn) * split < target and split * 2 <= most:
        split *= 2
    return split


def gemv_dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               glu: bool = False, act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
               inplace: bool = False) -> torch.Tensor:
    """x (M <= MP, K) -> (M, N) as triton_gemv.gemv (same bias / residual / norm / glu / inplace
    meaning). An int64 residual taken in place is a fixed-point accumulator: the product is added to
    it, split over K (dense_split). norm_weight: x goes through the RMSNorm kernel first
    (triton_prefill.rmsnorm_rows, in the norm weight's dtype); x not in W's dtype is cast to it."""
    if norm_weight is not None:
        from .triton_prefill import rmsnorm_rows

        x = rmsnorm_rows(x, norm_weight, eps)
    act = act_dtype or x.dtype
    if w.dtype != torch.float32 and x.dtype != w.dtype:
        x = x.to(w.dtype)
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    assert m <= ROWS and w.shape[1] == k and w.stride(1) == 1
    bn, bk, stages, warps = CONFIG
    fixed = inplace and residual is not None and residual.dtype == torch.int64
    split = dense_split(n, k, x.device) if fixed else 1
    per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    if inplace:
        out = residual
        assert out is not None and out.dtype in (torch.float32, torch.int64) and out.stride(1) == 1
    else:
        dtype = out_dtype or (residual.dtype if residual is not None else act)
        out = torch.empty((m, n // 2 if glu else n), dtype=dtype, device=x.device)
    assert not (glu and fixed)
    act_ref = torch.empty(1, dtype=act, device=x.device)
    _dense_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        x, w, out, bias if bias is not None else out, residual if residual is not None else out, act_ref,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), per,
        BN=bn, BK=bk, STAGES=stages, SPLIT=triton.cdiv(k, per), GLU=glu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None and not fixed, ROUND=act != torch.float32,
        IEEE=w.dtype == torch.float32 or INTERPRET, PDL=PDL, num_warps=warps, launch_pdl=PDL, **FUSION
    )
    return out
