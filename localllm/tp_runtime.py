"""Tensor parallelism's driver and workers (issue 23): every rank runs the same forward passes, whose
collectives (the sharded model's all-reduces and gathers, parallel.TensorParallel) must come in the same
order on every rank, but only rank 0, the driver, runs the command (reads prompts, samples, prints,
serves HTTP).

The driver's runtime is wrapped in a Driver: each call of a method that touches the model (STEPS) is
first sent to the workers, then run locally. The workers' loop, `follow(runtime, tp)`, receives the calls
and runs them on its own shard until the driver says stop. A message is one Python object broadcast on a
gloo group on the CPU (torch.distributed isend/recv of its pickled bytes: no sockets of our own; the
driver waits for a message's delivery only when it sends the next), separate from the model's
collectives (NCCL on CUDA):

    (method name, args, kwargs, released handle ids, new handle id or None)

Tensors travel by value on the CPU, as numpy arrays (each worker moves them to its device); a KV cache or a Slots the
runtime made (new_cache / new_slots) travels as a handle id that each side maps to its own local object,
with the driver's current length(s): callers move lengths directly (speculative rollback
`cache.length = n`, `slots.lengths[s] = n`), so the worker sets them on its objects before each call.
A decode step is one message of a few hundred bytes (docs/PERFORMANCE.md: its CPU cost).

Ending: the driver sends stop when its command ends, also on an error (Driver.stop in a finally / at
exit); a driver that dies without it closes its gloo connections, and torch's launcher tears the other
ranks down when one fails, so workers never wait forever.
"""

from __future__ import annotations

import atexit
import gc
import pickle
import weakref
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from .cache import KVCache
from .errors import LocalLLMError
from .parallel import TensorParallel
from .slots import Slots

# Runtime methods that touch the model or its caches: forwarded to the workers, in call order.
STEPS = frozenset({
    "forward", "prefill", "decode", "greedy_step", "verify", "warm_verify", "new_cache", "new_slots",
    "prefill_slot", "prefill_slots", "decode_slots", "verify_slots", "copy_prefix", "sync", "warm_up_slots",
})
# Runtime methods that read nothing of the model's state a worker must share (tests/test_tp_runtime.py
# checks that every other Runtime method is a STEP).
LOCAL = frozenset({"prepare", "block_weight", "most_drafts", "release"})
MAKERS = frozenset({"new_cache", "new_slots"})  # return a KV cache / slots: a new handle
STOP = "stop"
NOT_NUMPY = (torch.bfloat16,)  # dtypes numpy lacks: sent as tensors
IDLE = timedelta(days=365)  # the control group's timeout: how long a worker waits for the driver
HEAD = 1024  # bytes of a message's first broadcast: a decode step's message fits in it


@dataclass(frozen=True)
class CacheRef:
    """A KVCache on the wire: its handle and the driver's length."""
    handle: int
    length: int


@dataclass(frozen=True)
class SlotsRef:
    """A Slots on the wire: its handle and the driver's lengths."""
    handle: int
    lengths: tuple[int, ...]


def control_group(tp: TensorParallel):
    """A gloo group over the same ranks for the control messages (the model's group may be NCCL), whose
    timeout is IDLE: a worker waits for the driver's next call as long as a chat or a server stays idle
    (the default group's 30 minutes would end it)."""
    ranks = None if tp.group is None else torch.distributed.get_process_group_ranks(tp.group)
    return torch.distributed.new_group(ranks, backend="gloo", timeout=IDLE)


def send(message, group, world: int) -> list:
    """Post the message to every worker (isend of a fixed HEAD-byte buffer: 8-byte length, then the
    pickled message; a longer one's rest in a second isend) -> the pending sends (their buffers held by
    them): the driver goes on at once and waits for them only before its next message."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    head = torch.zeros(HEAD, dtype=torch.uint8)
    head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    first = data[:HEAD - 8]
    head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    parts = [head]
    if len(data) > HEAD - 8:
        parts.append(torch.frombuffer(bytearray(data[HEAD - 8:]), dtype=torch.uint8))
    ranks = [torch.distributed.get_global_rank(group, r) if group is not None else r for r in range(1, world)]
    return [(torch.distributed.isend(t, dst=r, group=group), t) for r in ranks for t in parts]


def receive(group):
    head = torch.empty(HEAD, dtype=torch.uint8)
    src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    torch.distributed.recv(head, src=src, group=group)
    n = int(head[:8].view(torch.int64))
    data = head[8:8 + n].numpy().tobytes()
    if n > HEAD - 8:
        rest = torch.empty(n - (HEAD - 8), dtype=torch.uint8)
        torch.distributed.recv(rest, src=src, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


def settle(pending: list) -> None:
    """Wait until the posted sends are delivered."""
    for work, _ in pending:
        work.wait()


class Driver:
    """Rank 0's runtime: forwards STEPS to the workers, then runs them on its own shard; everything
    else (cfg, device, dtype, model, most_drafts, class attributes) is the local runtime's."""

    def __init__(self, runtime, tp: TensorParallel, group=None):
        self.runtime, self.tp = runtime, tp
        self.group = control_group(tp) if group is None else group
        self.handles: dict[int, int] = {}  # id(local object) -> handle
        self.released: list[int] = []  # handles of objects the driver dropped, told with the next message
        self.next_handle = 0
        self.stopped = False
        self.pending: list = []  # the last message's sends in flight
        self.made = weakref.WeakValueDictionary()  # handle -> the caches and slots made, while alive

    def __getattr__(self, name):
        if name in STEPS:
            return lambda *args, **kwargs: self.call(name, args, kwargs)
        return getattr(self.runtime, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def wire(self, x):
        if isinstance(x, KVCache):
            return CacheRef(self.handle_of(x), x.length)
        if isinstance(x, Slots):
            return SlotsRef(self.handle_of(x), tuple(x.lengths))
        if isinstance(x, torch.Tensor):  # a numpy array pickles in microseconds, a tensor in hundreds
            x = x.detach().cpu()
            return x if x.dtype in NOT_NUMPY else x.numpy()
        if isinstance(x, (list, tuple)):
            return type(x)(self.wire(v) for v in x)
        return x

    def handle_of(self, obj) -> int:
        h = self.handles.get(id(obj))
        if h is None:
            raise LocalLLMError("tensor parallelism: a KV cache or slots not made by this model's runtime")
        return h

    def release(self, key: int) -> None:
        h = self.handles.pop(key, None)
        if h is not None:
            self.released.append(h)

    def call(self, name: str, args: tuple, kwargs: dict):
        if self.stopped:
            raise LocalLLMError("tensor parallelism: the workers were stopped")
        released, self.released = self.released, []
        new = None
        if name in MAKERS:  # numbered before the call: both sides agree even if one side's call fails
            new, self.next_handle = self.next_handle, self.next_handle + 1
        message = (name, self.wire(args), {k: self.wire(v) for k, v in kwargs.items()}, released, new)
        settle(self.pending)
        self.pending = send(message, self.group, self.tp.world)
        out = getattr(self.runtime, name)(*args, **kwargs)
        if new is not None:
            self.handles[id(out)] = new
            self.made[new] = out
            weakref.finalize(out, self.release, id(out))
        return out

    def stop(self) -> None:
        """Tell the workers to leave `follow` (once; safe to call again); this rank's graphs are dropped
        (Runtime.release: before close())."""
        if self.stopped:
            return
        self.stopped = True
        settle(self.pending)
        settle(send((STOP, (), {}, [], None), self.group, self.tp.world))
        self.pending = []
        try:
            self.runtime.release(slots_of(self.made.values()))
        except RuntimeError:  # a device already in error (the command's own line said so): no graph to wait for
            pass


class Worker:
    """A worker's side of the handles: the local objects of the driver's ids."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.objects: dict[int, object] = {}

    def local(self, x):
        if isinstance(x, CacheRef):
            cache = self.objects[x.handle]
            cache.length = x.length
            return cache
        if isinstance(x, SlotsRef):
            slots = self.objects[x.handle]
            slots.lengths[:] = x.lengths
            return slots
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        if isinstance(x, torch.Tensor):
            return x.to(self.runtime.device)
        if isinstance(x, (list, tuple)):
            return type(x)(self.local(v) for v in x)
        return x

    def run(self, name: str, args: tuple, kwargs: dict, released: list[int], new: int | None) -> None:
        for h in released:
            self.objects.pop(h, None)
        out = getattr(self.runtime, name)(*self.local(args), **{k: self.local(v) for k, v in kwargs.items()})
        if new is not None:
            self.objects[new] = out


def slots_of(objects) -> list[Slots]:
    """The Slots among a side's caches and slots (their tables hold the slot steps' graphs)."""
    return [o for o in list(objects) if isinstance(o, Slots)]


def follow(runtime, tp: TensorParallel, group=None) -> int:
    """A worker's loop: run the driver's calls on this rank's shard until it says stop -> calls run. Then
    the caches and slots the driver made are let go and the runtime's graphs dropped (Runtime.release:
    before close())."""
    group = control_group(tp) if group is None else group
    worker, n = Worker(runtime), 0
    while True:
        message = receive(group)
        if message[0] == STOP:
            runtime.release(slots_of(worker.objects.values()))
            worker.objects.clear()
            return n
        worker.run(*message)
        n += 1


def lead(runtime, tp: TensorParallel) -> Driver:
    """The driver's wrapper for a command: stop is sent when the process exits, whatever ends it (an
    error line, Ctrl-C), as well as by an explicit stop(); then the process groups are closed."""
    driver = Driver(runtime, tp)
    atexit.register(close)  # atexit runs last-in first: stop, then close
    atexit.register(driver.stop)
    return driver


def close() -> None:
    """Leave torch.distributed before the interpreter exits (a group left to its destructor at exit can
    abort the process, after its peers have gone, and prints a warning). Graphs that captured NCCL
    collectives must be gone first (Driver.stop and follow release the runtime's; the collector frees
    any left in cycles), else the NCCL teardown waits for them forever."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()
