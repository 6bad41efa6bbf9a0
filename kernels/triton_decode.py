"""Triton kernels of the decode step at its ends, for the T rows of a step (shapes for one layer).

embed_fixed: ids (T,) -> their embedding rows (T, C) into the residual stream, an int64 fixed-point
  accumulator (F.embedding, times FIXED_ONE, truncated: triton_epilogue.to_fixed).
glu_rows: gate/up sums (T, 2F) interleaved, in an int64 fixed-point accumulator -> silu(gate) * up
  (T, F) in the activation dtype, each op rounded as model.py's modules round it (the dense products'
  down-projection input); the accumulator is cleared for the next step.
add_fixed: a product's output y (T, N) (cuBLAS's, in the activation dtype) added into an int64
  fixed-point accumulator (y times FIXED_ONE, truncated: triton_epilogue.to_fixed): the decode steps
  of many rows that multiply dense weights (backends/cuda_graph.py's dense steps).
greedy_ids: logits (T, V) fp32 -> each row's argmax (T,) int64, the first index of the largest value as
  torch.argmax gives it, inside the step's graph (torch's argmax of a large vocabulary and the copy of
  its id back into the graph were a measurable share of a quantized 8B step: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start
from .triton_epilogue import FIXED_ONE, from_fixed_jit, gate_act


@triton.jit
def _embed_fixed_kernel(tok_ptr, emb_ptr, x_ptr, C, scale, first, V, BLOCK: tl.constexpr, PDL: tl.constexpr,
                        SCALE: tl.constexpr = False, PART: tl.constexpr = False):
    """Program (token r, block j): values [j BLOCK, (j + 1) BLOCK) of row r. SCALE: times scale, rounded
    to the embedding's dtype (model.Transformer.embed: Gemma's sqrt(C)). PART: emb holds vocabulary rows
    [first, first + V) only (a tensor-parallel rank's): other ids give zeros."""
    pdl_start(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    tok = tl.load(tok_ptr + r).to(tl.int64)
    if PART:
        row = tl.zeros_like(c).to(tl.int64) + (tok - first)  # the id's row of this part, per value
        mask_out = mask
        mask = mask & (row >= 0) & (row < V)
        tok = tl.where(mask, row, 0)
    else:
        mask_out = mask
    v = tl.load(emb_ptr + tok * C + c, mask=mask, other=0.0)
    if SCALE:
        v = (v.to(tl.float32) * scale).to(emb_ptr.dtype.element_ty)
    v = v.to(tl.float32)
    tl.store(x_ptr + r.to(tl.int64) * C + c, (v * FIXED_ONE).to(tl.int64), mask=mask_out)


def embed_fixed(tokens: torch.Tensor, emb: torch.Tensor, x: torch.Tensor, block: int = 1024,
                scale: float = 1.0, first: int | None = None) -> None:
    """x (T, C) int64 <- to_fixed(emb[tokens] * scale) (tokens (T,) int64, emb (V, C) dense; scale
    rounded to emb's dtype, the product too, as Transformer.embed computes it). first: emb is the
    vocabulary rows [first, first + V) of a tensor-parallel rank; ids outside them give zero rows (the
    ranks' rows summed are the whole lookup: backends/cuda_tp.py)."""
    t, c = x.shape
    assert x.dtype == torch.int64 and x.is_contiguous() and emb.is_contiguous() and emb.shape[1] == c
    scale_t = float(torch.tensor(scale, dtype=emb.dtype))  # the dtype's value of scale, as the reference's
    _embed_fixed_kernel[(t, triton.cdiv(c, block))](tokens, emb, x, c, scale_t, first or 0, emb.shape[0],
                                                   BLOCK=block, PDL=PDL, SCALE=scale != 1.0,
                                                   PART=first is not None, num_warps=4, launch_pdl=PDL, **FUSION)


@triton.jit
def _glu_rows_kernel(acc_ptr, out_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr, GELU: tl.constexpr = False):
    """Program (token r, block j): values [j BLOCK, (j + 1) BLOCK) of row r. The (gate, up) pairs are
    read and cleared as one contiguous run of 2 BLOCK sums (a stride-2 int64 load / store pair lost
    some of its zero stores on the GPU: the stale sums leaked into the next step; docs/PERFORMANCE.md)."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    e = j * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    src = acc_ptr + r * 2 * F + e
    v = tl.load(src, mask=e < 2 * F, other=0)
    tl.store(src, tl.zeros_like(v), mask=e < 2 * F)
    ACT: tl.constexpr = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(from_fixed_jit(v).to(ACT).to(tl.float32), (BLOCK, 2)))
    silu = gate_act(gate, GELU).to(ACT).to(tl.float32)
    i = j * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + r * F + i, (silu * up).to(ACT), mask=i < F)


def glu_rows(acc: torch.Tensor, dtype: torch.dtype, block: int = 1024, gelu: bool = False) -> torch.Tensor:
    """acc (T, 2F) int64 fixed-point gate/up sums, interleaved -> silu(gate) * up (T, F) of dtype
    (gelu: gelu_tanh(gate) * up, model.glu's "gelu_tanh"); acc is zeroed."""
    t, f = acc.shape[0], acc.shape[1] // 2
    assert acc.dtype == torch.int64 and acc.is_contiguous()
    out = torch.empty((t, f), dtype=dtype, device=acc.device)
    _glu_rows_kernel[(t, triton.cdiv(f, block))](acc, out, f, BLOCK=block, PDL=PDL, GELU=gelu, num_warps=4,
                                                launch_pdl=PDL, **FUSION)
    return out


@triton.jit
def _add_fixed_kernel(acc_ptr, y_ptr, N, acc_stride, y_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row r, block j): acc[r, j BLOCK + i] += to_fixed(y[r, j BLOCK + i])."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    y = tl.load(y_ptr + r * y_stride + i, mask=mask, other=0.0).to(tl.float32)
    a = acc_ptr + r * acc_stride + i
    tl.store(a, tl.load(a, mask=mask, other=0) + (y * FIXED_ONE).to(tl.int64), mask=mask)


def add_fixed(acc: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """acc (T, N) int64 fixed point (rows may be a column range of a wider accumulator) += y (T, N)
    -> acc. Reference: acc + triton_epilogue.to_fixed(y)."""
    assert acc.dtype == torch.int64 and acc.shape == y.shape and acc.stride(1) == 1
    y = y.contiguous()
    t, n = acc.shape
    _add_fixed_kernel[(t, triton.cdiv(n, block))](acc, y, n, acc.stride(0), y.stride(0), BLOCK=block, PDL=PDL,
                                                  num_warps=4, launch_pdl=PDL, **FUSION)
    return acc


ARGMAX_BLOCK = 4096  # logits a greedy_ids program takes
INT64_MIN = tl.constexpr(-(1 << 63))  # greedy_ids' empty key


@triton.jit
def _argmax_key(v, i):
    """Value v (fp32) at index i (< 2^31) -> an int64 whose order is (v, -i)'s: v's bits made
    monotonic (negative floats' magnitude bits flipped; -0.0 taken as +0.0) above 2^31 - 1 - i."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return (key << 32) | (0x7FFFFFFF - i).to(tl.int64)


@triton.jit
def _greedy_kernel(logits_ptr, out_ptr, best_ptr, cnt_ptr, pos_ptr, V, stride, advance, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (block j, row r): the largest key of logits [j BLOCK, (j + 1) BLOCK) of row r into
    best[r] (atomic max); the row's last program (its counter) writes out[r], resets best[r] and
    cnt[r] for the next call, and row 0's adds `advance` to pos[0]."""
    pdl_start(PDL)
    j = tl.program_id(0)
    r = tl.program_id(1)
    i = j * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + r.to(tl.int64) * stride + i, mask=i < V, other=float("-inf"))
    tl.atomic_max(best_ptr + r, tl.max(_argmax_key(v, i), 0), sem="relaxed")
    if tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        key = tl.atomic_xchg(best_ptr + r, INT64_MIN, sem="acquire")
        tl.store(out_ptr + r, 0x7FFFFFFF - (key & 0x7FFFFFFF))
        tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed")
        if (r == 0) & (advance != 0):
            tl.store(pos_ptr, tl.load(pos_ptr) + advance)


def greedy_state(t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_ids' (best, count) buffers for t rows, as it leaves them."""
    return (torch.full((t,), INT64_MIN.value, dtype=torch.int64, device=device),
            torch.zeros(t, dtype=torch.int32, device=device))


def greedy_ids(logits: torch.Tensor, out: torch.Tensor, best: torch.Tensor, count: torch.Tensor,
               pos: torch.Tensor | None = None, advance: int = 0) -> torch.Tensor:
    """logits (T, V) fp32 -> out (T,) int64 = logits.argmax(-1). (best, count) = greedy_state(T) is the
    kernel's state (left as it was found, for the next call); pos (1,) int32 has
    `advance` added once every row is done (the decode step's position, one kernel fewer)."""
    t, v = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and v < 2**31 and out.shape == (t,)
    grid = (triton.cdiv(v, ARGMAX_BLOCK), t)
    _greedy_kernel[grid](logits, out, best, count, pos if pos is not None else count, v, logits.stride(0),
                         advance if pos is not None else 0, BLOCK=ARGMAX_BLOCK, PDL=PDL, num_warps=8,
                         launch_pdl=PDL, **FUSION)
    return out
