"""Triton kernels for the elementwise work of a multi-token forward on CUDA (prefill, verification).

Eager torch spends ~40 small kernels a layer around the seven matmuls (casts, the norm's reduction,
rope's halves and concatenation, the cache copies, silu and the product): a large share of an 8B
prefill's GPU time and most of its launches (docs/PERFORMANCE.md). These do the same in three:
  rmsnorm_rows: x (..., C) -> model.RMSNorm(x): weight * (x * rstd).to(dtype), in weight's dtype;
  rope_cache:   q, k, v projections (B, T, H D) -> q rotated (B, H, T, D), k rotated and v written to
                the cache rows [start, start + T): model.rope_rotate + KVCache.update;
  silu_mul:     F.silu(gate) * up in the activation dtype (each op rounded as torch rounds it).
References: those module ops (model.py, cache.py); equal within fp32 summation order (the norm) and
fused multiply-adds (rope), tested under TRITON_INTERPRET against them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start
from .triton_epilogue import from_fixed_jit


@triton.jit
def _rmsnorm_rows_kernel(x_ptr, w_ptr, out_ptr, C, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < C
    x = from_fixed_jit(tl.load(x_ptr + row * C + c, mask=mask, other=0))
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
    ty = w_ptr.dtype.element_ty
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * C + c, ((x * rstd).to(ty).to(tl.float32) * w).to(ty), mask=mask)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C) -> model.RMSNorm's output (..., C) in weight's dtype (also the decode step's norm
    before a float-decoding quantized matvec: backends/cuda_graph.py)."""
    x = x.contiguous()
    c = x.shape[-1]
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    block = triton.next_power_of_2(c)
    _rmsnorm_rows_kernel[(x.numel() // c,)](x, weight, out, c, eps, BLOCK=block, PDL=PDL,
                                            num_warps=min(16, max(1, block // 256)), launch_pdl=PDL, **FUSION)
    return out


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, q_out, k_cache, v_cache, cos_ptr, sin_ptr, T, start, q_row, k_row,
                       v_row, cache_b, cache_h, H, HKV, D: tl.constexpr):
    """Program (token b T + t, head slot j): j < H rotates q head j into q_out (B, T, H, D); j < H + Hkv
    rotates k head j - H into the cache row start + t; else copies v head j - H - Hkv there. q, k, v
    rows (one token each) are q_row, k_row, v_row elements apart (views of one q|k|v product)."""
    bt = tl.program_id(0)
    j = tl.program_id(1)
    b = bt // T
    t = bt % T
    half = tl.arange(0, D // 2)
    c = tl.load(cos_ptr + t * (D // 2) + half)
    s = tl.load(sin_ptr + t * (D // 2) + half)
    if j < H:
        src = q_ptr + bt.to(tl.int64) * q_row + j * D
        dst = q_out + (bt * H + j).to(tl.int64) * D
    elif j < H + HKV:
        src = k_ptr + bt.to(tl.int64) * k_row + (j - H) * D
        dst = k_cache + b.to(tl.int64) * cache_b + (j - H) * cache_h + (start + t) * D
    else:
        src = v_ptr + bt.to(tl.int64) * v_row + (j - H - HKV) * D
        dst = v_cache + b.to(tl.int64) * cache_b + (j - H - HKV) * cache_h + (start + t) * D
    ty = src.dtype.element_ty
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    if j < H + HKV:  # rope_rotate: fp32 halves, rounded to the activation dtype
        y1 = (x1 * c - x2 * s).to(ty)
        y2 = (x2 * c + x1 * s).to(ty)
    else:
        y1 = x1.to(ty)
        y2 = x2.to(ty)
    out_ty = dst.dtype.element_ty
    tl.store(dst + half, y1.to(out_ty))
    tl.store(dst + D // 2 + half, y2.to(out_ty))


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               start: int, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, head_dim: int):
    """q (B, T, H D), k, v (B, T, Hkv D) projections (any row stride: views of one product do);
    k_cache, v_cache (B, Hkv, S, D) of one layer; cos, sin (T, D / 2) fp32 -> q rotated as a
    (B, H, T, D) view of a (B, T, H, D) tensor (so that attention's output needs no transposing
    copy) and the cache views of rows [0, start + T)."""
    b, t, _ = q.shape
    rows = []
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(0) == t * x.stride(1), "projections need (B, T) rows"
        rows.append(x.stride(1))
    q_out = torch.empty((b, t, n_heads, head_dim), dtype=q.dtype, device=q.device)
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim and k_cache.stride() == v_cache.stride()
    _rope_cache_kernel[(b * t, n_heads + 2 * n_kv)](
        q, k, v, q_out, k_cache, v_cache, cos.contiguous(), sin.contiguous(), t, start, *rows,
        k_cache.stride(0), k_cache.stride(1), n_heads, n_kv, D=head_dim, num_warps=1, **FUSION)
    end = start + t
    return q_out.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end]


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, step, BLOCK: tl.constexpr):
    """out[i] = silu(g[i step]) * u[i step] for i < n, rounded as torch rounds each op."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    ty = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + i * step, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i * step, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + i, (silu * u).to(ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up, both (..., N) of one dtype; or with up None, gate is (..., 2N) of interleaved
    (gate, up) pairs (a fused gate/up product: backends/cuda.py fuse)."""
    if up is None:
        gate = gate.contiguous()
        out = torch.empty((*gate.shape[:-1], gate.shape[-1] // 2), dtype=gate.dtype, device=gate.device)
        g, u, step = gate, gate[..., 1:], 2
    else:
        g, u, step = gate.contiguous(), up.contiguous(), 1
        out = torch.empty_like(g)
    n = out.numel()
    _silu_mul_kernel[(triton.cdiv(n, 2048),)](g, u, out, n, step, BLOCK=2048, num_warps=4, **FUSION)
    return out
