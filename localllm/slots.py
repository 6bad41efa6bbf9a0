"""Many sequences in one KV cache ("slots"), each at its own position: the runtime API under `serve`'s
continuous batching (issue 22). The scheduler prefills a request into a free slot, then runs one
decode_slots step over every active slot; a slot's rows [0, length) can serve a later request with the
same prefix (prefill_slot's start), and rolling back is setting its length lower (as KVCache.length).
prefill_slots prefills several slots' prompts in one forward (the engine's admissions: each weight read
once for all of them), each prompt as prefill_slot would alone.

These are the portable implementations (Runtime's methods call them; backends override them for speed,
computing the same: backends/cpu.py). Shapes: n slots, S capacity, N rows of a step, V vocabulary.

Batch invariance: a slot's logits from decode_slots do not depend on which other slots share the step
(16 concurrent greedy streams must each equal the same request served alone). Every row of a step
therefore sees the same arithmetic whatever the others are: the step always computes all n rows (the
rows of slots not in the step are padding: token 0 at position 0, no cache write, no attention), so
every product and elementwise op has the same shape each step (torch's GEMMs round a row differently
for another number of rows: measured on this CPU for every shape tried); attention runs per row over
that slot's own keys (attention.RowKeys); rope rows come from one table per capacity (slot_ropes). A
mixture of experts groups rows by expert, so its invariance also needs row-independent products (the
CPU's C++ products are; torch's GEMM on the expert groups is not). The CPU backend runs the step in one
C++ call (backends/cpu.py CpuRuntime.decode_slots: each row the bits of its one-token step alone).

CUDA: backends/cuda_slots.py runs the step as one replayed graph per bucket of slot counts (the graph
decoder's kernels reading each row's position and slot from device tensors; padding rows repeat row
0); prefill_slot on CUDA runs eagerly (a slot view is a new cache to PrefillGraph each call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import RowKeys, SegmentKeys
from .cache import KVCache
from .errors import LocalLLMError
from .rope import layer_ropes


@dataclass
class Slots:
    """The KV cache of n independent sequences, preallocated."""

    cache: KVCache  # batch = n, capacity = S (make_cache / Runtime.new_cache layout)
    lengths: list[int]  # valid positions of each slot (its next token goes at lengths[s])
    # rope rows of positions [0, S) per layer, computed once (slot_ropes); backends may keep theirs here
    tables: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.cache.capacity


def new_slots(cache: KVCache) -> Slots:
    """Slots over a fresh cache of batch n (Runtime.new_slots makes it)."""
    n = (cache.k[0] if isinstance(cache.k, list) else cache.k[0]).shape[0]
    return Slots(cache, [0] * n)


def slot_view(cache: KVCache, slot: int, length: int = 0) -> KVCache:
    """A batch-1 KVCache viewing one slot's rows of every layer (writes go to the slots' cache)."""
    if isinstance(cache.k, list):  # per-layer buffers; a KV-shared layer's view views its source's memory
        return KVCache([t[slot:slot + 1] for t in cache.k], [t[slot:slot + 1] for t in cache.v], length)
    return KVCache(cache.k[:, slot:slot + 1], cache.v[:, slot:slot + 1], length)


def check_slot(slots: Slots, slot: int) -> None:
    if not 0 <= slot < slots.n:
        raise LocalLLMError(f"slot {slot} does not exist (there are {slots.n})")


def check_prefill(slots: Slots, slot: int, ids: list[int], start: int) -> None:
    check_slot(slots, slot)
    if not ids:
        raise LocalLLMError("prefill_slot needs at least one token")
    if not 0 <= start <= slots.lengths[slot]:
        raise LocalLLMError(f"prefill of slot {slot} from position {start}: it holds {slots.lengths[slot]}")
    if start + len(ids) > slots.capacity:
        raise LocalLLMError(f"prompt of {start + len(ids)} tokens is longer than the context ({slots.capacity})")


def check_prefills(slots: Slots, which: list[int], prompts: list[list[int]], starts: list[int]) -> None:
    if not len(which) == len(prompts) == len(starts) or not which:
        raise LocalLLMError(f"prefill_slots takes one prompt and start per slot: {len(which)} slots, "
                            f"{len(prompts)} prompts, {len(starts)} starts")
    if len(set(which)) != len(which):
        raise LocalLLMError(f"prefill_slots takes distinct slots, got {which}")
    for s, ids, start in zip(which, prompts, starts):
        check_prefill(slots, s, ids, start)


def check_rows(slots: Slots, which: list[int], tokens: torch.Tensor) -> None:
    for s in which:
        check_slot(slots, s)
        if slots.lengths[s] >= slots.capacity:
            raise LocalLLMError(f"slot {s} is full: {slots.lengths[s]} of {slots.capacity} positions")
    if len(set(which)) != len(which):
        raise LocalLLMError(f"decode_slots takes distinct slots, got {which}")
    if tokens.numel() != len(which):
        raise LocalLLMError(f"decode_slots: {tokens.numel()} tokens for {len(which)} slots")


def copy_prefix(slots: Slots, src: int, dst: int, n: int) -> None:
    """Rows [0, n) of slot src into slot dst (every layer); dst then holds n positions."""
    check_slot(slots, src)
    check_slot(slots, dst)
    if not 0 <= n <= slots.lengths[src]:
        raise LocalLLMError(f"copy of {n} rows from slot {src}, which holds {slots.lengths[src]}")
    cache = slots.cache
    if isinstance(cache.k, list):
        for t in {id(t): t for t in [*cache.k, *cache.v]}.values():  # a shared layer's buffer once
            t[dst, :, :n] = t[src, :, :n]
    else:
        for t in (cache.k, cache.v):
            t[:, dst, :, :n] = t[:, src, :, :n]
    slots.lengths[dst] = n


class ScatterCache:
    """The cache a slots step hands the layers (project_qkv's writes and reads): row m of the step's
    k, v, as step_rows gives them (M, Hkv, D), goes to slot slot_of[m] at position pos[m] (M,) of the
    layer's buffers; reads return the layer's whole buffers, which RowKeys / SegmentKeys slice."""

    def __init__(self, cache: KVCache, slot_of: torch.Tensor, pos: torch.Tensor):
        self.cache, self.slot_of, self.pos = cache, slot_of, pos

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def rows(self, layer: int, end: int):
        return self.cache.k[layer], self.cache.v[layer]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slot_of, :, self.pos] = self.step_rows(k).to(kc.dtype)  # (M, Hkv, D) at (slot, :, position)
        vc[self.slot_of, :, self.pos] = self.step_rows(v).to(vc.dtype)
        return kc, vc


class RowCache(ScatterCache):
    """A decode_slots step's: row b of k, v (N, Hkv, 1, D) goes to slot slots[b] at position
    positions[b] (padding rows past len(slots) are not written)."""

    def __init__(self, cache: KVCache, slots: list[int], positions: list[int]):
        device = (cache.k[0]).device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        super().__init__(cache, index, torch.tensor(positions, dtype=torch.long, device=device))

    def step_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[: self.slot_of.shape[0], :, 0]  # (N, Hkv, 1, D) -> (b, Hkv, D)


class SegmentCache(ScatterCache):
    """A prefill_slots step's: row t of k, v (1, Hkv, T, D) goes to slot slot_of[t] at position pos[t]
    (T,)."""

    def step_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[0].transpose(0, 1)  # (1, Hkv, T, D) -> (T, Hkv, D)


def slot_ropes(model, slots: Slots) -> list:
    """Per layer (cos, sin) (S, R/2) of its rope set for positions [0, S), or None (a NoPE layer);
    computed once per Slots (a position's row is then the same in every step, whatever the batch)."""
    if "ropes" not in slots.tables:
        S, device = slots.capacity, model.token_embd.weight.device
        slots.tables["ropes"] = layer_ropes(model.cfg, torch.arange(S, device=device), model.rope_divisors(S))
    return slots.tables["ropes"]


@torch.inference_mode()
def decode_slots(model, slots: Slots, which: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """tokens (N,) long, one per slot of `which` (distinct), each at position lengths[s] -> logits (N, V)
    fp32; then lengths[s] += 1. One forward over all n rows (model.Transformer.forward's loop, with
    per-row rope rows, cache writes (RowCache) and attention (RowKeys))."""
    check_rows(slots, which, tokens)
    cfg, n, N = model.cfg, slots.n, len(which)
    device = model.token_embd.weight.device
    positions = [slots.lengths[s] for s in which]
    full = torch.zeros(n, 1, dtype=torch.long, device=device)  # padding rows: token 0 at position 0
    full[:N, 0] = tokens.view(-1).to(device)
    pos = torch.zeros(n, dtype=torch.long, device=device)
    pos[:N] = torch.tensor(positions, dtype=torch.long, device=device)
    x = model.embed(full)
    ple = model.per_layer_inputs(full, x)
    cache = RowCache(slots.cache, which, positions)
    ends = [p + 1 for p in positions]
    full_keys = RowKeys(which, ends, None)
    window = RowKeys(which, ends, cfg.sliding_window) if cfg.sliding_layers else None
    rows: dict[int, tuple] = {}  # a rope set's rows for this step, shared by the layers sharing the set
    for i, (blk, rope) in enumerate(zip(model.blk, slot_ropes(model, slots))):
        if rope is not None and id(rope) not in rows:
            rows[id(rope)] = tuple(t[pos].view(n, 1, 1, -1) for t in rope)  # (n, 1, 1, R/2): q (n, H, 1, D)
        cos, sin = rows[id(rope)] if rope is not None else (None, None)
        keys = window if window is not None and cfg.sliding(i) else full_keys
        per_layer = None if ple is None else ple[:, :, i]
        x = blk(x, i, cache, 0, cos, sin, keys, per_layer)
    logits = model.head(x)[:N, 0]
    for s in which:
        slots.lengths[s] += 1
    return logits


@torch.inference_mode()
def prefill_slots(model, slots: Slots, which: list[int], prompts: list[list[int]], starts: list[int],
                  every: bool = False) -> torch.Tensor:
    """prompts[i] at positions [starts[i], starts[i] + len) of slot which[i] (distinct; rows [0, start)
    kept) -> logits (N, V) fp32 of each prompt's last id; then lengths[s] = start + len. One forward of
    batch 1 over the T = sum(len) rows, the prompts concatenated (each product reads its weight once for
    all of them): per-row rope rows and cache writes (SegmentCache), attention per prompt over its own
    slot's keys, causal within that prompt only (SegmentKeys). A prompt's rows see the arithmetic of its
    prefill alone (prefill_slot) except the products' row count: bit-equal where the products are
    row-independent (the CPU's C++ products), within rounding where they are not (torch's GEMMs).
    every: the logits of every row instead (sum(len), V), each prompt's rows in order (verify_slots)."""
    check_prefills(slots, which, prompts, starts)
    cfg, device = model.cfg, model.token_embd.weight.device
    lengths = [len(p) for p in prompts]
    tokens = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)  # (1, T)
    slot_of = torch.tensor([s for s, n in zip(which, lengths) for _ in range(n)], dtype=torch.long, device=device)
    pos = torch.tensor([p for st, n in zip(starts, lengths) for p in range(st, st + n)], dtype=torch.long,
                       device=device)
    x = model.embed(tokens)
    ple = model.per_layer_inputs(tokens, x)
    cache = SegmentCache(slots.cache, slot_of, pos)
    full = SegmentKeys(which, starts, lengths, None)
    window = SegmentKeys(which, starts, lengths, cfg.sliding_window) if cfg.sliding_layers else None
    rows: dict[int, tuple] = {}  # a rope set's rows (T, R/2), shared by the layers sharing the set
    for i, (blk, rope) in enumerate(zip(model.blk, slot_ropes(model, slots))):
        if rope is not None and id(rope) not in rows:
            rows[id(rope)] = tuple(t[pos] for t in rope)
        cos, sin = rows[id(rope)] if rope is not None else (None, None)
        keys = window if window is not None and cfg.sliding(i) else full
        x = blk(x, i, cache, 0, cos, sin, keys, None if ple is None else ple[:, :, i])
    if every:
        logits = model.head(x)[0].float()
    else:
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        logits = model.head(x[:, last])[0].float()
    for s, st, n in zip(which, starts, lengths):
        slots.lengths[s] = st + n
    return logits


def check_verify(slots: Slots, which: list[int], rows: list[list[int]]) -> None:
    check_prefills(slots, which, rows, [slots.lengths[s] for s in which])


@torch.inference_mode()
def verify_slots(model, slots: Slots, which: list[int], rows: list[list[int]]) -> torch.Tensor:
    """Several ids per slot (speculative decoding's verify pass in `serve`: the last emitted id and the
    drafts): rows[i] at positions [lengths[s], lengths[s] + len) of slot s = which[i] (distinct) ->
    logits (sum(len), V) fp32, slot which[0]'s rows first, each slot's in order; then lengths[s] += len.
    The portable pass is prefill_slots' (each weight read once for all rows): a row equals decode_slots'
    up to the products' rounding for another row count (backends/cpu.py's C++ rows: the same bits)."""
    check_verify(slots, which, rows)
    return prefill_slots(model, slots, which, rows, [slots.lengths[s] for s in which], every=True)
