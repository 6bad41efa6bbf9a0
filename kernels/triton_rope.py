"""rope_store for the families beyond the Llama layer (decode step, one layer; shapes as
triton_attention.rope_store): qkv (B T, (H + 2 Hkv) D) -> q (B T H, D) rotated; k rotated and v written
into the cache rows pos + t.

Differences from triton_attention.rope_store (which the Llama layer keeps): only the first R dims of a
head rotate, the pairs (i, i + R/2) (partial rotary, Phi-4-mini; R = D otherwise); cos and sin are
multiplied by `factor` (YaRN / LongRoPE attention factor); inv_freq None = a NoPE layer (SmolLM3):
nothing rotates. Must match rope.rope_rotate with rope.rope_table's angles (pos * inv_freq in fp32,
times factor) and KVCache.update.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start
from .triton_epilogue import from_fixed_jit


@triton.jit
def rotate_pair(x, xp, i, pos, inv_freq_ptr, factor, R: tl.constexpr):
    """Values x[i] of a head and their rotation partners xp (x[i + R/2] or x[i - R/2]) -> the neox rope
    of the first R dims at position pos (cos and sin times factor), the rest unchanged: rope.rope_rotate."""
    half: tl.constexpr = R // 2
    rot = i < R
    ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + i % half, mask=rot, other=0.0)
    c = tl.cos(ang) * factor
    s = tl.sin(ang) * factor
    return tl.where(rot, tl.where(i < half, x * c - xp * s, x * c + xp * s), x)


@triton.jit
def _rotate_head(src, dst, pos, inv_freq_ptr, factor, R: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
                 CLEAR: tl.constexpr):
    """One head's D values at src (fp32, or an int64 fixed-point accumulator) -> dst, the first R
    rotated (ROTATE), rounded as triton_attention._rotate_store rounds them; CLEAR zeroes src."""
    i = tl.arange(0, D)
    x = from_fixed_jit(tl.load(src + i))
    if ROTATE:
        half: tl.constexpr = R // 2
        rot = i < R
        partner = tl.where(i < half, i + half, i - half)
        xp = from_fixed_jit(tl.load(src + partner, mask=rot, other=0))
        y = rotate_pair(x, xp, i, pos, inv_freq_ptr, factor, R)
    else:
        y = x
    if CLEAR:  # every thread has loaded its values and partners before any is zeroed
        tl.debug_barrier()
        tl.store(src + i, tl.zeros_like(x).to(src.dtype.element_ty))
    ty = dst.dtype.element_ty
    if src.dtype.element_ty == tl.int64:  # fp32 values
        tl.store(dst + i, y.to(ty))
    else:  # rounded as qkv's dtype holds them
        tl.store(dst + i, y.to(src.dtype.element_ty).to(ty))


@triton.jit
def row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS: tl.constexpr):
    """-> (cache sequence (int64), position) of row r: sequence r // T at pos + r % T (one position
    for all sequences), or with ROWS (decode_slots' rows, T = 1) slot slot[r] at pos[r]."""
    if ROWS:
        b = tl.load(slot_ptr + r).to(tl.int64)
        pos = tl.load(pos_ptr + r)
    else:
        b = (r // T).to(tl.int64)
        pos = tl.load(pos_ptr) + r % T
    return b, pos


@triton.jit
def _rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, factor, head_stride, seq_stride, T, H,
                       HKV, R: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr, CLEAR: tl.constexpr,
                       PDL: tl.constexpr, slot_ptr=None, ROWS: tl.constexpr = False):
    """Program (j, r) as triton_attention._rope_store_kernel's: j < H a q head, then k heads, v heads."""
    pdl_start(PDL)
    j = tl.program_id(0)
    r = tl.program_id(1)
    b, pos = row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS)
    k_ptr += b * seq_stride
    v_ptr += b * seq_stride
    src = qkv_ptr + r * (H + 2 * HKV) * D + j * D
    if j < H:
        _rotate_head(src, q_ptr + (r * H + j) * D, pos, inv_freq_ptr, factor, R, D, ROTATE, CLEAR)
    elif j < H + HKV:
        _rotate_head(src, k_ptr + (j - H) * head_stride + pos * D, pos, inv_freq_ptr, factor, R, D, ROTATE, CLEAR)
    else:
        _rotate_head(src, v_ptr + (j - H - HKV) * head_stride + pos * D, pos, inv_freq_ptr, factor, R, D, False,
                     CLEAR)


def rope_store_family(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                      inv_freq: torch.Tensor | None, n_heads: int, n_kv: int, head_dim: int, rotary: int,
                      factor: float = 1.0, clear: bool = False, slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (B T, (H + 2 Hkv) D) contiguous, caches (B, Hkv, S, D) of one layer -> q (B T H, D) (fp32 for
    an int64 accumulator, else qkv's dtype). inv_freq (R/2,) fp32 of the layer's rope set (None: NoPE);
    rotary: R. clear: zero qkv once read. slots: as triton_attention.rope_store's (row r: cache
    sequence slots[r] at pos[r])."""
    if k_cache.dim() == 3:
        k_cache, v_cache = k_cache.unsqueeze(0), v_cache.unsqueeze(0)
    t = qkv.shape[0]
    dtype = torch.float32 if qkv.dtype == torch.int64 else qkv.dtype
    q = torch.empty((t * n_heads, head_dim), dtype=dtype, device=qkv.device)
    _rope_store_kernel[(n_heads + 2 * n_kv, t)](
        qkv, q, k_cache, v_cache, pos, inv_freq if inv_freq is not None else q, float(factor), k_cache.stride(1),
        k_cache.stride(0), 1 if slots is not None else t // k_cache.shape[0], n_heads, n_kv, R=rotary, D=head_dim,
        ROTATE=inv_freq is not None, CLEAR=clear, PDL=PDL, slot_ptr=slots, ROWS=slots is not None, num_warps=1,
        launch_pdl=PDL, **FUSION)
    return q
