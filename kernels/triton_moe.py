"""Mixture-of-experts decode kernels (localllm/moe.py's MoE for the S = T k slots of a step): the chosen
experts' products read the experts' ids from device memory, so a decode step routes and runs its
experts inside one CUDA graph with no host sync (backends/cuda_moe.py).

Shapes: T token rows, k experts per token (slot s = t k + j), E experts, N an expert's output rows,
K its input width. An expert tensor is the ExpertLinear's stack: a QWeight of (E N, K) rows (expert
e: rows e N .. (e + 1) N; block-major for the integer-dot types) or dense (E, N, K).

  expert_products(x, w, ids, out): out[s] += W[ids[s]] @ x[row(s)] (+ bias[ids[s]]), row(s) = s // k
      (the token's x: gate / up) or s (a per-slot x: the down projection's input); x float (T or S, K),
      or quantize_act's int8 form for the integer-dot types. The block decoders are the dense
      kernels' (triton_units' unit_weights / unit_dot, triton_gemv's decode_tile), rows offset by ids[s] N. out:
      an int64 fixed-point accumulator (triton_epilogue.FIXED_ONE; parts split over K add into it by
      integer atomics: the same sum in any order), or fp32 (no split: the router's logits).
  expert_glu(gate, up): the slots' activation glu(cfg, gate, up) in the activation dtype, each op
      rounded as model.glu's torch ops round it (silu, or gpt-oss's clamped swiglu), from the
      accumulators (cleared as read), or straight into quantize_act's int8 form.
  combine(down, weights, x): x[t] += round(sum_j weights[t, j] round(down[t k + j])), j in slot order
      (the caller sorts each token's slots by expert id: MoE.forward's ascending-expert sum), the sum
      rounded to the activation dtype as MoE.forward's `.to(h.dtype)`; down is cleared as read.
Reference each must match: the eager per-expert products (kernels.linear.linear_rows, within fp32
summation order; Q8_0's rounding of x for the integer-dot types) and model.py's ops (tests/test_moe_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qweight import INT_DOT_TYPES, QWeight
from .triton_base import FUSION, INTERPRET, round_act
from .triton_epilogue import FIXED_ONE, auto_split, from_fixed_jit, split_k
from .triton_gemv import CONFIGS as GEMV_CONFIGS
from .triton_gemv import WIDTH, decode_tile
from .triton_gemv import weight_args as gemv_weight_args
from .triton_q8 import CONFIGS as Q8_CONFIGS
from .triton_quant_act import act_buffers, store_blocks
from .triton_units import FMT, UNIT, unit_dot, unit_weights
from .triton_units import weight_args as q8_weight_args


@triton.jit
def _store_out(y, s, rows, rmask, e, j, stack_rows, out_ptr, bias_ptr, N, out_stride, HAS_BIAS: tl.constexpr,
               SPLIT: tl.constexpr):
    """Slot s's sums y (BN,) of rows `rows` of expert e of stack j -> out columns j N + rows: + bias
    (part 0), into an int64 fixed-point accumulator (atomically when split over K), or stored (fp32,
    one part)."""
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            y += tl.load(bias_ptr + j * stack_rows + e * N + rows, mask=rmask, other=0.0).to(tl.float32)
    orow = out_ptr + s.to(tl.int64) * out_stride + j * N + rows
    if out_ptr.dtype.element_ty == tl.int64:
        q = (y * FIXED_ONE).to(tl.int64)
        if SPLIT > 1:
            tl.atomic_add(orow, q, mask=rmask, sem="relaxed")
        else:
            tl.store(orow, tl.load(orow, mask=rmask, other=0) + q, mask=rmask)
    else:
        tl.store(orow, y, mask=rmask)


@triton.jit
def _moe_q8_kernel(xq_ptr, xd_ptr, xs_ptr, ids_ptr, out_ptr, bias_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4,
                   step, N, K, out_stride, units_per_split, KUSED, tiles, stack_rows, FMT: tl.constexpr,
                   UNIT: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, PER_SLOT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Program (row tile, slot s, part of K): rows of expert ids[s] against the quantized x row of s
    (grid: (stacks x N / BN, S, SPLIT): program 0's axis takes stack j = pid // tiles, whose rows
    begin at j stack_rows), triton_units' unit decoders on rows offset by ids[s] N."""
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int32)
    m = s if PER_SLOT else s // KUSED
    j = tl.program_id(0) // tiles
    rows = (tl.program_id(0) % tiles) * BN + tl.arange(0, BN)
    rmask = rows < N
    r3 = ((j * stack_rows + e * N + rows) * step)[None, :, None]
    u_lo = tl.program_id(2) * units_per_split
    u_hi = tl.minimum(u_lo + units_per_split, K // UNIT)
    m64 = m.to(tl.int64)
    xq, xd, xs = xq_ptr + m64 * (K // 4), xd_ptr + m64 * (K // 32), xs_ptr + m64 * (K // 16)
    acc = tl.zeros((BK, BN, 1), tl.float32)
    for u0 in range(u_lo, u_hi, BK):
        u3 = (u0 + tl.arange(0, BK))[:, None, None]
        um3 = u3 < u_hi
        W = unit_weights(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, u3, r3, rmask[None, :, None] & um3, False)
        acc += unit_dot(FMT, W, xq, xd, xs, u3, um3, ASM, False)
    _store_out(tl.sum(tl.sum(acc, 2), 0), s, rows, rmask, e, j, stack_rows, out_ptr, bias_ptr, N, out_stride,
               HAS_BIAS, SPLIT)


@triton.jit
def _moe_gemv_kernel(x_ptr, ids_ptr, out_ptr, bias_ptr, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5, N, K,
                     x_stride, out_stride, groups_per_split, KUSED, tiles, stack_rows, FMT: tl.constexpr,
                     W: tl.constexpr,
                     BN: tl.constexpr, G: tl.constexpr, PER_SLOT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr):
    """As _moe_q8_kernel with a float x, triton_gemv's tile decoder (dense weights: FMT 0)."""
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int32)
    m = s if PER_SLOT else s // KUSED
    j = tl.program_id(0) // tiles
    rows = (tl.program_id(0) % tiles) * BN + tl.arange(0, BN)
    rmask = rows < N
    x0 = x_ptr + m.to(tl.int64) * x_stride
    g_lo = tl.program_id(2) * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, K // (2 * W))
    acc = tl.zeros((BN, G, W), tl.float32)
    zero = (rows * 0)[:, None, None]
    for g0 in range(g_lo, g_hi, G):
        g = g0 + tl.arange(0, G)
        gmask = g < g_hi
        lo, hi, clo, chi = decode_tile(FMT, P0, P1, P2, P3, P4, P5, S0, S1, S2, S3, S4, S5,
                                       j * stack_rows + e * N + rows, rmask, g, gmask, W)
        cmask = (zero == 0) & gmask[None, :, None]  # x at the tile's shape: its register layout (triton_gemv)
        acc += lo * tl.load(x0 + zero + clo[None, :, :], mask=cmask, other=0.0).to(tl.float32)
        acc += hi * tl.load(x0 + zero + chi[None, :, :], mask=cmask, other=0.0).to(tl.float32)
    _store_out(tl.sum(tl.sum(acc, 2), 1), s, rows, rmask, e, j, stack_rows, out_ptr, bias_ptr, N, out_stride,
               HAS_BIAS, SPLIT)


def _split(split: int | None, programs: int, units: int, per_iter: int, device: torch.device) -> int | None:
    """Parts of K: split, or (None) the dense products' rule (triton_epilogue.auto_split: enough parts
    that the grid of one token's `programs` fills the GPU several times over; none under the
    interpreter). Never from the number of token rows: a verify pass of T tokens (or a batch) must cut
    K as a one-token step does, so that each row gets a one-token step's bits. (The earlier aim of 8
    programs an SM left gpt-oss's 1-warp MXFP4 programs at a third of copy speed: bench/moe_products.py.)"""
    if split is not None:
        return split
    return 1 if INTERPRET else auto_split(programs, units, per_iter, device)


def expert_products(x, w: QWeight | torch.Tensor, ids: torch.Tensor, out: torch.Tensor, n_used: int,
                    bias: torch.Tensor | None = None, per_slot: bool = False, split: int | None = None,
                    config: tuple[int, int, int] | None = None, stacks: int = 1) -> torch.Tensor:
    """out (S, N) += the slots' expert products (module doc): x (T, K) float, or for an integer-dot
    QWeight (block-major) the (q, d, s) of quantize_act (T or S rows); w a QWeight of (E N, K) or dense
    (E, N, K); ids (S,) int32 / int64, S = T n_used (per_slot: x has S rows); bias (E, N). out: int64
    fixed point (zero, or sums to add to), or fp32 (written; one part). split: parts of K (None: auto).
    stacks: w holds that many expert stacks one after another (gate then up: (stacks E N, K) rows,
    bias (stacks E, N)), one launch; stack j's products go to out's columns [j N, (j + 1) N)."""
    slots = ids.numel()
    assert ids.is_contiguous() and out.stride(-1) == 1 and out.shape[0] == slots and out.shape[1] % stacks == 0
    n = out.shape[1] // stacks
    w = w.reshape(-1, w.shape[-1]) if isinstance(w, torch.Tensor) else w
    stack_rows = w.shape[0] // stacks
    assert w.shape[0] % stacks == 0 and stack_rows % n == 0, (tuple(w.shape), tuple(out.shape), stacks)
    assert bias is None or bias.numel() == w.shape[0]
    has_bias = bias is not None
    bias = bias if has_bias else out
    if isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES and w.blocks:
        q, d, s = x
        k = q.shape[1]
        bn, bk, warps = config or Q8_CONFIGS[w.qtype]
        ptrs, strides, step = q8_weight_args(w)
        units = k // UNIT[w.qtype]
        tiles = triton.cdiv(n, bn)
        parts = _split(split if out.dtype == torch.int64 else 1, stacks * tiles * n_used, units, bk, out.device)
        parts, per_split = split_k(parts, False, 1, units, bk, out.device)
        _moe_q8_kernel[(stacks * tiles, slots, parts)](
            q.view(torch.int32), d, s, ids, out, bias, *ptrs, *strides, step, n, k, out.stride(0), per_split, n_used,
            tiles, stack_rows, FMT=FMT[w.qtype], UNIT=UNIT[w.qtype], BN=bn, BK=bk, PER_SLOT=per_slot,
            HAS_BIAS=has_bias, SPLIT=parts, ASM=not INTERPRET, num_warps=warps, **FUSION)
        return out
    x = x.contiguous()
    fmt, (_, k), ptrs, strides = gemv_weight_args(w)
    bn, g, warps = config or GEMV_CONFIGS[fmt]
    groups = k // (2 * WIDTH[fmt])
    tiles = triton.cdiv(n, bn)
    parts = _split(split if out.dtype == torch.int64 else 1, stacks * tiles * n_used, groups, g, out.device)
    parts, per_split = split_k(parts, False, 1, groups, g, out.device)
    _moe_gemv_kernel[(stacks * tiles, slots, parts)](
        x, ids, out, bias, *ptrs, *strides, n, k, x.stride(0), out.stride(0), per_split, n_used, tiles, stack_rows,
        FMT=fmt, W=WIDTH[fmt], BN=bn, G=g, PER_SLOT=per_slot, HAS_BIAS=has_bias, SPLIT=parts, num_warps=warps, **FUSION)
    return out


@triton.jit
def _expert_glu_kernel(g_ptr, u_ptr, out_ptr, q_ptr, d_ptr, s_ptr, act_ptr, F, gu_stride, limit, BLOCKS: tl.constexpr,
                       ROUND: tl.constexpr, OAI: tl.constexpr, LIMIT: tl.constexpr,
                       QUANT: tl.constexpr):
    """Program (slot r, 32-value blocks [BLOCKS j, BLOCKS (j + 1))): model.glu of the slot's gate and
    up sums (int64 fixed point; cleared), each op rounded to ACT as the torch ops on ACT tensors
    round it; into out (ACT), or with QUANT quantize.act's int8 form (triton_quant_act.store_blocks)."""
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bm = b < F // 32
    cols = 32 * b[:, None] + tl.arange(0, 32)[None, :]
    mask = bm[:, None]
    gate = round_act(from_fixed_jit(tl.load(g_ptr + r * gu_stride + cols, mask=mask, other=0, cache_modifier=".cg")),
                     ACT, ROUND)
    up = round_act(from_fixed_jit(tl.load(u_ptr + r * gu_stride + cols, mask=mask, other=0, cache_modifier=".cg")),
                   ACT, ROUND)
    tl.store(g_ptr + r * gu_stride + cols, tl.zeros(cols.shape, tl.int64), mask=mask)
    tl.store(u_ptr + r * gu_stride + cols, tl.zeros(cols.shape, tl.int64), mask=mask)
    if OAI:  # gpt-oss: (up + 1) * (gate * sigmoid(gate * 1.702)), gate <= limit, |up| <= limit
        if LIMIT:
            gate = round_act(tl.minimum(gate, limit), ACT, ROUND)
            up = round_act(tl.minimum(tl.maximum(up, -limit), limit), ACT, ROUND)
        up1 = round_act(up + 1.0, ACT, ROUND)
        z = round_act(gate * 1.702, ACT, ROUND)
        sig = round_act(1.0 / (1.0 + tl.exp(-z)), ACT, ROUND)
        v = round_act(up1 * round_act(gate * sig, ACT, ROUND), ACT, ROUND)
    else:  # silu(gate) * up
        v = round_act(round_act(gate / (1.0 + tl.exp(-gate)), ACT, ROUND) * up, ACT, ROUND)
    if QUANT:
        store_blocks(v, b, bm, q_ptr + r * F, d_ptr + r * (F // 32), s_ptr + r * (F // 16), BLOCKS)
    else:
        tl.store(out_ptr + r * F + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


def expert_glu(gate: torch.Tensor, up: torch.Tensor, act_dtype: torch.dtype, oai: bool = False,
               limit: float | None = None, quantize: bool = False):
    """gate, up (S, F) int64 fixed-point sums (zeroed here; rows of one stride: two buffers, or the two
    column halves of one) -> model.glu's values (S, F) in act_dtype (oai: gpt-oss's swiglu_oai with
    swiglu_limit `limit`), or their quantize_act form (q, d, s)."""
    slots, f = gate.shape
    assert gate.dtype == up.dtype == torch.int64 and f % 32 == 0 and gate.stride() == up.stride()
    assert gate.stride(1) == 1 and up.shape == gate.shape
    blocks = min(64 if INTERPRET else 8, triton.next_power_of_2(f // 32))
    out = torch.empty((slots, f), dtype=act_dtype, device=gate.device)
    q, d, s = act_buffers(slots, f, gate.device) if quantize else (out, out, out)
    _expert_glu_kernel[(slots, triton.cdiv(f // 32, blocks))](
        gate, up, out, q, d, s, out, f, gate.stride(0), float(limit or 0.0), BLOCKS=blocks,
        ROUND=act_dtype != torch.float32, OAI=oai, LIMIT=limit is not None, QUANT=quantize, num_warps=4, **FUSION)
    return (q, d, s) if quantize else out


@triton.jit
def _combine_kernel(down_ptr, w_ptr, x_ptr, act_ptr, C, KUSED: tl.constexpr, BLOCK: tl.constexpr,
                    ROUND: tl.constexpr):
    """Program (token t, columns [BLOCK j, BLOCK (j + 1))): x[t] += round(sum_j w[t, j] round(down[t k + j]))."""
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(KUSED):
        src = down_ptr + (t * KUSED + j) * C + c
        v = round_act(from_fixed_jit(tl.load(src, mask=mask, other=0, cache_modifier=".cg")), ACT, ROUND)
        tl.store(src, tl.zeros((BLOCK,), tl.int64), mask=mask)
        y = v * tl.load(w_ptr + t * KUSED + j)
        acc += y
    acc = round_act(acc, ACT, ROUND)
    xrow = x_ptr + t * C + c
    tl.store(xrow, tl.load(xrow, mask=mask, other=0) + (acc * FIXED_ONE).to(tl.int64), mask=mask)


def combine(down: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, act_dtype: torch.dtype,
            block: int = 1024) -> torch.Tensor:
    """x (T, C) int64 fixed point += the tokens' weighted expert outputs (module doc): down (T k, C)
    int64 fixed point (zeroed here), weights (T, k) fp32, each token's slots in expert order."""
    t, k = weights.shape
    c = x.shape[1]
    assert down.shape == (t * k, c) and down.dtype == x.dtype == torch.int64 and weights.dtype == torch.float32
    assert down.is_contiguous() and x.is_contiguous() and weights.is_contiguous()
    block = min(block, triton.next_power_of_2(c))
    act_ref = torch.empty(1, dtype=act_dtype, device=x.device)
    _combine_kernel[(t, triton.cdiv(c, block))](down, weights, x, act_ref, c, KUSED=k, BLOCK=block,
                                                 ROUND=act_dtype != torch.float32, num_warps=4, **FUSION)
    return x


@triton.jit
def _route_kernel(logits_ptr, w_ptr, id_ptr, E, KUSED: tl.constexpr, BE: tl.constexpr, SOFTMAX: tl.constexpr,
                  NORM: tl.constexpr):
    """Program t: row t's k experts and weights (route_rows), written in ascending expert order."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    v = tl.load(logits_ptr + t * E + e, mask=em, other=float("-inf")).to(tl.float32)
    if SOFTMAX:  # probabilities first (torch.softmax: exp(x - max) / sum)
        p = tl.exp(v - tl.max(v, 0))
        v = tl.where(em, p / tl.sum(p, 0), float("-inf"))
    chosen = e < 0
    for _ in tl.static_range(KUSED):  # the largest left, the lowest index among equals
        cur = tl.where(chosen, float("-inf"), v)
        best = tl.min(tl.where(cur == tl.max(cur, 0), e, BE), 0)
        chosen = chosen | (e == best)
    if SOFTMAX:
        w = tl.where(chosen, v, 0.0)
        if NORM:
            w = w / tl.sum(w, 0)
    else:  # softmax over the chosen logits
        top = tl.where(chosen, v, float("-inf"))
        x = tl.where(chosen, tl.exp(top - tl.max(top, 0)), 0.0)
        w = x / tl.sum(x, 0)
    pos = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(id_ptr + t * KUSED + pos, e, mask=chosen)
    tl.store(w_ptr + t * KUSED + pos, w, mask=chosen)


def route_rows(logits: torch.Tensor, k: int, gating: str, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) fp32 -> (weights (T, k) fp32, experts (T, k) int32), each row's experts in
    ascending order: moe.route's choice ("softmax": top-k of softmax(logits), renormalised with
    norm_topk; "topk_softmax": softmax over the top-k logits), one launch instead of torch's softmax,
    topk, sum, sort and gather. (Exact ties take the lowest expert; exp's last bits may differ from
    torch's.)"""
    t, e = logits.shape
    assert logits.is_contiguous() and gating in ("softmax", "topk_softmax") and 0 < k <= e
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int32, device=logits.device)
    _route_kernel[(t,)](logits, weights, ids, e, KUSED=k, BE=triton.next_power_of_2(e), SOFTMAX=gating == "softmax",
                        NORM=norm_topk, num_warps=1 if e <= 256 else 4, **FUSION)
    return weights, ids
