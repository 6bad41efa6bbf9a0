"""A naive reference of the slots API (Runtime.new_slots / prefill_slot / decode_slots / copy_prefix,
localllm/slots.py) for engine tests: each slot its own batch-1 KVCache, each row decoded alone, so
rows cannot interact. Used until the runtime's own implementation is merged, and as its oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FakeSlots:
    caches: list
    lengths: list[int]

    @property
    def cache(self):
        return self.caches[0]


class FakeSlotsRuntime:
    def __init__(self, rt):
        self.rt, self.model, self.device = rt, rt.model, rt.device

    def new_slots(self, n: int, capacity: int) -> FakeSlots:
        return FakeSlots([self.rt.new_cache(capacity) for _ in range(n)], [0] * n)

    def prefill_slot(self, slots: FakeSlots, slot: int, ids: list[int], start: int) -> torch.Tensor:
        cache = slots.caches[slot]
        logits = self.rt.prefill(cache, [ids], start)[0].clone()
        slots.lengths[slot] = cache.length = start + len(ids)
        return logits

    def decode_slots(self, slots: FakeSlots, which: list[int], tokens: torch.Tensor) -> torch.Tensor:
        rows = []
        for s, t in zip(which, tokens):
            cache = slots.caches[s]
            cache.length = slots.lengths[s]
            rows.append(self.rt.decode(cache, t.view(1))[0].clone())
            slots.lengths[s] += 1
        return torch.stack(rows)

    def copy_prefix(self, slots: FakeSlots, src: int, dst: int, n: int) -> None:
        a, b = slots.caches[src], slots.caches[dst]
        for x, y in ((a.k, b.k), (a.v, b.v)):
            for layer in range(len(x)):
                y[layer][:, :, :n] = x[layer][:, :, :n]
        slots.lengths[dst] = n
