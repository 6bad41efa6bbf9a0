"""Triton kernels of the decode step around the KV cache (shapes for one layer), for T tokens at
positions pos .. pos + T - 1 (T = 1: plain decoding; T > 1: speculative decoding's verify pass).

rope_store: qkv (T, (H + 2 Hkv) D) -> q rotated (T H, D); k rotated and v written into the cache rows
  pos + r. Must match model.rope_rotate with model.rope_tables' angles (pos * inv_freq in fp32) and
  KVCache.update.
decode_attention: q (T H, D), token r against cache rows [0, pos + r] of k, v (Hkv, S, D) -> (T, H D).
  Both also take B sequences at once (batch B, caches (B, Hkv, S, D), rows r = b T + t: sequence b's
  token t at pos + t); every sequence is at the same position (bench's equal prompts).
  Must match F.scaled_dot_product_attention(q, k[:, :pos+1], v[:, :pos+1], enable_gqa=True) (scale
  1/sqrt(D)), computed with an online softmax in fp32, split over chunks of CHUNK rows (one program
  per kv head and chunk, its GQA group of query heads on tensor cores with q rounded to the cache
  dtype; or one per query head; then a combine kernel: one load step per program, not a long
  dependent loop). Token r's row takes exactly the operations a one-token call at pos + r takes.
  `pos` is a device tensor, so all of them run inside a CUDA graph, whose grid is fixed by the
  capacity S. With rope=(qkv, inv_freq, D) it also does rope_store's work (the decode step's form,
  one kernel fewer): the chunk programs rotate q and the current tokens' k themselves and write k, v
  into the cache; the combine clears qkv.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start
from .triton_epilogue import from_fixed_jit
from .triton_quant_act import act_buffers, store_blocks
from .triton_rope import row_seq_pos

CHUNK = 64  # cache rows a program takes: the fastest chunk on Hopper in the sweep (docs/PERFORMANCE.md)


@triton.jit
def _rotate_store(src, dst, c, s, HALF: tl.constexpr, ROTATE: tl.constexpr, CLEAR: tl.constexpr):
    i = tl.arange(0, HALF)
    x1 = from_fixed_jit(tl.load(src + i))
    x2 = from_fixed_jit(tl.load(src + HALF + i))
    if CLEAR:  # src is a split-K accumulator: leave it zero for the next step (parts add to it)
        tl.store(src + i, tl.zeros_like(x1).to(src.dtype.element_ty))
        tl.store(src + HALF + i, tl.zeros_like(x2).to(src.dtype.element_ty))
    if ROTATE:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    ty = dst.dtype.element_ty
    if src.dtype.element_ty == tl.int64:  # a fixed-point accumulator: fp32 values
        tl.store(dst + i, y1.to(ty))
        tl.store(dst + HALF + i, y2.to(ty))
    else:  # rounded as qkv's dtype holds them
        tl.store(dst + i, y1.to(src.dtype.element_ty).to(ty))
        tl.store(dst + HALF + i, y2.to(src.dtype.element_ty).to(ty))


@triton.jit
def _rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, head_stride, seq_stride, T, H, HKV,
                       D: tl.constexpr, CLEAR: tl.constexpr, PDL: tl.constexpr, slot_ptr=None,
                       ROWS: tl.constexpr = False):
    """Program (j, r), row r = b T + t: sequence b's token t at pos + t (its cache seq_stride elements
    after sequence 0's): j < H: q head j; j < H + Hkv: k head; else v head (grid: (H + 2 Hkv, B T)).
    ROWS (T = 1): row r is slot slot[r]'s token at pos[r] (row_seq_pos)."""
    pdl_start(PDL)
    j = tl.program_id(0)
    r = tl.program_id(1)
    b, pos = row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS)
    k_ptr += b * seq_stride
    v_ptr += b * seq_stride
    qkv_ptr += r * (H + 2 * HKV) * D
    q_ptr += r * H * D
    half = tl.arange(0, D // 2)
    ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)
    c = tl.cos(ang)
    s = tl.sin(ang)
    src = qkv_ptr + j * D
    if j < H:
        _rotate_store(src, q_ptr + j * D, c, s, D // 2, True, CLEAR)
    elif j < H + HKV:
        _rotate_store(src, k_ptr + (j - H) * head_stride + pos * D, c, s, D // 2, True, CLEAR)
    else:
        _rotate_store(src, v_ptr + (j - H - HKV) * head_stride + pos * D, c, s, D // 2, False, CLEAR)


@triton.jit
def _attn_partial_kernel(q_ptr, k_ptr, v_ptr, ws_ptr, pos_ptr, head_stride, seq_stride, T, scale, NSPLIT,
                         GROUP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                         PDL: tl.constexpr, slot_ptr=None, ROWS: tl.constexpr = False):
    """Program (h, c, r): query head h of row r (sequence r // T's token r % T, at pos + r % T) over its
    cache rows [c CHUNK, (c + 1) CHUNK) ∩ [0, pos + r % T] -> ws[r, h, c] = (unnormalised sum of p v
    (D), running max m, sum of p l)."""
    pdl_start(PDL)
    r = tl.program_id(2)
    b, pos = row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS)
    kv = (tl.program_id(0) // GROUP).to(tl.int64) * head_stride + b * seq_stride
    h = r * tl.num_programs(0) + tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(pos + 1, (c + 1) * CHUNK)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
    m_i = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros((BLOCK_S,), tl.float32), 0)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(c * CHUNK, n, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        valid = rows < n
        offs = kv + rows[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    base = ws_ptr + (h * NSPLIT + c) * (D + 2)
    tl.store(base + d, acc)
    tl.store(base + D, m_i)
    tl.store(base + D + 1, l_i)


@triton.jit
def _rope_angles(pos, inv_freq_ptr, D: tl.constexpr):
    """-> (cos, sin) (D,) of position pos's angles pos * inv_freq (fp32, each frequency twice: value i
    and its partner in the other half), as rope_store computes them."""
    i = tl.arange(0, D)
    ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + i % (D // 2))
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def _rope_rows(src, heads, hmask, cos, sin, D: tl.constexpr):
    """Rows `heads` (R,) (where hmask; zeros elsewhere) of D values at src (fp32 or an int64
    fixed-point accumulator), rotated as model.rope_rotate rotates them by the angles (cos, sin) of
    _rope_angles -> (R, D) fp32: each value and its partner in the other half loaded,
    y = x cos + sign x' sin (sign -1 in the first half), rope_store's operations."""
    i = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (i + half) % D
    x = from_fixed_jit(tl.load(src + heads[:, None] * D + i[None, :], mask=hmask[:, None], other=0))
    xp = from_fixed_jit(tl.load(src + heads[:, None] * D + partner[None, :], mask=hmask[:, None], other=0))
    sign = tl.where(i < half, -1.0, 1.0)
    return x * cos[None, :] + (sign[None, :] * xp) * sin[None, :]


@triton.jit
def _store_current(src, k_ptr, v_ptr, kv, p, cos, sin, j, H, HKV, D: tl.constexpr):
    """One current token's q|k|v sums at src (fp32 or int64 fixed point) at position p (angles cos,
    sin): kv head j's k (rotated) and v rows into the cache row p -> (k, v) (D,) as the cache now
    holds them."""
    i = tl.arange(0, D)
    k_head = tl.zeros((1,), tl.int32) + H + j  # one row for _rope_rows
    k = tl.reshape(_rope_rows(src, k_head, k_head >= 0, cos, sin, D), (D,)).to(k_ptr.dtype.element_ty)
    v = from_fixed_jit(tl.load(src + (H + HKV + j) * D + i)).to(v_ptr.dtype.element_ty)
    tl.store(k_ptr + kv + p * D + i, k)
    tl.store(v_ptr + kv + p * D + i, v)
    return k, v


@triton.jit
def _rope_current_rows(qkv_ptr, k_ptr, v_ptr, kv, pos0, inv_freq_ptr, b, c, j, T, H, HKV, D: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Sequence b's T current tokens at pos0 + t that fall in chunk c: _store_current (every program of
    the chunk writes the same values; each then reads its own writes), then a barrier so that all of
    the program's threads see them."""
    for t in range(0, T):
        p = pos0 + t
        if (p >= c * CHUNK) & (p < (c + 1) * CHUNK):
            src = qkv_ptr + (b * T + t).to(tl.int64) * (H + 2 * HKV) * D
            cos, sin = _rope_angles(p, inv_freq_ptr, D)
            _store_current(src, k_ptr, v_ptr, kv, p, cos, sin, j, H, HKV, D)
    tl.debug_barrier()


@triton.jit
def _rope_current_row(src, k_ptr, v_ptr, kv, p, cos, sin, j, H, HKV, k, v, rows, D: tl.constexpr):
    """The one current token (plain decoding) at p, a row of this chunk: _store_current, and its k, v
    into the chunk's tiles k, v (CHUNK, D) from registers (no barrier and read back) -> (k, v)."""
    k_t, v_t = _store_current(src, k_ptr, v_ptr, kv, p, cos, sin, j, H, HKV, D)
    return tl.where((rows == p)[:, None], k_t[None, :], k), tl.where((rows == p)[:, None], v_t[None, :], v)


@triton.jit
def _attn_tile(q, k, v, valid, m_i, l_i, acc, IEEE: tl.constexpr, softcap=0.0, SOFTCAP: tl.constexpr = False):
    """One online-softmax step of q (GP, D) over a tile of cache rows k, v (S, D) (those where valid)
    -> (m_i, l_i, acc) updated. SOFTCAP: scores -> softcap tanh(scores / softcap) (Gemma 2)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if SOFTCAP:  # tanh(y) = 1 - 2 / (exp(2 y) + 1): exact limits at +-inf
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    if IEEE:
        pv = tl.dot(p.to(k.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(k.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _attn_partial_gqa_kernel(q_ptr, k_ptr, v_ptr, ws_ptr, pos_ptr, inv_freq_ptr, head_stride, seq_stride, T, scale,
                             NSPLIT, softcap, window, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                             BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr,
                             ONE: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr = False,
                             WINDOW: tl.constexpr = False, slot_ptr=None, ROWS: tl.constexpr = False):
    """Program (kv head j, chunk c, row r): the GROUP query heads of kv head j of row r (as in
    _attn_partial_kernel) over its cache rows [c CHUNK, (c + 1) CHUNK) ∩ [0, pos + r % T] at once -> ws
    rows as _attn_partial_kernel's. Each k, v row is loaded
    once for the whole group and multiplied on tensor cores (the group padded to GP >= 16 rows); q is
    rounded to the cache dtype for that product, as prefill's SDPA takes it.
    ROPE: q_ptr is the q|k|v accumulator (B T, (H + 2 Hkv) D) (rope_store's input, one kernel fewer):
    the program rotates its q heads itself and writes the current tokens' k, v rows of its chunk, then
    reads them back after a barrier. SOFTCAP, WINDOW (not with ROPE): soft-capped scores, and only the
    last `window` positions up to the row's own (sliding-window layers). ONE (plain decoding, T = 1; CHUNK == BLOCK_S: one tile): the
    chunk's earlier rows, written by earlier steps, are loaded before the PDL wait (while the q|k|v
    products still run) and the current row joins the tile from registers; so are the rope angles.
    (Merging a verify pass's T rows from registers cost it more than the read back, and letting the
    next kernel be scheduled only once the chunk's loads were issued gained nothing: docs/PERFORMANCE.md.)"""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    c = tl.program_id(1)
    r = tl.program_id(2)
    # pos is written only by the step's last kernel (a graph replay runs after the last); with ROWS
    # (T = 1) row r is slot slot[r] at pos[r], else sequence r // T at pos + r % T
    b, pos0 = row_seq_pos(pos_ptr, slot_ptr, r, T, ROWS)
    pos0 -= r % T
    kv = j.to(tl.int64) * head_stride + b * seq_stride
    n = tl.minimum(pos0 + r % T + 1, (c + 1) * CHUNK)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    gmask = g < GROUP
    ty = k_ptr.dtype.element_ty
    H = tl.num_programs(0) * GROUP
    heads = r * H + j * GROUP + g  # rows of q (tokens, H, D)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    if ROPE and ONE:
        rows = c * CHUNK + tl.arange(0, CHUNK)
        offs = kv + rows[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=(rows < pos0)[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=(rows < pos0)[:, None], other=0.0)
        cos, sin = _rope_angles(pos0, inv_freq_ptr, D)
        if PDL:
            tl.extra.cuda.gdc_wait()
        src = q_ptr + r.to(tl.int64) * (H + 2 * tl.num_programs(0)) * D
        if (pos0 >= c * CHUNK) & (pos0 < (c + 1) * CHUNK):
            k, v = _rope_current_row(src, k_ptr, v_ptr, kv, pos0, cos, sin, j, H, tl.num_programs(0), k, v, rows, D)
        q = (_rope_rows(src, j * GROUP + g, gmask, cos, sin, D) * scale).to(ty)
        if c * CHUNK < n:
            m_i, l_i, acc = _attn_tile(q, k, v, rows < n, m_i, l_i, acc, IEEE)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        if ROPE:
            _rope_current_rows(q_ptr, k_ptr, v_ptr, kv, pos0, inv_freq_ptr, r // T, c, j, T, H, tl.num_programs(0),
                               D, CHUNK)
            src = q_ptr + r.to(tl.int64) * (H + 2 * tl.num_programs(0)) * D
            cos, sin = _rope_angles(pos0 + r % T, inv_freq_ptr, D)
            q = (_rope_rows(src, j * GROUP + g, gmask, cos, sin, D) * scale).to(ty)
        else:
            q = (tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
                 * scale).to(ty)
        lo = 0
        first = c * CHUNK
        if WINDOW:  # rows before lo are out of the window; start at the tile that holds lo
            lo = pos0 + r % T + 1 - window
            first += tl.maximum(lo - c * CHUNK, 0) // BLOCK_S * BLOCK_S
        for s0 in range(first, n, BLOCK_S):
            rows = s0 + tl.arange(0, BLOCK_S)
            valid = rows < n
            if WINDOW:
                valid = valid & (rows >= lo)
            offs = kv + rows[:, None] * D + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attn_tile(q, k, v, valid, m_i, l_i, acc, IEEE, softcap, SOFTCAP)
    base = ws_ptr + (heads * NSPLIT + c) * (D + 2)
    tl.store(base[:, None] + d[None, :], acc, mask=gmask[:, None])
    tl.store(base + D, m_i, mask=gmask)
    tl.store(base + D + 1, l_i, mask=gmask)


@triton.jit
def _attn_combine_kernel(ws_ptr, out_ptr, q_ptr, d_ptr, s_ptr, qkv_ptr, NSPLIT, HEADS, D: tl.constexpr,
                         NS: tl.constexpr, QUANT: tl.constexpr, CLEAR: tl.constexpr, PDL: tl.constexpr,
                         sink_ptr=None, SINKS: tl.constexpr = False):
    """Program (head, token r): out[r, head] = sum_c w_c acc_c / sum_c w_c l_c with w_c = exp(m_c - max m)
    (empty chunks: m = -inf). SINKS: the head's sink logit s joins the softmax (gpt-oss): max over m and
    s, and exp(s - max) added to the denominator. QUANT: also quantize.act's int8 form of the rounded out (head h is
    D / 32 whole blocks of row r). CLEAR: zero heads h, h + H, .. < HEADS of row r of the q|k|v
    accumulator the fused-rope partials read (for the next step's products)."""
    pdl_start(PDL)
    if CLEAR:
        row = qkv_ptr + tl.program_id(1).to(tl.int64) * HEADS * D
        for jj in range(tl.program_id(0), HEADS, tl.num_programs(0)):
            tl.store(row + jj * D + tl.arange(0, D), tl.zeros((D,), qkv_ptr.dtype.element_ty))
    r = tl.program_id(1)
    HD = tl.num_programs(0) * D
    h = r * tl.num_programs(0) + tl.program_id(0)
    c = tl.arange(0, NS)
    valid = c < NSPLIT
    base = ws_ptr + (h * NSPLIT + c) * (D + 2)
    m = tl.load(base + D, mask=valid, other=float("-inf"))
    l = tl.load(base + D + 1, mask=valid, other=0.0)
    top = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sink_ptr + tl.program_id(0)).to(tl.float32)
        top = tl.maximum(top, sink)
    wgt = tl.exp(m - top)
    d = tl.arange(0, D)
    acc = tl.load(base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    denom = tl.sum(l * wgt, 0)
    if SINKS:
        denom += tl.exp(sink - top)
    out = (tl.sum(acc * wgt[:, None], 0) / denom).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + h * D + d, out)
    if QUANT:
        b = tl.program_id(0) * (D // 32) + tl.arange(0, D // 32)
        v = tl.reshape(out.to(tl.float32), (D // 32, 32))
        store_blocks(v, b, b >= 0, q_ptr + r * HD, d_ptr + r * (HD // 32), s_ptr + r * (HD // 16), D // 32)


def _batched(k_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as (B, Hkv, S, D) (one sequence may come as (Hkv, S, D))."""
    return k_cache if k_cache.dim() == 4 else k_cache.unsqueeze(0)


def rope_store(qkv, k_cache, v_cache, pos, inv_freq, n_heads: int, n_kv: int, head_dim: int,
               clear: bool = False, slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (B T, (H + 2 Hkv) D) contiguous: B sequences of T tokens at positions pos .. pos + T - 1;
    k_cache, v_cache (B, Hkv, S, D) (or (Hkv, S, D), B = 1) of one layer -> q (B T H, D). clear: zero
    qkv once read (an accumulator of split-K products). slots (R,) int32 with pos (R,) int32: row r is
    one token of cache sequence slots[r] at position pos[r] (decode_slots' rows, any R)."""
    k_cache, v_cache = _batched(k_cache), _batched(v_cache)
    t = qkv.shape[0]
    dtype = torch.float32 if qkv.dtype == torch.int64 else qkv.dtype  # a fixed-point accumulator: fp32 q
    q = torch.empty((t * n_heads, head_dim), dtype=dtype, device=qkv.device)
    grid = (n_heads + 2 * n_kv, t)
    _rope_store_kernel[grid](qkv, q, k_cache, v_cache, pos, inv_freq, k_cache.stride(1), k_cache.stride(0),
                             1 if slots is not None else t // k_cache.shape[0], n_heads, n_kv, D=head_dim,
                             CLEAR=clear, PDL=PDL, slot_ptr=slots, ROWS=slots is not None, num_warps=1,
                             launch_pdl=PDL, **FUSION)
    return q


def decode_attention(q, k_cache, v_cache, pos, n_kv: int, chunk: int | None = None, quantize: bool = False,
                     gqa: bool = True, tokens: int = 1, rope: tuple | None = None, scale: float | None = None,
                     softcap: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                   slots: torch.Tensor | None = None):
    """q (B T H, D) of B sequences of T tokens at positions pos .. pos + T - 1 (each sees its cache up
    to its own position), caches (B, Hkv, S, D) (or (Hkv, S, D), B = 1) -> (B T, H D) in the cache's
    dtype; with quantize, also its int8 form (kernels.triton_quant_act.quantize_act's (q, d, s), for an
    integer-dot output projection). Each row is computed exactly as a one-token call of its sequence
    at its position computes it.
    rope = (qkv, inv_freq, D): rope_store fused in (q None): qkv the contiguous (B T, (H + 2 Hkv) D)
    accumulator of q|k|v sums (int64 fixed point), rotated and its k, v rows written into the caches
    as rope_store does; it is left zero. Needs the GQA kernel (gqa, D >= 16) and 16 <= chunk <= 64.
    The variants of attention.attend (GQA kernel, without rope): scale (None: 1/sqrt(D)); softcap;
    window (keys pos - window < j <= pos); sinks (H,) fp32 per-head sink logits.
    slots (R,) int32 with pos (R,) int32 (tokens 1): row r is cache sequence slots[r]'s token at pos[r]
    (decode_slots' rows: each slot at its own position, any R)."""
    k_cache, v_cache = _batched(k_cache), _batched(v_cache)
    assert slots is None or tokens == 1
    t = tokens * k_cache.shape[0] if slots is None else slots.shape[0]  # rows
    rows = {"slot_ptr": slots, "ROWS": slots is not None}
    chunk = chunk or CHUNK
    if rope is not None:
        qkv, inv_freq, d = rope
        assert gqa and d >= 16 and 16 <= chunk <= 64 and qkv.is_contiguous() and qkv.shape[0] == t
        h = qkv.shape[1] // d - 2 * n_kv
    else:
        h, d = q.shape[0] // t, q.shape[1]
    variant = softcap is not None or window is not None or sinks is not None
    assert not variant or (rope is None and gqa and d >= 16 and chunk >= 16), "variants take the GQA kernel"
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    nsplit = triton.cdiv(k_cache.shape[2], chunk)
    strides = (k_cache.stride(1), k_cache.stride(0), tokens)
    ws = torch.empty((t * h, nsplit, d + 2), dtype=torch.float32, device=k_cache.device)
    if gqa and d >= 16 and chunk >= 16:  # one program per kv head and chunk, its query heads on tensor cores
        group = h // n_kv
        _attn_partial_gqa_kernel[(n_kv, nsplit, t)](
            rope[0] if rope else q, k_cache, v_cache, ws, pos, rope[1] if rope else ws, *strides, scale,
            nsplit, float(softcap or 0.0), int(window or 0), GROUP=group, GP=max(16, triton.next_power_of_2(group)),
            D=d, BLOCK_S=min(chunk, 64), CHUNK=chunk, IEEE=k_cache.dtype == torch.float32, ROPE=rope is not None,
            ONE=tokens == 1, PDL=PDL, SOFTCAP=softcap is not None, WINDOW=window is not None, num_warps=4,
            launch_pdl=PDL, **rows, **FUSION)
    else:
        _attn_partial_kernel[(h, nsplit, t)](q, k_cache, v_cache, ws, pos, *strides, scale, nsplit,
                                          GROUP=h // n_kv, D=d, BLOCK_S=min(chunk, 64), CHUNK=chunk, PDL=PDL,
                                          num_warps=4, launch_pdl=PDL, **rows, **FUSION)
    out = torch.empty((t, h * d), dtype=k_cache.dtype, device=k_cache.device)
    xq = act_buffers(t, h * d, k_cache.device) if quantize else (out, out, out)
    _attn_combine_kernel[(h, t)](ws, out, *xq, rope[0] if rope else out, nsplit, h + 2 * n_kv, D=d,
                               NS=triton.next_power_of_2(nsplit), QUANT=quantize, CLEAR=rope is not None, PDL=PDL,
                               sink_ptr=sinks if sinks is not None else ws, SINKS=sinks is not None,
                               num_warps=4, launch_pdl=PDL, **FUSION)
    return (out, xq) if quantize else out
