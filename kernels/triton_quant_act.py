"""The activation quantizer of the integer-dot products (kernels/triton_q8.py, triton_moe.py): x (M, K)
-> int8 q per 32 values, fp32 block scales d and int32 sums s over 16 values, quantize.act.quantize_act's
rule bit for bit (tests/test_triton_q8.py). RMSNorm, or the GLU of a product's gate/up sums, is fused
into that pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, INTERPRET, PDL, pdl_trigger, pdl_wait
from .triton_epilogue import from_fixed_jit, gate_act
from .triton_gemv import row_rstd


@triton.jit
def _quant_act_kernel(x_ptr, nw_ptr, act_ptr, q_ptr, d_ptr, s_ptr, K, x_stride, eps, NORM: tl.constexpr,
                      GLU: tl.constexpr, BLOCKS: tl.constexpr, RSTD_BLOCK: tl.constexpr, WHOLE: tl.constexpr,
                      PDL: tl.constexpr, GELU: tl.constexpr = False):
    """Row m, 32-value blocks [BLOCKS * j, BLOCKS * (j + 1)) of x (grid: (M, blocks / BLOCKS)) -> q, d, s
    as quantize.act.quantize_act of x; NORM: of x * rstd(x) * norm weight, in fp32 (WHOLE: the program
    holds the whole row and takes rstd from the values it loaded, one pass over x instead of two,
    about a third faster); GLU: x is (M, 2K)
    fp32 sums of interleaved (gate, up) rows, the values are silu(gate) * up rounded like model.py's
    modules in the activation dtype, and the sums are cleared (zeros) for the next accumulation.
    The next kernel (a product, loading weights before its wait) is let be scheduled at the start:
    doing so only once x's loads were issued was slower (docs/PERFORMANCE.md)."""
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bm = b < K // 32
    cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
    pdl_trigger(PDL)
    if NORM:  # the norm weight is never written: loaded before the wait
        nw = tl.load(nw_ptr + cols, mask=bm[:, None], other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if GLU:
        src = x_ptr + m * x_stride + 2 * cols
        v = _glu_values(src, bm[:, None], act_ptr.dtype.element_ty, GELU)
    else:
        v = from_fixed_jit(tl.load(x_ptr + m * x_stride + cols, mask=bm[:, None], other=0))
    if NORM:
        if WHOLE:
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, 1), 0) / K + eps)
        else:
            rstd = row_rstd(x_ptr + m * x_stride, K, eps, RSTD_BLOCK)
        v = v * rstd * nw
    store_blocks(v, b, bm, q_ptr + m * K, d_ptr + m * (K // 32), s_ptr + m * (K // 16), BLOCKS)


@triton.jit
def _glu_values(src, mask, ACT: tl.constexpr, GELU: tl.constexpr = False):
    """silu(gate) * up of the interleaved (gate, up) sums at src, src + 1 (fp32, or int64 fixed point)
    where mask, every op rounded to ACT as model.py's modules round it; the sums are cleared (zeros)
    for the next accumulation. Loads bypass L1 (.cg): other programs' atomics wrote the sums."""
    gate = from_fixed_jit(tl.load(src, mask=mask, other=0, cache_modifier=".cg")).to(ACT).to(tl.float32)
    up = from_fixed_jit(tl.load(src + 1, mask=mask, other=0, cache_modifier=".cg")).to(ACT).to(tl.float32)
    tl.store(src, tl.zeros(gate.shape, src.dtype.element_ty), mask=mask)
    tl.store(src + 1, tl.zeros(up.shape, src.dtype.element_ty), mask=mask)
    silu = gate_act(gate, GELU).to(ACT).to(tl.float32)
    return (silu * up).to(ACT).to(tl.float32)


@triton.jit
def store_blocks(v, b, bm, q_row, d_row, s_row, BLOCKS: tl.constexpr):
    """v (BLOCKS, 32) fp32 values of 32-value blocks b of one row (those where bm) -> its q, d, s
    (quantize.act's rule)."""
    d = tl.div_rn(tl.max(tl.abs(v), 1), 127.0)
    inv = tl.where(d == 0, 0.0, tl.div_rn(1.0, tl.where(d == 0, 1.0, d)))
    t = v * inv[:, None]
    a = tl.abs(t)  # roundf(t), exactly as quantize.simple.round_away
    f = tl.floor(a)
    q = (f + tl.floor(2 * (a - f))).to(tl.int32)
    q = tl.where(t < 0, -q, q)
    cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
    tl.store(q_row + cols, q.to(tl.int8), mask=bm[:, None])
    tl.store(d_row + b, d, mask=bm)
    lo = tl.arange(0, 32)[None, :] < 16  # the 16-value sums, as two masked row sums (no reshape: no
    tl.store(s_row + 2 * b, tl.sum(tl.where(lo, q, 0), 1), mask=bm)  # layout change through shared memory)
    tl.store(s_row + 2 * b + 1, tl.sum(tl.where(lo, 0, q), 1), mask=bm)


def act_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (q int8 (m, k), d fp32 (m, k / 32), s int32 (m, k / 16)) for a quantized activation."""
    return (torch.empty((m, k), dtype=torch.int8, device=device),
            torch.empty((m, k // 32), dtype=torch.float32, device=device),
            torch.empty((m, k // 16), dtype=torch.int32, device=device))


WHOLE_ROW_BLOCKS = 256  # norm rows of up to this many 32-value blocks take one program (K <= 8192)
WHOLE_ROW_WARPS = 8


def quantize_act(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 glu_dtype: torch.dtype | None = None, blocks: int = 16,
                 gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q int8 (M, K), d fp32 (M, K / 32), s int32 (M, K / 16)): quantize.act.quantize_act
    of x, or of RMSNorm(x) (x * rstd * weight in fp32) with norm_weight. glu_dtype: x is instead the
    (M, 2K) sums of interleaved gate/up rows (gemv_q8 into a zeroed buffer; fp32, or int64 fixed
    point: triton_epilogue.FIXED_ONE), the values are silu(gate) * up rounded to glu_dtype as the
    modules round them (gelu: gelu_tanh(gate) * up), and x is zeroed as it is read."""
    x = x if glu_dtype is not None else x.contiguous()
    m, k = x.shape[0], x.shape[1] // (2 if glu_dtype is not None else 1)
    assert glu_dtype is None or (x.dtype in (torch.float32, torch.int64) and x.stride(1) == 1)
    q, d, s = act_buffers(m, k, x.device)
    act_ref = torch.empty(1, dtype=glu_dtype or torch.float32, device=x.device)
    blocks, warps = 64 if INTERPRET else blocks, 4
    if norm_weight is not None and k // 32 <= WHOLE_ROW_BLOCKS:  # one program a row (WHOLE)
        blocks, warps = triton.next_power_of_2(k // 32), WHOLE_ROW_WARPS
    grid = (m, triton.cdiv(k // 32, blocks))
    _quant_act_kernel[grid](x, norm_weight if norm_weight is not None else x, act_ref, q, d, s, k, x.stride(0), eps,
                            NORM=norm_weight is not None, GLU=glu_dtype is not None, BLOCKS=blocks,
                            RSTD_BLOCK=min(triton.next_power_of_2(k), 8192), WHOLE=blocks * 32 >= k,
                            PDL=PDL, GELU=gelu, num_warps=warps, launch_pdl=PDL, **FUSION)
    return q, d, s
