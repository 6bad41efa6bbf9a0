"""Triton kernels of one batch-1 decode step around the KV cache (shapes for one layer).

rope_store: qkv (1, (H + 2 Hkv) D) -> q rotated (H, D); k rotated and v written into the cache rows at
  `pos`. Must match model.rope_rotate with model.rope_tables' angles (pos * inv_freq in fp32) and
  KVCache.update.
decode_attention: q (H, D) against cache rows [0, pos] of k, v (Hkv, S, D) -> (1, H D). Must match
  F.scaled_dot_product_attention(q, k[:, :pos+1], v[:, :pos+1], enable_gqa=True) (scale 1/sqrt(D)),
  computed with an online softmax in fp32. `pos` is a device tensor, so both run inside a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_store(src, dst, c, s, HALF: tl.constexpr, ROTATE: tl.constexpr):
    i = tl.arange(0, HALF)
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    if ROTATE:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    ty = dst.dtype.element_ty
    tl.store(dst + i, y1.to(src.dtype.element_ty).to(ty))
    tl.store(dst + HALF + i, y2.to(src.dtype.element_ty).to(ty))


@triton.jit
def _rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, head_stride, H, HKV,
                       D: tl.constexpr):
    """Program j < H: q head j; j < H + Hkv: k head; else v head (grid: H + 2 Hkv)."""
    j = tl.program_id(0)
    pos = tl.load(pos_ptr)
    half = tl.arange(0, D // 2)
    ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)
    c = tl.cos(ang)
    s = tl.sin(ang)
    src = qkv_ptr + j * D
    if j < H:
        _rotate_store(src, q_ptr + j * D, c, s, D // 2, True)
    elif j < H + HKV:
        _rotate_store(src, k_ptr + (j - H) * head_stride + pos * D, c, s, D // 2, True)
    else:
        _rotate_store(src, v_ptr + (j - H - HKV) * head_stride + pos * D, c, s, D // 2, False)


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, head_stride, scale,
                        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per query head h, reading kv head h // GROUP over rows [0, pos]."""
    h = tl.program_id(0)
    kv = (h // GROUP).to(tl.int64) * head_stride
    n = tl.load(pos_ptr) + 1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
    m_i = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros((BLOCK_S,), tl.float32), 0)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(0, n, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        valid = rows < n
        offs = kv + rows[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(out_ptr + h * D + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def rope_store(qkv, k_cache, v_cache, pos, inv_freq, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """qkv (1, (H + 2 Hkv) D) contiguous; k_cache, v_cache (Hkv, S, D) of one layer -> q (H, D)."""
    q = torch.empty((n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    grid = (n_heads + 2 * n_kv,)
    _rope_store_kernel[grid](qkv, q, k_cache, v_cache, pos, inv_freq, k_cache.stride(0), n_heads, n_kv,
                             D=head_dim, num_warps=1)
    return q


def decode_attention(q, k_cache, v_cache, pos, n_kv: int) -> torch.Tensor:
    """q (H, D), caches (Hkv, S, D) -> (1, H D) in q's dtype."""
    h, d = q.shape
    out = torch.empty((1, h * d), dtype=q.dtype, device=q.device)
    _decode_attn_kernel[(h,)](q, k_cache, v_cache, out, pos, k_cache.stride(0), 1.0 / math.sqrt(d),
                              GROUP=h // n_kv, D=d, BLOCK_S=64 if d <= 64 else 32, num_warps=4)
    return out
