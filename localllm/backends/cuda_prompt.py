"""One prompt into one slot as a replayed CUDA graph, by padded length (issue 22: `serve`'s time to
first token on CUDA).

An eager prompt pass launches ~15 kernels a layer from Python and is bound by the host (a 128-id
prompt of an 8B model: 24-58 ms of host time on an H100 for ~10 ms of GPU work). Replayed, one client's
first token of such a prompt came in half the time on an H200 (docs/PERFORMANCE.md, tenth session).
Here a prompt of T ids at positions [start, start + T) of slot s runs a graph captured for a bucket
Tb >= T (BUCKETS), whose inputs are device buffers: the ids (padded with id 0), each row's position
(start + t: the padding rows continue past the prompt), the slot and the last real row. So a graph
serves any start, slot and T of its bucket; what varies lives in those buffers.

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


def bucket(t: int) -> int | None:
    """The smallest bucket holding t ids; None past the largest."""
    return next((b for b in BUCKETS if b >= t), None)


def covers(model: Transformer) -> bool:
    cfg = model.cfg
    return model.tp is None and not any(cfg.sliding_layers) and not cfg.per_layer_dim


def padded_forward(model: Transformer, slots: Slots, tokens: torch.Tensor, pos: torch.Tensor,
                   slot: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """tokens (1, Tb) at positions pos (Tb,) of the slot held by slot (1,) -> the logits (V,) fp32 of row
    last (1,); writes each row's k, v at (slot, pos). Every shape is Tb's and the slots' (no host value
    enters: the graph's forward)."""
    rows = tokens.shape[1]
    x = model.embed(tokens)
    cache = SegmentCache(slots.cache, slot.expand(rows), pos)
    keys = SlotMaskKeys(slot, torch.arange(slots.capacity, device=pos.device)[None, :] <= pos[:, None])
    sets: dict[int, tuple] = {}  # a rope set's rows, shared by the layers sharing the set
    for i, (blk, rope) in enumerate(zip(model.blk, slot_ropes(model, slots))):
        if rope is not None and id(rope) not in sets:
            sets[id(rope)] = tuple(t[pos] for t in rope)
        cos, sin = sets[id(rope)] if rope is not None else (None, None)
        x = blk(x, i, cache, 0, cos, sin, keys)
    return model.head(x.index_select(1, last))[0, 0]


class PromptGraph:
    """One bucket's static inputs, captured forward and logits (V,) fp32."""

    def __init__(self, model: Transformer, rows: int):
        dev = model.token_embd.weight.device
        self.model, self.rows = model, rows
        self.tokens = torch.zeros(1, rows, dtype=torch.long, device=dev)
        self.pos = torch.arange(rows, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def set(self, slot: int, ids: list[int], start: int) -> None:
        """The inputs of ids at positions [start, start + len) of `slot` (padding: id 0, later positions)."""
        n = len(ids)
        host = torch.zeros(2 + self.rows, dtype=torch.long)
        host[0], host[1], host[2:2 + n] = slot, n - 1, torch.tensor(ids, dtype=torch.long)
        host = host.to(self.tokens.device)
        self.slot.copy_(host[:1])
        self.last.copy_(host[1:2])
        self.tokens.copy_(host[2:].view(1, -1))
        torch.arange(start, start + self.rows, out=self.pos)

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
        self.graphs: dict[int, PromptGraph] = {}
        self.pool = None  # torch.cuda.graph_pool_handle(), at the first capture
        # buckets whose capture ran out of memory (a graph's pool stays reserved, where the eager pass
        # reuses the allocator's cache): their prompts run eagerly
        self.failed: set[int] = set()

    def takes(self, n: int, start: int) -> bool:
        b = bucket(n)
        return n > 0 and b is not None and start + b <= self.capacity and b not in self.failed

    def _ready(self, slots: Slots, rows: int, slot: int, ids: list[int], start: int) -> PromptGraph | None:
        """The bucket's graph with these inputs set (captured now if new: on these very rows); None
        where the capture ran out of memory (the bucket then fails for good)."""
        g = self.graphs.get(rows)
        if g is None:
            g = PromptGraph(self.model, rows)
        g.set(slot, ids, start)
        if g.graph is None:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            try:
                g.capture(slots, self.pool)
            except RuntimeError as e:  # the allocator's, or the capture's end reporting it
                if not any(isinstance(x, torch.OutOfMemoryError) for x in (e, e.__context__)):
                    raise
                self.failed.add(rows)
                return None
            self.graphs[rows] = g
        return g

    @torch.inference_mode()
    def run(self, slots: Slots, slot: int, ids: list[int], start: int) -> torch.Tensor | None:
        """ids at positions [start, start + len) of `slot` (takes() true) -> the last id's logits (V,)
        fp32 (a copy: the next replay overwrites the graph's); None: no memory for the bucket's graph
        (the caller runs the eager pass, which rewrites every row this one wrote)."""
        g = self._ready(slots, bucket(len(ids)), slot, ids, start)
        if g is None:
            return None
        g.graph.replay()
        return g.logits.clone()

    @torch.inference_mode()
    def capture_all(self, slots: Slots, most: int) -> int:
        """Capture every bucket up to `most` ids that fits a slot -> graphs captured now. Writes padding
        rows into slot 0 from position 0 (its length unchanged: its first prompt overwrites them)."""
        before = len(self.graphs)
        for b in BUCKETS:
            if b <= max(most, 1) and b <= self.capacity and b not in self.failed:
                self._ready(slots, b, 0, [0], 0)
        return len(self.graphs) - before


def prompt_graphs(model: Transformer, slots: Slots) -> PromptGraphs | None:
    """The slots' PromptGraphs (kept in slots.tables), or None where the model is not covered."""
    if not covers(model):
        return None
    if "cuda prompts" not in slots.tables:
        slots.tables["cuda prompts"] = PromptGraphs(model, slots.capacity)
    return slots.tables["cuda prompts"]
