"""Prompts into slots as replayed CUDA graphs, by padded length and prompt count (issue 22: `serve`'s
time to first token on CUDA).

An eager prompt pass launches ~15 kernels a layer from Python and is bound by the host (a 128-id
prompt of an 8B model: 24-58 ms of host time on an H100 for ~10 ms of GPU work). Replayed, one client's
first token of such a prompt came in half the time on an H200 (docs/PERFORMANCE.md, tenth session).
Here a prompt of T ids at positions [start, start + T) of slot s runs a graph captured for a bucket
Tb >= T (BUCKETS), whose inputs are device buffers: the ids (padded with id 0), each row's position
(start + t: the padding rows continue past the prompt), the slot and the last real row. So a graph
serves any start, slot and T of its bucket; what varies lives in those buffers.

Several prompts of one prefill pass (a burst of requests) take a graph of n prompts (PROMPTS) of Tb
rows each, Tb the bucket of the longest: prompt i at rows [i Tb, (i + 1) Tb) of the pass, attending
as a batch of its own (attention.SlotMaskKeys); a pass of fewer prompts than n repeats its last prompt
(the same ids at the same rows of the same slot: the same values written twice). Eagerly that pass
launches ~15 kernels a layer plus an attention per prompt from Python: 40-100 ms of host time for
2-15 prompts of 128 ids of the 8B shape on an H200 whose GPU work is 7-47 ms (docs/PERFORMANCE.md,
thirteenth session).

The forward is slots.prefill_slots' for one segment (the reference qkv op, ScatterCache writes at each
row's (slot, position), each layer's rope rows of slot_ropes' tables), with attention over the slot's
whole capacity under the mask "key j visible to the row at position p iff j <= p": the padding rows'
keys lie past every real row's position, so the real rows see exactly the keys of an unpadded pass;
the padding rows' cache writes land past the slot's new length, which later steps overwrite. The
products see Tb rows instead of T: within rounding of the eager pass, as prefill_slots is of
prefill_slot. Taken only where the padding fits the slot (start + Tb <= capacity), for the Llama layer
without windows or per-layer inputs and without tensor parallelism; anything else runs eagerly.
"""

from __future__ import annotations

import torch

from ..attention import SlotMaskKeys
from ..model import Transformer
from ..slots import SegmentCache, Slots, slot_ropes
from .cuda_graph import captured

# padded prompt lengths: 1..4 exactly (the integer-dot kernels' row counts: a repeated chat prompt
# prefills only its last ids), then matmul passes
BUCKETS = (1, 2, 3, 4, 16, 32, 64, 128, 256, 512)
# prompts a graph of several takes, for prompts of at least MANY_ROWS padded rows (shorter ones, rare
# in a pass of several, run eagerly); n Tb <= the pass's ids (ServeSettings.prefill_tokens). Padding
# takes at most a quarter of a pass (9 prompts in 12's graph; with powers of two only, 9 prompts of 128
# ids took 16's, as long as 16 prompts: docs/PERFORMANCE.md, fourteenth session)
PROMPTS = (2, 3, 4, 6, 8, 12, 16)
MANY_ROWS = 16


def bucket(t: int) -> int | None:
    """The smallest bucket holding t ids; None past the largest."""
    return next((b for b in BUCKETS if b >= t), None)


def prompts_bucket(n: int) -> int | None:
    """The smallest graph of several prompts holding n; None past the largest."""
    return next((b for b in PROMPTS if b >= n), None)


def covers(model: Transformer) -> bool:
    cfg = model.cfg
    return model.tp is None and not any(cfg.sliding_layers) and not cfg.per_layer_dim


def padded_forward(model: Transformer, slots: Slots, tokens: torch.Tensor, pos: torch.Tensor,
                   slot: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """tokens (1, n Tb): n prompts of Tb rows, prompt i at positions pos[i Tb:(i + 1) Tb] of the slot
    held by slot[i] (slot (n,)) -> the logits (n, V) fp32 of rows last (n,); writes each row's k, v at
    (its slot, its position). Every shape is n, Tb's and the slots' (no host value enters: the graph's
    forward)."""
    rows, n = tokens.shape[1], slot.shape[0]
    x = model.embed(tokens)
    cache = SegmentCache(slots.cache, slot.repeat_interleave(rows // n), pos)
    visible = torch.arange(slots.capacity, device=pos.device) <= pos.view(n, rows // n, 1)  # (n, Tb, S)
    keys = SlotMaskKeys(slot, visible)
    sets: dict[int, tuple] = {}  # a rope set's rows, shared by the layers sharing the set
    for i, (blk, rope) in enumerate(zip(model.blk, slot_ropes(model, slots))):
        if rope is not None and id(rope) not in sets:
            sets[id(rope)] = tuple(t[pos] for t in rope)
        cos, sin = sets[id(rope)] if rope is not None else (None, None)
        x = blk(x, i, cache, 0, cos, sin, keys)
    return model.head(x.index_select(1, last))[0]


class PromptGraph:
    """One bucket's static inputs (n prompts of `rows` rows), captured forward and logits (n, V) fp32."""

    def __init__(self, model: Transformer, rows: int, n: int = 1):
        dev = model.token_embd.weight.device
        self.model, self.rows, self.n = model, rows, n
        self.tokens = torch.zeros(1, n * rows, dtype=torch.long, device=dev)
        self.pos = torch.arange(rows, dtype=torch.long, device=dev).repeat(n)
        self.slot = torch.zeros(n, dtype=torch.long, device=dev)
        self.last = torch.zeros(n, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def set(self, slot: int | list[int], ids: list[int] | list[list[int]], start: int | list[int]) -> None:
        """The inputs of prompts[i] at positions [starts[i], starts[i] + len) of slots[i] (one prompt: as
        they are); padding: id 0 at later positions, then copies of the last prompt."""
        one = isinstance(slot, int)
        slots, prompts, starts = ([slot], [ids], [start]) if one else (slot, ids, start)
        k, n, r = len(slots), self.n, self.rows
        slots, prompts, starts = (v + v[-1:] * (n - k) for v in (slots, prompts, starts))
        host = torch.zeros(2 * n + 2 * n * r, dtype=torch.long)
        host[:n] = torch.tensor(slots)
        host[n:2 * n] = torch.tensor([i * r + len(p) - 1 for i, p in enumerate(prompts)])
        for i, (p, st) in enumerate(zip(prompts, starts)):
            host[2 * n + i * r:2 * n + i * r + len(p)] = torch.tensor(p, dtype=torch.long)
            host[2 * n + n * r + i * r:2 * n + n * r + (i + 1) * r] = torch.arange(st, st + r)
        host = host.to(self.tokens.device)
        self.slot.copy_(host[:n])
        self.last.copy_(host[n:2 * n])
        self.tokens.copy_(host[2 * n:2 * n + n * r].view(1, -1))
        self.pos.copy_(host[2 * n + n * r:])

    def capture(self, slots: Slots, pool) -> None:
        """Run the forward (compiling and loading every kernel), then capture it, on the inputs set:
        both write only the rows the replay writes."""
        args = (self.model, slots, self.tokens, self.pos, self.slot, self.last)
        self.graph, self.logits = captured(lambda: padded_forward(*args), pool, device=self.tokens.device)


class PromptGraphs:
    """A Slots' prompt graphs by bucket, captured on first use (or by capture_all), in one memory pool:
    they never run at once, and each replay's logits are copied before the next. Kept in slots.tables
    and holding no reference to the Slots: through a cycle, a dropped Slots' graphs would wait for the
    cyclic garbage collector, which may run inside a later capture (torch.cuda.graph no longer collects
    before capturing) and free their memory there, invalidating that capture (seen on the GPU: a
    decode bucket's capture failed after tests that had dropped such Slots). The graphs write the cache
    the Slots held at their capture."""

    def __init__(self, model: Transformer, capacity: int):
        self.model, self.capacity = model, capacity
        self.graphs: dict[tuple[int, int], PromptGraph] = {}  # (prompts, rows each) -> graph
        self.pool = None  # torch.cuda.graph_pool_handle(), at the first capture
        # buckets whose capture ran out of memory (a graph's pool stays reserved, where the eager pass
        # reuses the allocator's cache): their prompts run eagerly
        self.failed: set[tuple[int, int]] = set()

    def takes(self, n: int, start: int) -> bool:
        b = bucket(n)
        return n > 0 and b is not None and start + b <= self.capacity and (1, b) not in self.failed

    def many_bucket(self, prompts: list[list[int]], starts: list[int], most: int) -> tuple[int, int] | None:
        """(prompts, rows each) of the graph taking these several prompts in one pass of at most `most`
        rows, or None (their pass runs eagerly; one prompt takes its own graph, run())."""
        if len(prompts) < 2:
            return None
        n, rows = prompts_bucket(len(prompts)), bucket(max(len(p) for p in prompts))
        if n is None or rows is None or rows < MANY_ROWS or n * rows > most or (n, rows) in self.failed:
            return None
        return (n, rows) if all(st + rows <= self.capacity for st in starts) else None

    def _ready(self, slots: Slots, key: tuple[int, int], slot, ids, start) -> PromptGraph | None:
        """The bucket's graph with these inputs set (captured now if new: on these very rows); None
        where the capture ran out of memory (the bucket then fails for good)."""
        g = self.graphs.get(key)
        if g is None:
            g = PromptGraph(self.model, key[1], key[0])
        g.set(slot, ids, start)
        if g.graph is None:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            try:
                g.capture(slots, self.pool)
            except RuntimeError as e:  # the allocator's, or the capture's end reporting it
                if not any(isinstance(x, torch.OutOfMemoryError) for x in (e, e.__context__)):
                    raise
                self.failed.add(key)
                return None
            self.graphs[key] = g
        return g

    @torch.inference_mode()
    def run(self, slots: Slots, slot: int, ids: list[int], start: int) -> torch.Tensor | None:
        """ids at positions [start, start + len) of `slot` (takes() true) -> the last id's logits (V,)
        fp32 (a copy: the next replay overwrites the graph's); None: no memory for the bucket's graph
        (the caller runs the eager pass, which rewrites every row this one wrote)."""
        g = self._ready(slots, (1, bucket(len(ids))), slot, ids, start)
        if g is None:
            return None
        g.graph.replay()
        return g.logits[0].clone()

    @torch.inference_mode()
    def run_many(self, slots: Slots, key: tuple[int, int], which: list[int], prompts: list[list[int]],
                 starts: list[int]) -> torch.Tensor | None:
        """Several prompts (many_bucket gave key) -> their last ids' logits (len, V) fp32 (a copy), or None
        as run()."""
        g = self._ready(slots, key, which, prompts, starts)
        if g is None:
            return None
        g.graph.replay()
        return g.logits[:len(which)].clone()

    @torch.inference_mode()
    def capture_all(self, slots: Slots, most: int) -> int:
        """Capture every bucket up to `most` ids that fits a slot -> graphs captured now. Writes padding
        rows into slot 0 from position 0 (its length unchanged: its first prompt overwrites them)."""
        before = len(self.graphs)
        for b in BUCKETS:
            if b <= max(most, 1) and b <= self.capacity and (1, b) not in self.failed:
                self._ready(slots, (1, b), 0, [0], 0)
        for n in PROMPTS:  # several prompts: copies of one prompt at slot 0
            for b in BUCKETS:
                if slots.n > 1 and prompts_bucket(min(n, slots.n)) == n and MANY_ROWS <= b <= self.capacity and n * b <= most and (n, b) not in self.failed:
                    self._ready(slots, (n, b), [0], [[0]], [0])
        return len(self.graphs) - before


def prompt_graphs(model: Transformer, slots: Slots) -> PromptGraphs | None:
    """The slots' PromptGraphs (kept in slots.tables), or None where the model is not covered."""
    if not covers(model):
        return None
    if "cuda prompts" not in slots.tables:
        slots.tables["cuda prompts"] = PromptGraphs(model, slots.capacity)
    return slots.tables["cuda prompts"]
