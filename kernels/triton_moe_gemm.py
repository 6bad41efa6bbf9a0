"""Mixture-of-experts prompt kernels (localllm/moe.py's MoE for the S = T k slots of a prompt), in the
style of vLLM's fused_moe: the slots grouped by expert on the device, then ONE grouped GEMM a
projection, so a layer launches a fixed number of kernels with no host sync (a prefill CUDA graph
captures it: backends/cuda_moe_prefill.py).

Shapes: T token rows, k experts per token (slot s = t k + j), E experts, N an expert's output rows,
K its input width; BM the GEMM's slot tile.

  align_slots(ids, E, BM): the slots sorted by expert (stable: a expert's slots in slot order), each
      expert's run padded with -1 to a multiple of BM, as (blocks BM,) slot ids and (blocks,) the expert
      of each BM-block (-1: past the end). blocks = ceil(S / BM) + E, a static bound (sum over experts
      of ceil(n_e / BM) <= S / BM + E), so no size comes back to the host.
  grouped_products(x, w, slots, block_expert, out): out[s, j N + n] = round(W[j, ids[s]] @ x[row(s)]
      (+ bias)), row(s) = s // k (gate / up: the token's x) or s (per_slot: the down projection's
      input); w dense (stacks E, N, K) in x's dtype (the caller decodes a quantized stack once);
      fp32 accumulation by tl.dot (fp32 inputs: IEEE products, no TF32), rounded once to out's dtype
      as F.linear's output is.
  combine_rows(down, weights): out[t] = round(sum_j weights[t, j] down[t k + j]) in slot order (the
      caller sorts each token's slots by expert id: MoE.forward's ascending-expert index_add_ sum,
      from 0), rounded to the activation dtype as MoE.forward's `.to(h.dtype)`.
Reference each must match: the eager per-expert products (kernels.linear.linear_rows of the decoded
rows), MoE.forward's sum (tests/test_moe_prefill.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, INTERPRET


def block_m(slots: int, n_experts: int) -> int:
    """The slot tile for S slots over E experts: about the slots an expert gets (a tile past an
    expert's run is padding), 16 to 64 (tl.dot's smallest M is 16)."""
    per = slots / max(n_experts, 1)
    return 16 if per <= 16 or INTERPRET else 32 if per <= 48 else 64


def align_slots(ids: torch.Tensor, n_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (S,) expert of each slot -> (slots (B BM,) int32: slot ids grouped by expert, each expert's
    run padded with -1 to a multiple of BM; block_expert (B,) int32: each BM-block's expert, -1 past
    the last), B = ceil(S / BM) + E. Device ops only (no bincount: it syncs for its size)."""
    s = ids.numel()
    dev = ids.device
    blocks = triton.cdiv(s, bm) + n_experts
    ids = ids.reshape(-1).long()
    by_expert, order = torch.sort(ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + bm - 1) // bm * bm
    pend, cend = torch.cumsum(padded, 0), torch.cumsum(counts, 0)
    pstart, cstart = pend - padded, cend - counts
    # sorted position p of expert e goes to e's padded run at its rank p - cstart[e]
    dest = pstart[by_expert] + torch.arange(s, device=dev) - cstart[by_expert]
    slots = torch.full((blocks * bm,), -1, dtype=torch.int32, device=dev)
    slots.scatter_(0, dest, order.to(torch.int32))
    # block b starts at b BM: the first expert whose padded run ends after it (empty experts end where they start)
    first = torch.searchsorted(pend, torch.arange(blocks, device=dev) * bm, right=True)
    block_expert = torch.where(first < n_experts, first, -1).to(torch.int32)
    return slots, block_expert


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, slots_ptr, bexp_ptr, N, K, x_stride, out_stride,
                    stack_stride, KUSED, tiles, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PER_SLOT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Program (BM-block b, stack j and row tile): the block's slots (all of expert e) against rows
    [BN i, BN (i + 1)) of expert e of stack j; a block of expert -1 does nothing."""
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        j = tl.program_id(1) // tiles
        n = (tl.program_id(1) % tiles) * BN + tl.arange(0, BN)
        nmask = n < N
        s = tl.load(slots_ptr + b * BM + tl.arange(0, BM))
        valid = s >= 0
        rows = tl.where(valid, s if PER_SLOT else s // KUSED, 0).to(tl.int64)
        w0 = w_ptr + j.to(tl.int64) * stack_stride + e.to(tl.int64) * N * K
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            a = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            wt = tl.load(w0 + n[None, :].to(tl.int64) * K + kk[:, None], mask=nmask[None, :] & km[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(wt.dtype), wt, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (j * (stack_stride // (N * K)) + e) * N + n, mask=nmask, other=0.0)[None, :].to(
                tl.float32)
        o = out_ptr + tl.where(valid, s, 0).to(tl.int64)[:, None] * out_stride + j * N + n[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def config(n: int) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) of the grouped GEMM (small tiles under the interpreter)."""
    if INTERPRET:
        return 32, 32, 4, 1
    return (128 if n >= 128 else 64), 64, 4, 3


def grouped_products(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, block_expert: torch.Tensor,
                     out: torch.Tensor, n_used: int, bm: int, bias: torch.Tensor | None = None,
                     per_slot: bool = False, stacks: int = 1) -> torch.Tensor:
    """out (S, stacks N): stack j's products in columns [j N, (j + 1) N) for every slot (module doc).
    x (T, K) or per_slot (S, K); w (stacks E, N, K) dense, x's dtype; slots, block_expert: align_slots'
    for BM = bm; bias (stacks E, N) or None."""
    n, k = w.shape[-2], w.shape[-1]
    assert w.is_contiguous() and x.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[1] == stacks * n
    assert w.shape[0] % stacks == 0 and (bias is None or bias.numel() == w.shape[0] * n)
    assert slots.numel() == block_expert.numel() * bm
    bn, bk, warps, stages = config(n)
    tiles = triton.cdiv(n, bn)
    stack_stride = (w.shape[0] // stacks) * n * k
    # fp32: IEEE products (no TF32); the interpreter too (its bf16 tl.dot is wrong: triton_dense's rule)
    ieee = x.dtype == torch.float32 or w.dtype == torch.float32 or INTERPRET
    _grouped_kernel[(block_expert.numel(), stacks * tiles)](
        x, w, bias if bias is not None else out, out, slots, block_expert, n, k, x.stride(0), out.stride(0),
        stack_stride, n_used, tiles, BM=bm, BN=bn, BK=bk, PER_SLOT=per_slot, HAS_BIAS=bias is not None,
        IEEE=ieee, num_warps=warps, num_stages=stages, **FUSION)
    return out


@triton.jit
def _combine_rows_kernel(down_ptr, w_ptr, out_ptr, C, KUSED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, columns [BLOCK i, BLOCK (i + 1))): out[t] = sum_j w[t, j] down[t k + j], from 0."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(KUSED):
        v = tl.load(down_ptr + (t * KUSED + j) * C + c, mask=mask, other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + t * KUSED + j)
    tl.store(out_ptr + t * C + c, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows(down: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, block: int = 1024) -> torch.Tensor:
    """down (T k, C) (each token's slots in expert order), weights (T, k) fp32 -> (T, C) of dtype."""
    t, k = weights.shape
    c = down.shape[1]
    assert down.shape[0] == t * k and down.is_contiguous() and weights.is_contiguous()
    out = torch.empty((t, c), dtype=dtype, device=down.device)
    block = min(block, triton.next_power_of_2(c))
    _combine_rows_kernel[(t, triton.cdiv(c, block))](down, weights, out, c, KUSED=k, BLOCK=block, num_warps=4, **FUSION)
    return out
