"""Where a product's sums go (kernels/triton_gemv.py's and kernels/triton_q8.py's products share it):
the epilogue (bias, rounding, silu(gate) * up, residual), split K, and the output buffers.

Split K (few output rows, long K: more programs than rows so that enough warps stream) is
deterministic: the same step gives the same bits every run, which speculative decoding's exactness
needs. Parts go either into an int64 fixed-point accumulator by integer atomics (one sum in any
order: the decode step's residual stream and its q|k|v and gate/up sums, whose readers convert and
clear them), or, for an fp32 output, into a workspace from which the last part to finish adds them
to the output in part order (split_finish). fp32 atomics into the output, which add in whatever
order the parts finish, are not used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_base import INTERPRET, round_act

COUNTERS = 1 << 16  # per-program counters of one split product (a caller's tensor of them serves every product)
# At most this many x rows share one program's weight tiles (a verify pass of speculative decoding).
MAX_ROWS = 8

# Fixed-point accumulators (int64, 2^32 units): split parts add into them with integer atomics, which
# give the same sum in any order, so they need no ordered reduction (split_finish's memory fence and
# counter). Every fp32 partial of magnitude >= 2^-8 converts exactly; sums must stay below 2^31.
FIXED_ONE = tl.constexpr(4294967296.0)
FENCE = tl.constexpr(not INTERPRET)  # PTX fences (the interpreter runs programs one at a time)


def to_fixed(t: torch.Tensor) -> torch.Tensor:
    """Values -> int64 fixed point, truncated as the kernels' (y * FIXED_ONE).to(int64) truncates."""
    return (t.float() * FIXED_ONE.value).to(torch.int64)


def from_fixed(t: torch.Tensor) -> torch.Tensor:
    """fp32 values of an int64 fixed-point tensor (as from_fixed_jit); other tensors as fp32."""
    return (t.double() * (1.0 / FIXED_ONE.value)).float() if t.dtype == torch.int64 else t.float()


@triton.jit
def gate_act(gate, GELU: tl.constexpr):
    """A GLU's gate function on fp32 values: silu, or GELU: torch's F.gelu(approximate="tanh")
    (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(y) = 1 - 2 / (exp(2y) + 1))."""
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        return gate / (1.0 + tl.exp(-gate))


@triton.jit
def from_fixed_jit(v):
    """Values loaded from an accumulator (fp32 sums, or int64 fixed-point) -> fp32."""
    if v.dtype == tl.int64:
        return v.to(tl.float32) * (1.0 / FIXED_ONE)
    else:
        return v.to(tl.float32)


@triton.jit
def part_out(out_ptr, out_stride, ws_ptr, MT, N, SPLIT: tl.constexpr):
    """Where the epilogue writes: out, or with SPLIT > 1 this part's (MT, N) slice of ws (SPLIT, MT, N)
    (not for a fixed-point accumulator: parts add into it directly)."""
    if SPLIT > 1 and out_ptr.dtype.element_ty != tl.int64:
        return ws_ptr + tl.program_id(2) * MT * N, N
    else:
        return out_ptr, out_stride


@triton.jit
def split_finish(ws_ptr, cnt_ptr, out_ptr, out_stride, rows, rmask, m0, MT, N, ROWS: tl.constexpr,
                  SPLIT: tl.constexpr):
    """Split K, deterministically: the last part of a (row tile, x rows) program to finish (cnt: an
    int32 per such program, zero before; it resets it) adds the SPLIT partial sums in part order to
    out (which holds the residual or zeros). fp32 atomics into out would add them in whatever order
    the parts finish, and the same step could round differently from run to run. (Loading all
    parts as one (SPLIT, BN) tile and summing it was tried: no faster, and the registers it holds
    slowed the products: docs/PERFORMANCE.md.)"""
    if SPLIT > 1 and out_ptr.dtype.element_ty != tl.int64:
        t = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if _last_part(cnt_ptr, t, SPLIT, rows):
            for r in tl.static_range(ROWS):
                m = m0 + r
                s = tl.zeros(rows.shape, tl.float32)
                for j in range(SPLIT):
                    s += tl.load(ws_ptr + (j * MT + m) * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
                o = out_ptr + m.to(tl.int64) * out_stride + rows
                tl.store(o, tl.load(o, mask=rmask, other=0.0) + s, mask=rmask)
            tl.store(cnt_ptr + t, 0)  # ready for the next call (or graph replay)


@triton.jit
def epilogue(y, rows, rmask, m, out_ptr, bias_ptr, res_ptr, N, out_stride, ACT: tl.constexpr, BN: tl.constexpr,
              GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
              SPLIT: tl.constexpr):
    """y (BN,) fp32 sums of rows `rows` of x row m -> out: + bias, rounded, GLU or + residual; with
    SPLIT > 1 out is the part's slice of the partial sums (kernels pass part_out's) and y is stored
    as it is, for split_finish. An int64 out is a fixed-point accumulator: y is added to it
    (atomically with SPLIT > 1), unrounded."""
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    orow = out_ptr + m.to(tl.int64) * out_stride
    if out_ptr.dtype.element_ty == tl.int64:
        q = (y * FIXED_ONE).to(tl.int64)
        if SPLIT > 1:
            tl.atomic_add(orow + rows, q, mask=rmask, sem="relaxed")
        else:
            tl.store(orow + rows, tl.load(orow + rows, mask=rmask, other=0) + q, mask=rmask)
    elif SPLIT > 1:
        tl.store(orow + rows, y, mask=rmask)
    elif GLU:
        y = round_act(y, ACT, ROUND)
        gate, up = tl.split(tl.reshape(y, (BN // 2, 2)))
        silu = round_act(gate / (1.0 + tl.exp(-gate)), ACT, ROUND)
        half = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(orow + half, round_act(silu * up, ACT, ROUND), mask=half < N // 2)
    else:
        y = round_act(y, ACT, ROUND)
        if HAS_RES:
            y += tl.load(res_ptr + m.to(tl.int64) * out_stride + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(orow + rows, y, mask=rmask)


@triton.jit
def _last_part(cnt_ptr, t, parts, like):
    """True in the last of `parts` programs to reach this point for counter t (zero before): it may
    then read the others' partial sums (loaded with cache_modifier=".cg") and must reset the counter.
    Every thread fences its own writes (fence.acq_rel.gpu; `like`: any tensor of the program, for the
    per-thread instruction) before the barrier: the counter's release, by one thread, orders only
    that thread's writes, and the partials of a program of several warps come from all of them."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [like.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    return tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel") == parts - 1


class Launch(NamedTuple):
    """A product's launch (plan): K cut into `split` parts of `per_split` units, `rows` x rows per
    program, the grid (N / BN, M / rows, split), the output, a tensor of the activation dtype (its
    dtype tells the kernel how to round), and split K's partial sums and counters (placeholders
    without split)."""

    split: int
    per_split: int
    rows: int
    grid: tuple[int, int, int]
    out: torch.Tensor
    act_ref: torch.Tensor
    ws: torch.Tensor
    counters: torch.Tensor


def rows_per_program(m: int) -> int:
    """x rows per program: all of them up to MAX_ROWS (each weight tile read once), else the largest
    divisor of m up to MAX_ROWS (decode_slots' batches of 16..64 rows: groups of 8, each weight tile
    read m / 8 times, not m). Each row's sum is the same whatever the group (the kernels' per-row
    accumulators)."""
    return m if m <= MAX_ROWS else max(r for r in range(1, MAX_ROWS + 1) if m % r == 0)


def split_buffers(split: int, m: int, n: int, grid, counters: torch.Tensor | None, out: torch.Tensor):
    """Split K's partial sums (split, m, n) fp32 and per-program counters (zero; the caller may keep
    one COUNTERS-long tensor across calls, each call leaves it zeroed), or placeholders (out) without
    split."""
    if split == 1:
        return out, out
    if counters is None:
        counters = torch.zeros(COUNTERS, dtype=torch.int32, device=out.device)
    assert grid[0] * grid[1] <= counters.numel()
    return torch.empty((split, m, n), dtype=torch.float32, device=out.device), counters


def plan(m: int, n: int, bn: int, units: int, per_iter: int, glu: bool, split: int | None,
         residual: torch.Tensor | None, inplace: bool, out_dtype: torch.dtype | None, act: torch.dtype, device,
         counters: torch.Tensor | None) -> Launch:
    """The launch of a product of m x rows, n output rows in tiles of bn, K in `units` taken per_iter
    at a time (see gemv for the other arguments)."""
    split, per_split = split_k(split, glu, triton.cdiv(n, bn), units, per_iter, device)
    out = output(m, n, split, glu, residual, inplace, out_dtype or (residual.dtype if residual is not None else act),
                 device)
    rows = rows_per_program(m)
    grid = (triton.cdiv(n, bn), m // rows, split)
    ws, counters = split_buffers(split, m, n, grid, counters, out)
    return Launch(split, per_split, rows, grid, out, torch.empty(1, dtype=act, device=device), ws, counters)


def split_k(split: int | None, glu: bool, programs: int, groups: int, g: int, device: torch.device) -> tuple[int, int]:
    """-> (parts of K, groups per part), each part a multiple of the g groups an iteration takes.
    split None: chosen from the grid size (auto_split); GLU epilogues need whole rows (no split)."""
    split = 1 if glu or INTERPRET and split is None else split or auto_split(programs, groups, g, device)
    per_split = triton.cdiv(triton.cdiv(groups, split), g) * g
    return triton.cdiv(groups, per_split), per_split


def output(m: int, n: int, split: int, glu: bool, residual: torch.Tensor | None, inplace: bool,
           out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The product's output buffer: the residual itself (inplace), an fp32 buffer holding the residual
    or zeros (split K: the parts' sum is added to it), else a new (m, n or n / 2) tensor of out_dtype."""
    if split > 1 or inplace:
        out = residual if inplace else torch.zeros((m, n), dtype=torch.float32, device=device)
        if split > 1 and residual is not None and not inplace:
            out.copy_(residual)
        # fp32, or an int64 fixed-point accumulator (epilogue); rows may be column slices
        assert out.dtype in (torch.float32, torch.int64) and out.stride(-1) == 1
        return out
    return torch.empty((m, n // 2 if glu else n), dtype=out_dtype, device=device)


SPLIT_PROGRAMS_PER_SM = 64  # auto_split's aim: the fastest verify pass and decode step on Hopper (docs/PERFORMANCE.md)
SPLIT_MAX = 16  # and its most parts


def auto_split(programs: int, groups: int, g: int, device: torch.device) -> int:
    """Parts of K so that the grid fills the GPU in several waves (few long rows: down projections).
    """
    if device.type != "cuda":
        return 1
    target = SPLIT_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    while programs * split * 2 <= target and groups // (split * 2) >= 2 * g and split < SPLIT_MAX:
        split *= 2
    return split
