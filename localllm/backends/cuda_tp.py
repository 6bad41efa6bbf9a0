"""Tensor parallelism in the CUDA decode step (issue 23): the collectives GraphDecoder captures.

A rank's o and down products (their input columns are its part: localllm/parallel.py's layout) add
their partial sums into the reducer's accumulator (take()), int64 fixed point like the residual stream
x (kernels/triton_epilogue.FIXED_ONE); reduce() sums it over the ranks and adds it to x (the residual
add), and the accumulator is zero again for its next product. The embedding lookup writes this rank's
vocabulary rows into it (other ids: zeros) and the reduce SETS x to the sum. Integer sums are exact:
every rank holds the same x bits, every run, whatever the collective's algorithm (no NCCL_ALGO /
NCCL_PROTO to pin). The head's logits (rows, V/N) fp32 per rank are joined by an all-gather into
(rows, V) in rank order (tp_model.gather_logits, into the decoder's fixed buffer).

Two reducers, one picked at load for the process group (make_reducer), the same on every rank:
  NcclReducer  torch.distributed.all_reduce of the accumulator (NCCL, int64 sum), then
               kernels/triton_tp.add_fixed (the add, and the clear).
  PushReducer  the accumulator in local memory; kernels/triton_tp.reduce_push stores it into every
               peer's receive area in torch symmetric memory (peer-visible, no multicast:
               TORCH_SYMM_MEM_DISABLE_MULTICAST stays set) and sums what its peers stored into its own:
               one kernel, one-way writes, no remote reads or handshakes, no NCCL launch. For the decode
               step's small messages (an 8B step has 65 all-reduces of 4096 values a row), where NCCL's
               latency is most of the cost (bench/allreduce_speed.py: ~4 us a row against NCCL's ~10;
               the kernel before it, which read its peers' sums after a compare-and-swap handshake, ~9).
Both are captured inside the decode graphs: every rank captures and replays the same sequence.
PushReducer's set-up checks itself on known values (exact sums, accumulator cleared) on every rank;
unless every rank's check passes, NCCL.
"""

from __future__ import annotations

import warnings

import torch

from localllm.kernels.triton_tp import PUSH_SLOTS, add_fixed, push_buffer_size, reduce_push

from ..parallel import TensorParallel

REDUCERS = ("auto", "nccl", "push")  # make_reducer's choices ("auto": push where it sets up and checks out)


class NcclReducer:
    name = "nccl"

    def __init__(self, tp: TensorParallel, rows: int, cols: int, device):
        self.tp = tp
        self.red = torch.zeros(rows, cols, dtype=torch.int64, device=device)

    def take(self, assign: bool = False) -> torch.Tensor:
        """The (rows, cols) int64 accumulator (zero) the next reduce() sums: the product writes it first."""
        return self.red

    def reduce(self, x: torch.Tensor, assign: bool = False) -> torch.Tensor:
        """x (+)= the ranks' accumulators (take()'s) summed; the accumulator is zero again for the
        next take() -> x."""
        torch.distributed.all_reduce(self.red, group=self.tp.group)
        return add_fixed(x, self.red, assign)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks in place (int64 accumulators beside red: Gemma's h_acc)."""
        torch.distributed.all_reduce(t, group=self.tp.group)
        return t

    def check(self) -> None:
        """Raise if a collective failed (NCCL reports its own errors)."""

    def reset(self) -> None:
        """Nothing to reset (the accumulator is zero after every reduce)."""


class PushReducer(NcclReducer):
    """The accumulator (rows, cols) int64 in local memory; one symmetric buffer a rank (flags and
    receive areas: kernels/triton_tp.push_buffer_size) that the peers write into; epoch counters
    (PUSH_SLOTS,) that every rank advances alike (the same reductions in the same order, as the graph
    replays keep them)."""

    name = "push"

    def __init__(self, tp: TensorParallel, rows: int, cols: int, device):
        self.tp = tp
        self.handle, self.buf, peers = symmetric_buffer(tp, push_buffer_size(rows * cols, tp.world), device)
        self.peers = torch.tensor(peers, dtype=torch.int64, device=device)
        self.red = torch.zeros(rows, cols, dtype=torch.int64, device=device)
        self.ctr = torch.zeros(PUSH_SLOTS, dtype=torch.int64, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        # the protocol (None: LL for small messages) and values a program (bench/allreduce_speed.py sets them)
        self.ll: bool | None = None
        self.block: int | None = None
        torch.cuda.synchronize(device)
        self.handle.barrier()  # every rank's flags are zero before any peer writes them

    def reduce(self, x: torch.Tensor, assign: bool = False) -> torch.Tensor:
        return reduce_push(x, self.red, self.peers, self.ctr, self.err, self.tp.rank, self.tp.world, assign,
                           block=self.block, ll=self.ll)

    def reset(self) -> None:
        """Epochs, flags and accumulator zero on every rank (collective)."""
        torch.cuda.synchronize(self.red.device)
        self.handle.barrier()
        self.buf.zero_()
        self.ctr.zero_()
        self.red.zero_()
        torch.cuda.synchronize(self.red.device)
        self.handle.barrier()

    def check(self) -> None:
        if self.err.item():
            raise RuntimeError("the push all-reduce timed out waiting for a peer")


def symmetric_buffer(tp: TensorParallel, n: int, device) -> tuple:
    """A zeroed int64 buffer of n values in torch symmetric memory for tp's group -> (handle, buffer,
    each rank's buffer address in rank order). Raises where the group's ranks are not symmetric memory's."""
    import torch.distributed._symmetric_memory as symm

    group = tp.group or torch.distributed.group.WORLD
    name = group.group_name
    if hasattr(symm, "enable_symm_mem_for_group"):  # needed by older torch; deprecated (a no-op) later
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(name)
    buf = symm.empty(n, dtype=torch.int64, device=device)
    h = symm.rendezvous(buf, name)
    if h.world_size != tp.world or h.rank != tp.rank:
        raise RuntimeError("symmetric memory's ranks are not the process group's")
    buf.zero_()
    return h, buf, list(h.buffer_ptrs)


def self_test(red: NcclReducer, tp: TensorParallel) -> bool:
    """A step's order of reductions (the embedding's assign, then 5 sums: both epoch parities, each
    twice) on known values (rank-dependent, large and negative, every value of the buffer) gives
    their exact sums, and leaves the accumulator that the next reductions take zero."""
    rows, cols = red.take().shape
    dev = red.take().device
    base = torch.arange(rows * cols, device=dev, dtype=torch.int64).view(rows, cols)
    ok = True
    for i, assign in enumerate([True, False, False, False, False, False]):
        parts = [(base * (1 << 33) - (r + 1 + i) * (1 << 50)) * (1 if (r + i) % 2 else -1) for r in range(tp.world)]
        buf = red.take(assign)
        ok = ok and not buf.any()  # cleared by the reduction before, or never written
        buf.copy_(parts[tp.rank])
        x = torch.full((rows, cols), 7 + i, dtype=torch.int64, device=dev)
        red.reduce(x, assign)
        torch.cuda.synchronize(dev)
        red.check()
        ok = ok and torch.equal(x, sum(parts) + (0 if assign else 7 + i))
    red.reset()
    return ok


def make_reducer(tp: TensorParallel, rows: int, cols: int, device, kind: str = "auto") -> NcclReducer:
    """The reducer of a decoder's (rows, cols) int64 messages. kind: REDUCERS. 'push' and 'auto' (the push
    kernel) set up the kernel's symmetric memory and check it (self_test) on every rank; unless every
    rank succeeds, NCCL ('push' then raises). Collective: every rank calls it with the
    same arguments."""
    if kind not in REDUCERS:
        raise ValueError(f"all-reduce {kind!r}: one of {', '.join(REDUCERS)}")
    nccl = NcclReducer(tp, rows, cols, device)
    if kind == "nccl" or (kind == "auto" and torch.device(device).type != "cuda"):  # (gloo on the CPU: tests)
        return nccl
    fast = None
    try:
        fast = PushReducer(tp, rows, cols, device)
    except Exception:  # no peer access, no symmetric memory in this torch, ...: NCCL serves
        pass
    # every rank set up before any runs the kernel (a rank alone in it would wait for its peers), then
    # every rank's check passed
    if everyone(tp, fast is not None, device) and everyone(tp, passes(fast, tp), device):
        return fast
    if kind != "auto":
        raise RuntimeError(f"the {kind} all-reduce (symmetric memory) did not set up on every rank")
    return nccl


def passes(red: PushReducer, tp: TensorParallel) -> bool:
    """self_test, False where it raises (a timed-out wait)."""
    try:
        return self_test(red, tp)
    except Exception:
        return False


def everyone(tp: TensorParallel, ok: bool, device) -> bool:
    """ok on every rank (collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return flag.item() == 1
