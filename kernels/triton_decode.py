"""Triton kernels of the decode step at its ends, for the T rows of a step (shapes for one layer).

embed_fixed: ids (T,) -> their embedding rows (T, C) into the residual stream, an int64 fixed-point
  accumulator (F.embedding, times FIXED_ONE, truncated: triton_epilogue.to_fixed).
glu_rows: gate/up sums (T, 2F) interleaved, in an int64 fixed-point accumulator -> silu(gate) * up
  (T, F) in the activation dtype, each op rounded as model.py's modules round it (the dense products'
  down-projection input); the accumulator is cleared for the next step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import PDL, _pdl_start
from .triton_epilogue import FIXED_ONE, _from_fixed


@triton.jit
def _embed_fixed_kernel(tok_ptr, emb_ptr, x_ptr, C, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token r, block j): values [j BLOCK, (j + 1) BLOCK) of row r."""
    _pdl_start(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    tok = tl.load(tok_ptr + r).to(tl.int64)
    v = tl.load(emb_ptr + tok * C + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + r.to(tl.int64) * C + c, (v * FIXED_ONE).to(tl.int64), mask=mask)


def embed_fixed(tokens: torch.Tensor, emb: torch.Tensor, x: torch.Tensor, block: int = 1024) -> None:
    """x (T, C) int64 <- to_fixed(emb[tokens]) (tokens (T,) int64, emb (V, C) dense)."""
    t, c = x.shape
    assert x.dtype == torch.int64 and x.is_contiguous() and emb.is_contiguous() and emb.shape[1] == c
    _embed_fixed_kernel[(t, triton.cdiv(c, block))](tokens, emb, x, c, BLOCK=block, PDL=PDL, num_warps=4,
                                                   launch_pdl=PDL)


@triton.jit
def _glu_rows_kernel(acc_ptr, out_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token r, block j): values [j BLOCK, (j + 1) BLOCK) of row r. The (gate, up) pairs are
    read and cleared as one contiguous run of 2 BLOCK sums (a stride-2 int64 load / store pair lost
    some of its zero stores on the H200, 2026-11-26: the stale sums leaked into the next step)."""
    _pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    e = j * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    src = acc_ptr + r * 2 * F + e
    v = tl.load(src, mask=e < 2 * F, other=0)
    tl.store(src, tl.zeros_like(v), mask=e < 2 * F)
    ACT: tl.constexpr = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(_from_fixed(v).to(ACT).to(tl.float32), (BLOCK, 2)))
    silu = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)
    i = j * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + r * F + i, (silu * up).to(ACT), mask=i < F)


def glu_rows(acc: torch.Tensor, dtype: torch.dtype, block: int = 1024) -> torch.Tensor:
    """acc (T, 2F) int64 fixed-point gate/up sums, interleaved -> silu(gate) * up (T, F) of dtype;
    acc is zeroed."""
    t, f = acc.shape[0], acc.shape[1] // 2
    assert acc.dtype == torch.int64 and acc.is_contiguous()
    out = torch.empty((t, f), dtype=dtype, device=acc.device)
    _glu_rows_kernel[(t, triton.cdiv(f, block))](acc, out, f, BLOCK=block, PDL=PDL, num_warps=4, launch_pdl=PDL)
    return out
