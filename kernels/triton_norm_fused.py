"""The decode step's norms fused into their neighbours (backends/cuda_graph.GraphDecoder; shapes for one
layer, rows r = b T + t as in triton_attention):

norm_rope_store: the q/k norms (cfg.qk_norm: Gemma 3, Qwen3) with rope and the cache writes: the q|k|v
  accumulator (B T, (H + 2 Hkv) D) int64 fixed point -> q (B T H, D) fp32 normed and rotated; k normed,
  rotated and v written into the cache rows pos + t; the accumulator cleared. One kernel where the
  step had from_fixed, split, two RMSNorm modules, cat, zero_ and rope_store_family (about 15 small
  kernels a layer, which also broke the PDL chain: kernels/triton_base.py).
add_normed: Gemma's post norms: x (T, C) int64 fixed point += to_fixed(RMSNorm(h)) in one kernel (was
  rmsnorm_rows, to_fixed and add_), h read from the int64 accumulator its product summed into (split K
  like the residual's products; the product writing a bf16 h could not split) and cleared; with
  quantize, also the next integer-dot products' int8 input (triton_quant_act.quantize_act of their RMSNorm
  of the new x), the kernel that followed.

Reference: that composition itself, bit for bit (tests/test_triton_norm_fused.py, under the
interpreter): the norm as triton_prefill.rmsnorm_rows computes it (model.RMSNorm: weight * (x
rstd).to(dtype), in the weight's dtype; the same reduction over one row), its output promoted to fp32
as torch.cat((q, k, v)) promotes it next to v's fp32 values, then triton_rope.rope_store_family's
rotation (partial rotary, attention factor, NoPE; with R = D and factor 1 it is
triton_attention.rope_store's rotation, the Llama layer's); for the post norms, an accumulator's values
rounded to the activation dtype (the product's epilogue rounding of its output), rmsnorm_rows, then
to_fixed's truncation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start, round_act
from .triton_epilogue import FIXED_ONE, from_fixed_jit
from .triton_quant_act import WHOLE_ROW_BLOCKS, act_buffers, store_blocks
from .triton_rope import rotate_pair, row_seq_pos


@triton.jit
def _rms_scale(x, rstd, w, ty: tl.constexpr):
    """rmsnorm_rows' output (weight's dtype ty) of fp32 values x, as fp32 (torch.cat's promotion)."""
    return ((x * rstd).to(ty).to(tl.float32) * w.to(tl.float32)).to(ty).to(tl.float32)


@triton.jit
def _norm_rotate_head(src, dst, pos, inv_freq_ptr, factor, w_ptr, eps, R: tl.constexpr, D: tl.constexpr,
                      ROTATE: tl.constexpr, NORM: tl.constexpr):
    """One head's D values at src (int64 fixed point) -> dst: NORM: RMSNorm over the head with weight
    w_ptr (D,); ROTATE: the first R rotated (pairs (i, i + R/2), cos and sin times factor); then src
    zeroed (every value and partner is loaded before)."""
    i = tl.arange(0, D)
    x = from_fixed_jit(tl.load(src + i))
    ty = w_ptr.dtype.element_ty
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        x = _rms_scale(x, rstd, tl.load(w_ptr + i), ty)
    if ROTATE:
        half: tl.constexpr = R // 2
        rot = i < R
        partner = tl.where(i < half, i + half, i - half)
        xp = from_fixed_jit(tl.load(src + partner, mask=rot, other=0))
        if NORM:  # the partner's normed value: the same elementwise ops on the same rstd
            xp = _rms_scale(xp, rstd, tl.load(w_ptr + partner, mask=rot, other=0.0), ty)
        y = rotate_pair(x, xp, i, pos, inv_freq_ptr, factor, R)
    else:
        y = x
    tl.debug_barrier()  # every thread has loaded its values and partners before any is zeroed
    tl.store(src + i, tl.zeros((D,), src.dtype.element_ty))
    tl.store(dst + i, y.to(dst.dtype.element_ty))


@triton.jit
def _norm_rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps, factor,
                            head_stride, seq_stride, T, H, HKV, R: tl.constexpr, D: tl.constexpr,
                            ROTATE: tl.constexpr, PDL: tl.constexpr, slot_ptr=None, ROWS: tl.constexpr = False):
    """Program (j, r): j < H q head j, then the k heads, then the v heads (as triton_rope's kernel)."""
    pdl_start(PDL)
    j = tl.program_id(0)
    r = tl.program_id(1)
    b, pos = row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS)
    k_ptr += b * seq_stride
    v_ptr += b * seq_stride
    src = qkv_ptr + r.to(tl.int64) * (H + 2 * HKV) * D + j * D
    if j < H:
        _norm_rotate_head(src, q_ptr + (r.to(tl.int64) * H + j) * D, pos, inv_freq_ptr, factor, qw_ptr, eps, R, D,
                          ROTATE, True)
    elif j < H + HKV:
        _norm_rotate_head(src, k_ptr + (j - H) * head_stride + pos * D, pos, inv_freq_ptr, factor, kw_ptr, eps, R,
                          D, ROTATE, True)
    else:
        _norm_rotate_head(src, v_ptr + (j - H - HKV) * head_stride + pos * D, pos, inv_freq_ptr, factor, kw_ptr,
                          eps, R, D, False, False)


def norm_rope_store(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                    inv_freq: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    n_heads: int, n_kv: int, head_dim: int, rotary: int, factor: float = 1.0,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (B T, (H + 2 Hkv) D) the int64 fixed-point q|k|v accumulator (left zero), caches (B, Hkv, S, D)
    (or (Hkv, S, D)) of one layer, q_weight / k_weight (D,) attn_q_norm / attn_k_norm's weights (one
    dtype), inv_freq (R/2,) fp32 of the layer's rope set (None: NoPE), rotary R -> q (B T H, D) fp32.
    slots: as triton_attention.rope_store's (row r: cache sequence slots[r] at pos[r])."""
    assert qkv.dtype == torch.int64 and qkv.is_contiguous() and q_weight.dtype == k_weight.dtype
    if k_cache.dim() == 3:
        k_cache, v_cache = k_cache.unsqueeze(0), v_cache.unsqueeze(0)
    t = qkv.shape[0]
    q = torch.empty((t * n_heads, head_dim), dtype=torch.float32, device=qkv.device)
    _norm_rope_store_kernel[(n_heads + 2 * n_kv, t)](
        qkv, q, k_cache, v_cache, pos, inv_freq if inv_freq is not None else q, q_weight, k_weight, float(eps),
        float(factor), k_cache.stride(1), k_cache.stride(0), 1 if slots is not None else t // k_cache.shape[0],
        n_heads, n_kv, R=rotary, D=head_dim, ROTATE=inv_freq is not None, PDL=PDL, slot_ptr=slots,
        ROWS=slots is not None, num_warps=1, launch_pdl=PDL, **FUSION)
    return q


@triton.jit
def _add_normed_kernel(x_ptr, h_ptr, w_ptr, act_ref, nw_ptr, q_ptr, d_ptr, s_ptr, C, eps, eps2, BLOCK: tl.constexpr,
                       ROUND: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    """Row r: x[r] += to_fixed(rmsnorm_rows(h[r])) (the same reduction and roundings as
    triton_prefill._rmsnorm_rows_kernel; to_fixed truncates). An int64 h: a fixed-point accumulator,
    its values rounded to act_ref's dtype (ROUND) and the row zeroed. QUANT: also the next product's
    input, triton_quant_act.quantize_act(x[r], nw, eps2)'s (q, d, s), by that kernel's operations (its
    whole-row form: the row as (BLOCK / 32, 32) blocks)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < C
    h = from_fixed_jit(tl.load(h_ptr + row * C + c, mask=mask, other=0))
    if h_ptr.dtype.element_ty == tl.int64:
        h = round_act(h, act_ref.dtype.element_ty, ROUND)
        tl.debug_barrier()  # every thread has loaded its values before any is zeroed
        tl.store(h_ptr + row * C + c, tl.zeros((BLOCK,), tl.int64), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / C + eps)
    ty = w_ptr.dtype.element_ty
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = ((h * rstd).to(ty).to(tl.float32) * w).to(ty).to(tl.float32)
    x = tl.load(x_ptr + row * C + c, mask=mask, other=0) + (y * FIXED_ONE).to(tl.int64)
    tl.store(x_ptr + row * C + c, x, mask=mask)
    if QUANT:
        NB: tl.constexpr = BLOCK // 32
        b = tl.arange(0, NB)
        bm = b < C // 32
        cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
        v = tl.reshape(from_fixed_jit(x), (NB, 32))
        nw = tl.load(nw_ptr + cols, mask=bm[:, None], other=0.0).to(tl.float32)
        rstd2 = 1.0 / tl.sqrt(tl.sum(tl.sum(v * v, 1), 0) / C + eps2)
        store_blocks(v * rstd2 * nw, b, bm, q_ptr + row * C, d_ptr + row * (C // 32), s_ptr + row * (C // 16), NB)


def add_normed(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
               act_dtype: torch.dtype = torch.float32, quantize: tuple[torch.Tensor, float] | None = None):
    """x (T, C) int64 fixed point += to_fixed(model.RMSNorm(h)) (h (T, C), weight (C,): the norm's
    output in weight's dtype) -> x. h may be an int64 fixed-point accumulator of the product that
    yields it (split K, any grid): its values are then rounded to act_dtype, as that product's output
    would have been, and h is left zero. quantize = (norm weight, eps) of the next product's norm
    (an integer-dot product; C <= triton_quant_act.WHOLE_ROW_BLOCKS * 32): -> (x, quantize_act(x, *quantize)),
    the next product's input from the same kernel."""
    assert x.dtype == torch.int64 and x.is_contiguous() and h.shape == x.shape and h.is_contiguous()
    m, c = x.shape
    block = triton.next_power_of_2(c)
    act_ref = torch.empty(1, dtype=act_dtype, device=x.device)
    if quantize is not None:
        assert c % 32 == 0 and c // 32 <= WHOLE_ROW_BLOCKS
        xq, (nw, eps2) = act_buffers(m, c, x.device), quantize
    else:
        xq, nw, eps2 = (x, x, x), x, 0.0
    # rmsnorm_rows' block and warps (the same reduction)
    _add_normed_kernel[(m,)](x, h, weight, act_ref, nw, *xq, c, eps, eps2, BLOCK=block,
                             ROUND=act_dtype != torch.float32, QUANT=quantize is not None, PDL=PDL,
                             num_warps=min(16, max(1, block // 256)), launch_pdl=PDL, **FUSION)
    return x if quantize is None else (x, xq)
