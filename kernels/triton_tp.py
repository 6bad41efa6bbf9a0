"""Tensor parallelism's kernels for the CUDA decode step (issue 23; backends/cuda_tp.py uses them).

The decode step's residual stream is an int64 fixed-point accumulator (triton_epilogue.FIXED_ONE), and
so are the partial sums that a rank's o and down products leave (their input columns are the rank's
part). Integer sums are exact and associative: however the ranks' parts are added (NCCL's ring or
tree, this file's one-shot kernel), every rank gets the same bits, every run, and a TP=N step differs
from TP=1 only by the truncation of each product part to fixed point.

add_fixed:  x (+)= red, red cleared: after an NCCL all_reduce of red (the partial sums), the residual add.
reduce_p2p: the one-shot all-reduce over peer-visible buffers (torch symmetric memory, no multicast):
  every rank's partial sums live in a buffer every rank can read; a program per chunk (1) tells the
  peers this reduction has begun and waits until each has too (a flag in each peer's signal pad:
  compare-and-swap 0 -> 1 there, 1 -> 0 here, system scope: the flags reset themselves), (2) reads the
  parts of ranks 0 .. N-1 in that order and adds their sum to x (or sets x to it). Its own buffer is
  not cleared then (peers may still be reading it) but in the next reduction, which uses another
  buffer: once every peer has begun that one it has finished this one (a kernel ends before the next
  begins), so one barrier per reduction suffices (backends/cuda_tp.P2PReducer rotates three buffers).
  A wait that never ends (a peer gone) gives up after `spins` polls and sets err[0] (the host checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_base import FUSION

ADD_BLOCK = 1024
P2P_BLOCK = 2048  # int64 values a reduce_p2p program handles per pass
P2P_PROGRAMS = 32  # at most this many programs (signal pad slots: programs x ranks)
PAD_SLOTS = P2P_PROGRAMS  # int32 flags per rank a signal pad holds for reduce_p2p


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


@triton.jit
def _signal(pads_ptr, rank, world, slot, spins, err_ptr):
    """Phase-slot `slot` barrier with every peer: set flag [slot, rank] in each peer's pad (0 -> 1; waits
    while the peer has not yet taken the last one), then take flag [slot, peer] in ours (1 -> 0) for
    every peer. One thread per program issues the atomics (scalar operands); release/acquire at system
    scope orders this rank's writes before the peer's reads."""
    tl.debug_barrier()  # every thread's reads and writes of the program come before the flag
    mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in range(world):
        if p != rank:
            flag = tl.load(pads_ptr + p).to(tl.pointer_type(tl.int32)) + slot * world + rank
            old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
            n = 0
            while (old != 0) & (n < spins):
                old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
                n += 1
            if old != 0:
                tl.store(err_ptr, 1)
    for p in range(world):
        if p != rank:
            flag = mine + slot * world + p
            old = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
            n = 0
            while (old != 1) & (n < spins):
                old = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
                n += 1
            if old != 1:
                tl.store(err_ptr, 1)
    tl.debug_barrier()  # every thread of the program reads after the flags are taken


@triton.jit
def _reduce_p2p_kernel(x_ptr, bufs_ptr, pads_ptr, err_ptr, prev_ptr, rank, world, n, spins, ASSIGN: tl.constexpr,
                       CLEAR: tl.constexpr, BLOCK: tl.constexpr):
    """Program g of G: chunks g, g + G, .. of BLOCK values. bufs/pads: (world,) int64 device addresses
    of each rank's buffer / signal pad (symmetric memory's buffer_ptrs / signal_pad_ptrs). Flag slot g.
    CLEAR: zero this rank's buffer of the previous reduction (prev), which every peer has finished
    reading once it has signalled this one."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    _signal(pads_ptr, rank, world, g, spins, err_ptr)
    for c in range(g, tl.cdiv(n, BLOCK), G):
        i = tl.arange(0, BLOCK).to(tl.int64) + c * BLOCK  # (n < 2^31)
        m = i < n
        s = tl.zeros((BLOCK,), tl.int64)
        for p in range(world):  # rank order (integer sums: the same bits in any order anyway)
            part = tl.load(bufs_ptr + p).to(tl.pointer_type(tl.int64))
            s += tl.load(part + i, mask=m, other=0, volatile=True)
        if ASSIGN:
            tl.store(x_ptr + i, s, mask=m)
        else:
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m, other=0) + s, mask=m)
        if CLEAR:
            tl.store(prev_ptr + i, tl.zeros((BLOCK,), tl.int64), mask=m)


def reduce_p2p(x: torch.Tensor, bufs: torch.Tensor, pads: torch.Tensor, err: torch.Tensor, rank: int, world: int,
               assign: bool = False, prev: torch.Tensor | None = None, spins: int = 1 << 30) -> torch.Tensor:
    """x (T, C) int64 (+)= the sum over ranks of their buffers' first T C values (bufs[rank]: this rank's
    own, which stays as it is: peers may still read it); prev (this rank's buffer of the previous
    reduction, another one) is zeroed. bufs, pads: (world,) int64 device addresses; err (1,) int32 set
    on a wait that timed out. -> x"""
    assert x.dtype == torch.int64 and x.is_contiguous() and world >= 1
    assert prev is None or (prev.numel() >= x.numel() and prev.is_contiguous())
    n = x.numel()
    grid = (min(P2P_PROGRAMS, triton.cdiv(n, P2P_BLOCK)),)
    _reduce_p2p_kernel[grid](x, bufs, pads, err, prev if prev is not None else x, rank, world, n, spins,
                             ASSIGN=assign, CLEAR=prev is not None, BLOCK=P2P_BLOCK, num_warps=8, **FUSION)
    return x
