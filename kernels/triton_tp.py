"""Tensor parallelism's kernels for the CUDA decode step (issue 23; backends/cuda_tp.py uses them).

The decode step's residual stream is an int64 fixed-point accumulator (triton_epilogue.FIXED_ONE), and
so are the partial sums that a rank's o and down products leave (their input columns are the rank's
part). Integer sums are exact and associative: however the ranks' parts are added (NCCL's ring or
tree, this file's push kernel), every rank gets the same bits, every run, and a TP=N step differs
from TP=1 only by the truncation of each product part to fixed point.

add_fixed:  x (+)= red, red cleared: after an NCCL all_reduce of red (the partial sums), the residual add.
reduce_push: the all-reduce over peer-visible buffers (torch symmetric memory, no multicast): each
  rank writes its partial sums into its peers' memory and reads only its own (below).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION, PDL, pdl_start

ADD_BLOCK = 1024


@triton.jit
def _add_fixed_kernel(x_ptr, red_ptr, n, ASSIGN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    r = tl.load(red_ptr + i, mask=m, other=0)
    tl.store(red_ptr + i, tl.zeros_like(r), mask=m)
    if ASSIGN:
        tl.store(x_ptr + i, r, mask=m)
    else:
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m, other=0) + r, mask=m)


def add_fixed(x: torch.Tensor, red: torch.Tensor, assign: bool = False) -> torch.Tensor:
    """x (T, C) int64 += red (same shape, int64; assign: x = red); red is zeroed -> x."""
    assert x.dtype == red.dtype == torch.int64 and x.shape == red.shape and x.is_contiguous() and red.is_contiguous()
    n = x.numel()
    _add_fixed_kernel[(triton.cdiv(n, ADD_BLOCK),)](x, red, n, ASSIGN=assign, BLOCK=ADD_BLOCK, num_warps=4, **FUSION)
    return x


# The push all-reduce (backends/cuda_tp.PushReducer). Every rank's symmetric buffer holds, at these
# int64 offsets: flags (2, PUSH_SLOTS, world), then receive areas (2, world, n): epoch parity, sender.
# Program g of a reduction (1) takes the next epoch e (its counter slot, and every slot no program of
# this reduction owns: all slots then hold the count of reductions so far, whatever the grid was),
# (2) stores its chunks of this rank's accumulator into every peer's receive area [e % 2][rank]
# (posted writes: no round trip) and then, released at system scope, e into the peer's flag
# [e % 2][g][rank], (3) waits until its own flags [e % 2][g][p] hold e (a local poll), (4) adds its
# accumulator and the received parts into x and clears the accumulator (no peer reads it). A peer
# can run at most one reduction ahead (its next needs our flags of this one, set only once our
# previous reduction ended), so two parities of areas and flags never overwrite unread ones, and flags
# compare for equality (int64 epochs: no wrap).
# LL (small messages; NCCL's low-latency protocol's idea): no flags, no fence, no barrier. Each value
# travels as two int64 words, (tag << 32) | its low / high 32 bits, tag = the epoch as a positive
# int32; an 8-byte store arrives whole, so a word carrying this epoch's tag is this epoch's value, and
# the reader polls its received words until every one carries the tag. Receive areas (2, world, 2, n).
PUSH_BLOCK = 512  # int64 values a push program handles per pass (4 KB: one row of 4096 takes 8 SMs) ..
SMALL_BLOCK, SMALL_MAX = 128, 4 * 4096  # .. and in messages of up to SMALL_MAX values (more programs:
# H200 x2, bench/allreduce_speed.py, one row: 4.0 us at 128, 4.3 at 512; 16 rows: 512 the faster)
PUSH_SLOTS = 128  # at most this many programs a reduction
LL_MAX = 16 * 4096  # messages of up to this many values take LL (twice the bytes, no fence)


@triton.jit
def _epoch(ctr_ptr, SLOTS: tl.constexpr):
    """Step (1): program g's epoch e, every slot it owns advanced to e."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    e = tl.load(ctr_ptr + g) + 1
    for s in range(g, SLOTS, G):
        tl.store(ctr_ptr + s, e)
    return e


@triton.jit
def _words(area, i, n, m, tag):
    """LL's received words of chunk i (low halves at area + i, high at area + n + i) -> (lo, hi, how many
    values do not carry the tag yet)."""
    lo = tl.load(area + i, mask=m, other=0, volatile=True)
    hi = tl.load(area + n + i, mask=m, other=0, volatile=True)
    return lo, hi, tl.sum((((lo >> 32) != tag) | ((hi >> 32) != tag)) & m, axis=0)


@triton.jit
def _area(base, par, src, world, n, SLOTS: tl.constexpr, LL: tl.constexpr):
    """The receive area [par][src] of the symmetric buffer at base (int64 pointer): after the flags
    (2, SLOTS, world), areas of n values (LL: 2 n words, low halves then high)."""
    return base + 2 * SLOTS * world + (par * world + src) * n * (2 if LL else 1)


@triton.jit
def _flag(base, par, g, src, world, SLOTS: tl.constexpr):
    """Flag [par][g][src] of the symmetric buffer at base."""
    return base + (par * SLOTS + g) * world + src


@triton.jit
def _take(acc_ptr, i, m):
    """This rank's partial sums of chunk i, the accumulator cleared there (no peer reads it)."""
    s = tl.load(acc_ptr + i, mask=m, other=0)
    tl.store(acc_ptr + i, tl.zeros_like(s), mask=m)
    return s


@triton.jit
def _give(x_ptr, i, m, s, ASSIGN: tl.constexpr):
    """x = s (ASSIGN) or x += s at chunk i."""
    if ASSIGN:
        tl.store(x_ptr + i, s, mask=m)
    else:
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m, other=0) + s, mask=m)


@triton.jit
def _push(acc_ptr, peers_ptr, e, rank, world, n, BLOCK: tl.constexpr, SLOTS: tl.constexpr, LL: tl.constexpr):
    """Step (2) of program g, epoch e: its chunks of the accumulator into every peer's receive area,
    then (not LL) the flags; LL: as tagged words, which need no flag."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    par = e % 2
    tag = ((e - 1) % 0x7FFFFFFF + 1) << 32
    for c in range(g, tl.cdiv(n, BLOCK), G):
        i = tl.arange(0, BLOCK).to(tl.int64) + c * BLOCK
        m = i < n
        v = tl.load(acc_ptr + i, mask=m, other=0)
        for p in range(world):
            if p != rank:
                area = _area(tl.load(peers_ptr + p).to(tl.pointer_type(tl.int64)), par, rank, world, n, SLOTS, LL)
                if LL:
                    tl.store(area + i, tag | (v & 0xFFFFFFFF), mask=m)
                    tl.store(area + n + i, tag | ((v >> 32) & 0xFFFFFFFF), mask=m)
                else:
                    tl.store(area + i, v, mask=m)
    if not LL:
        tl.debug_barrier()  # every thread's stores come before the flags
        for p in range(world):
            if p != rank:
                peer = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(_flag(peer, par, g, rank, world, SLOTS), e, sem="release", scope="sys")


@triton.jit
def _sum(x_ptr, acc_ptr, peers_ptr, err_ptr, e, rank, world, n, spins, ASSIGN: tl.constexpr, BLOCK: tl.constexpr,
         SLOTS: tl.constexpr, LL: tl.constexpr):
    """Steps (3) and (4) of program g, epoch e: (not LL) its flags awaited, then each chunk's received
    parts added to the accumulator's into x; LL: each chunk's words polled until all carry the tag."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    par = e % 2
    tag = (e - 1) % 0x7FFFFFFF + 1
    mine = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int64))
    if not LL:
        for p in range(world):
            if p != rank:
                flag = _flag(mine, par, g, p, world, SLOTS)
                seen = tl.atomic_cas(flag, e, e, sem="acquire", scope="sys")  # (a read: it stores what is there)
                k = 0
                while (seen != e) & (k < spins):
                    seen = tl.atomic_cas(flag, e, e, sem="acquire", scope="sys")
                    k += 1
                if seen != e:
                    tl.store(err_ptr, 1)
        tl.debug_barrier()  # every thread reads after the flags were seen
    for c in range(g, tl.cdiv(n, BLOCK), G):
        i = tl.arange(0, BLOCK).to(tl.int64) + c * BLOCK
        m = i < n
        s = _take(acc_ptr, i, m)
        for p in range(world):
            if p != rank:
                area = _area(mine, par, p, world, n, SLOTS, LL)
                if LL:
                    lo, hi, late = _words(area, i, n, m, tag)
                    k = 0
                    while (late > 0) & (k < spins):
                        lo, hi, late = _words(area, i, n, m, tag)
                        k += 1
                    if late > 0:
                        tl.store(err_ptr, 1)
                    s += (hi << 32) | (lo & 0xFFFFFFFF)
                else:
                    s += tl.load(area + i, mask=m, other=0, volatile=True)
        _give(x_ptr, i, m, s, ASSIGN)


@triton.jit
def _reduce_push_kernel(x_ptr, acc_ptr, peers_ptr, ctr_ptr, err_ptr, rank, world, n, spins, ASSIGN: tl.constexpr,
                        PUSH: tl.constexpr, SUM: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr,
                        LL: tl.constexpr, PDL: tl.constexpr):
    """PUSH and SUM both set: one reduction. One of them: that half (the interpreter's tests run two
    ranks' halves in turn, one program at a time). PDL: launched while the product before ends (its
    launch hidden), it reads the accumulator only once that product is complete. LL: the tagged words."""
    pdl_start(PDL)
    if PUSH:
        e = _epoch(ctr_ptr, SLOTS)
        _push(acc_ptr, peers_ptr, e, rank, world, n, BLOCK, SLOTS, LL)
    else:
        e = tl.load(ctr_ptr + tl.program_id(0))
    if SUM:
        _sum(x_ptr, acc_ptr, peers_ptr, err_ptr, e, rank, world, n, spins, ASSIGN, BLOCK, SLOTS, LL)


def push_block(n: int) -> int:
    """Values a program of a reduction of n values handles per pass."""
    return SMALL_BLOCK if n <= SMALL_MAX else PUSH_BLOCK


def push_grid(n: int, block: int | None = None) -> int:
    """Programs of a reduction of n values."""
    return min(PUSH_SLOTS, triton.cdiv(n, block or push_block(n)))


def push_buffer_size(n: int, world: int) -> int:
    """int64 values of a rank's symmetric buffer for messages of n values (LL's areas: twice)."""
    return 2 * PUSH_SLOTS * world + 2 * world * n * (2 if n <= LL_MAX else 1)


def reduce_push(x: torch.Tensor, acc: torch.Tensor, peers: torch.Tensor, ctr: torch.Tensor, err: torch.Tensor,
                rank: int, world: int, assign: bool = False, spins: int = 1 << 30, block: int | None = None,
                halves: str = "both", ll: bool | None = None) -> torch.Tensor:
    """x (T, C) int64 (+)= the sum over ranks of their accumulators acc (T, C) int64 (this rank's: local
    memory; cleared). peers (world,) int64: each rank's symmetric buffer address (push_buffer_size(
    x.numel(), world) values, laid out as above); ctr (PUSH_SLOTS,) int64 this rank's epoch counters
    (zero with the buffers at set-up); err (1,) int32 set on a wait that timed out. halves: 'push' /
    'sum' run one half (tests). ll: the LL protocol (None: for n <= LL_MAX). Every rank calls it with the
    same n and ll (the same grid and protocol). -> x"""
    assert x.dtype == acc.dtype == torch.int64 and x.is_contiguous() and acc.is_contiguous()
    assert x.numel() == acc.numel() and world >= 1
    n = x.numel()
    ll = n <= LL_MAX if ll is None else ll
    block = block or push_block(n)
    assert n <= LL_MAX or not ll, "LL's areas are sized for messages of up to LL_MAX values"
    _reduce_push_kernel[(push_grid(n, block),)](x, acc, peers, ctr, err, rank, world, n, spins, ASSIGN=assign,
                                                PUSH=halves != "sum", SUM=halves != "push", BLOCK=block,
                                                SLOTS=PUSH_SLOTS, LL=ll, PDL=PDL, num_warps=4, launch_pdl=PDL,
                                                **FUSION)
    return x
