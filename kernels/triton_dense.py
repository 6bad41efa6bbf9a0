"""Dense (bf16 / f16 / f32) products of a few x rows on tensor cores: the decode step's matrix-vector
products and speculative decoding's verify pass (up to MP = 16 rows), batch-invariant and deterministic.

out[m, n] = sum_k W[n, k] x'[m, k] as tl.dot(W tile (BN, BK), x' tile (BK, MP)), where x' is x
rounded to W's dtype (x * the RMSNorm weight first, with NORM; rstd is applied to the fp32 sum, as
triton_gemv does). The x tile always has MP rows, the missing ones masked to zero, and the tile
shapes, split over K and summation order depend on (N, K) only: row m's output is the same bits
whatever the other rows are, so a verify pass of several tokens reproduces plain decode steps.
A tile cut over K between programs (for enough programs on few rows) is deterministic too: each
program stores its partial (BN, MP) sums, and the last of them to finish (an atomic counter, reset
by it for the next call or graph replay) adds them in part order and runs the epilogue; fp32
atomics into the output would add in whatever order the programs finish.

Reference: x'.float() @ W.float().T (within fp32 summation order); the epilogue (bias, residual,
silu(gate) * up on interleaved rows, rounding to the activation dtype) does what
triton_epilogue._epilogue does, on (BN, MP) tiles.
Why tensor cores at one row: the float kernel (triton_gemv) spends ~4 instructions per weight and
per x row, which already limits it at one row and makes a 6-row verify pass cost ~4 plain steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import INTERPRET, PDL, _pdl_wait, _round
from .triton_epilogue import COUNTERS, _last_part

ROWS = 16  # x rows per tile: the smallest tensor-core operand width
MP = tl.constexpr(ROWS)
# (rows per tile BN, K per unit BK, pipeline stages, warps, programs per SM): bench/dense_tune.py (H200).
CONFIG = (64, 128, 3, 4, 2)
if INTERPRET:
    CONFIG = (64, 64, 1, 4, 1)


@triton.jit
def _rstd_rows(x_ptr, x_stride, M, K, eps, RB: tl.constexpr):
    """(MP,) 1 / sqrt(mean(x^2) + eps) of x rows 0..MP-1 (rows >= M: 1 / sqrt(eps), unused)."""
    m = tl.arange(0, MP)
    acc = tl.zeros((MP, RB), tl.float32)
    for k0 in range(0, K, RB):
        k = k0 + tl.arange(0, RB)
        v = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        v = v.to(tl.float32)
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, 1) / K + eps)


@triton.jit
def _owner(u, P, U):
    """The program whose units [p U / P, (p + 1) U / P) (floored) hold unit u."""
    return ((u + 1) * P + U - 1) // U - 1


@triton.jit
def _dense_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, nw_ptr, act_ptr, ws_ptr, cnt_ptr,
                  M, N, K, x_stride, w_stride, out_stride, eps, KI, SEGS,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr,
                  GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
                  IEEE: tl.constexpr, PDL: tl.constexpr):
    """Stream-K: the product is U = tiles x KI units (a tile: BN output rows; a unit: BK of its K), and
    program p of P (grid: (P,)) takes units [p U / P, (p + 1) U / P): equal work for every program
    whatever the tile count (a few hundred tiles over a few hundred program slots would otherwise
    leave SMs idle for a last partial wave). A tile met whole is finished by its program; a tile cut
    between programs gets one partial (BN, M) sum per program in ws[part] (ws (parts, N, MP) fp32),
    and the last of them to finish (cnt: a zeroed int32 per tile, reset by it) adds the parts in
    part order and runs the epilogue. SEGS: the most tiles one program meets."""
    _pdl_wait(PDL)
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    WT: tl.constexpr = w_ptr.dtype.element_ty
    p = tl.program_id(0).to(tl.int64)
    P = tl.num_programs(0)
    U = tl.cdiv(N, BN).to(tl.int64) * KI
    u = p * U // P
    end = (p + 1) * U // P
    m = tl.arange(0, MP)
    mmask = m < M
    for _ in range(SEGS):
        if u < end:
            t = u // KI
            seg_end = tl.minimum(end, (t + 1) * KI)
            n = t * BN + tl.arange(0, BN)
            nmask = n < N
            acc = tl.zeros((BN, MP), tl.float32)
            for ki in tl.range(u - t * KI, seg_end - t * KI, num_stages=STAGES):
                k = ki * BK + tl.arange(0, BK)
                kmask = k < K
                w = tl.load(w_ptr + n.to(tl.int64)[:, None] * w_stride + k[None, :],
                            mask=nmask[:, None] & kmask[None, :], other=0.0)
                x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mmask[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                if NORM:
                    x = x * tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
                if IEEE:  # fp32 weights, or the interpreter (whose bf16 dot is wrong): the same values in fp32
                    acc = tl.dot(w.to(tl.float32), tl.trans(x.to(WT).to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(x.to(WT)), acc)
            if (u == t * KI) & (seg_end == (t + 1) * KI):  # the whole tile
                _finish(acc, t, n, nmask, m, mmask, x_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, x_stride, out_stride,
                        eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND)
            else:
                first = _owner(t * KI, P, U)
                parts = _owner((t + 1) * KI - 1, P, U) - first + 1
                tile = ws_ptr + n[:, None] * MP + m[None, :]
                pmask = nmask[:, None] & mmask[None, :]  # only the M real rows: partial traffic ~ M, not MP
                tl.store(tile + (p - first) * N * MP, acc, mask=pmask)
                if _last_part(cnt_ptr, t, parts):  # sum the parts in order, then the epilogue
                    acc = tl.zeros((BN, MP), tl.float32)
                    for j in range(parts):
                        acc += tl.load(tile + j * N * MP, mask=pmask, other=0.0, cache_modifier=".cg")
                    tl.store(cnt_ptr + t, 0)  # ready for the next call (or graph replay)
                    _finish(acc, t, n, nmask, m, mmask, x_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, x_stride,
                            out_stride, eps, ACT, BN, NORM, GLU, HAS_BIAS, HAS_RES, ROUND)
            u = seg_end


@triton.jit
def _finish(acc, t, n, nmask, m, mmask, x_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, x_stride, out_stride, eps,
            ACT: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, ROUND: tl.constexpr):
    """acc (BN, MP) fp32 sums -> out rows m < M: rstd, + bias, rounded, GLU or + residual (out may be
    the residual itself: in place)."""
    y = acc
    if NORM:
        y = y * _rstd_rows(x_ptr, x_stride, M, K, eps, 512)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    y = _round(y, ACT, ROUND)
    if GLU:  # rows (gate_i, up_i) interleaved -> out[m, i]
        gate, up = tl.split(tl.permute(tl.reshape(y, (BN // 2, 2, MP)), (0, 2, 1)))
        silu = _round(gate / (1.0 + tl.exp(-gate)), ACT, ROUND)
        half = t * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + m[None, :] * out_stride + half[:, None], _round(silu * up, ACT, ROUND),
                 mask=(half < N // 2)[:, None] & mmask[None, :])
    else:
        mask = nmask[:, None] & mmask[None, :]
        if HAS_RES:
            y += tl.load(res_ptr + m[None, :] * out_stride + n[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m[None, :] * out_stride + n[:, None], y, mask=mask)


def programs(units: int, occupancy: int, device: torch.device) -> int:
    """P: `occupancy` programs per SM (the interpreter: a few, so that tiles are cut between them)."""
    if device.type != "cuda":
        return min(units, 5)
    return min(units, occupancy * torch.cuda.get_device_properties(device).multi_processor_count)


def gemv_dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               glu: bool = False, act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
               inplace: bool = False, counters: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x (M <= MP, K) -> (M, N) as triton_gemv.gemv (same bias / residual / norm / glu / inplace meaning;
    the output is always the finished one). counters: a zeroed int32 tensor of COUNTERS the caller
    keeps across calls (each call leaves it zeroed); None: a new one. config: (BN, BK, stages, warps,
    programs per SM), the same for every M (batch invariance)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= ROWS and w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    act = act_dtype or (norm_weight.dtype if norm_weight is not None else x.dtype)
    bn, bk, stages, warps, occupancy = config or CONFIG
    tiles, ki = triton.cdiv(n, bn), triton.cdiv(k, bk)
    units = tiles * ki
    p = programs(units, occupancy, x.device)
    per = triton.cdiv(units, p)
    parts = min(ki, triton.cdiv(ki, max(units // p, 1)) + 1)  # programs one tile can be cut between
    if inplace:
        out = residual
        assert out is not None and out.dtype == torch.float32 and out.stride(1) == 1
    else:
        dtype = out_dtype or (residual.dtype if residual is not None else act)
        out = torch.empty((m, n // 2 if glu else n), dtype=dtype, device=x.device)
    ws = torch.empty((parts, n, ROWS), dtype=torch.float32, device=x.device)
    if counters is None:
        counters = torch.zeros(COUNTERS, dtype=torch.int32, device=x.device)
    assert tiles <= counters.numel()
    act_ref = torch.empty(1, dtype=act, device=x.device)
    _dense_kernel[(p,)](
        x, w, out, bias if bias is not None else out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, act_ref, ws, counters,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), eps, ki, triton.cdiv(per, ki) + 1,
        BN=bn, BK=bk, STAGES=stages, NORM=norm_weight is not None, GLU=glu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, ROUND=act != torch.float32, IEEE=w.dtype == torch.float32 or INTERPRET,
        PDL=PDL, num_warps=warps, launch_pdl=PDL,
    )
    return out
