"""Speculative decoding in `serve`'s continuous batching (engine.py's step; issue 22).

One round over the step's running slots: each slot drafts up to its K ids (prompt lookup per slot, or a
draft model's own slots, batched across slots with the draft runtime's decode_slots), the target
verifies every slot's last id + drafts in ONE Runtime.verify_slots pass, and each slot keeps its
accepted prefix + the target's id (speculative.verdict: greedy keeps exactly the target's argmax ids,
sampled requests keep the target's distribution), rolling back by setting its length. K per request
is speculative.AdaptiveK (complete's). Above ServeSettings.speculate_max_slots running slots the step
is plain decoding: a full batch already reads each weight once for many rows (engine.py decides).

Seeds: a sampled request draws its random numbers differently in a speculative round and in a plain
step, and which one a step is depends on how many requests run: with --draft / --lookup a seeded
sampled reply repeats itself under the same load only (greedy replies do not depend on it).

State: the target slot of a request holds seq[:-1] (seq = its prompt + emitted ids) before a round;
after it, seq[:-1] + the last id + the kept drafts. A draft model's slot s holds the ids `held[s]`; a
round first feeds it what it lacks of seq (the common prefix kept: the prefix cache's rows too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chat import common_prefix
from .draft import LookupDrafter, ModelDrafter, draft_sampler, lookup_ids
from .runtime import Runtime
from .sampling import Sampler, draw
from .settings import DraftSettings
from .slots import Slots
from .speculative import AdaptiveK, verdict

LONG_FEED = 8  # a draft slot lacking more ids than this (a new prompt) catches up by prefill_slots


@dataclass
class Draft:
    """One slot's round input: seq (its prompt + emitted ids), k (<= what its budget and rows allow),
    its sampler (None: greedy) and, for a draft model, its draft sampler."""

    slot: int
    seq: list[int]
    k: int
    history: torch.Tensor
    sampler: Sampler | None = None
    draft_sampler: Sampler | None = None


class Speculation:
    """The engine's drafter: lookup (ngram > 0) or a draft model's runtime with slots like the target's."""

    def __init__(self, drafter, settings: DraftSettings, max_slots: int, parallel: int, capacity: int):
        self.settings, self.max_slots = settings, max_slots
        self.cost = drafter.cost
        self.ngram = drafter.ngram if isinstance(drafter, LookupDrafter) else 0
        self.rt: Runtime | None = drafter.rt if isinstance(drafter, ModelDrafter) else None
        self.min_p = drafter.min_p if isinstance(drafter, ModelDrafter) else 0.0
        self.slots: Slots | None = self.rt.new_slots(parallel, capacity) if self.rt is not None else None
        self.held: list[list[int]] = [[] for _ in range(parallel)]  # ids in each draft slot's rows

    def schedule(self) -> AdaptiveK:
        ds = self.settings
        return AdaptiveK(self.cost, ds.most_k, ds.acceptance_memory, ds.start_acceptance, fixed=ds.max_draft)

    def draft_sampler(self, sampler: Sampler) -> Sampler | None:
        """A sampled request's draft-model sampler (draft.draft_sampler: its own random stream)."""
        if self.rt is None:
            return None
        return draft_sampler(sampler.settings, self.rt.device)

    def propose(self, items: list[Draft]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Each item's drafts and their distributions (n, V) (None: one-hot at the ids)."""
        if self.rt is None:
            return [(lookup_ids(torch.tensor(it.seq), self.ngram, it.k) if it.k > 0 else [], None) for it in items]
        return self.propose_model(items)

    @torch.inference_mode()
    def propose_model(self, items: list[Draft]) -> list[tuple[list[int], torch.Tensor | None]]:
        out: list[tuple[list[int], list]] = [([], []) for _ in items]
        live = [i for i, it in enumerate(items) if it.k > 0]
        if not live:
            return [([], None) for _ in items]
        logits = self.catch_up([items[i] for i in live])  # (len(live), V): after each seq's last id
        history = {i: items[i].history for i in live}
        for j in range(max(items[i].k for i in live)):
            going, tokens, rows = [], [], []
            for row, i in enumerate(live):
                it = items[i]
                sampler = it.draft_sampler
                if sampler is None or it.sampler is None:  # greedy: one-hot q
                    token, q = logits[row].argmax(), None
                else:
                    q = sampler.probs(logits[row], history[i])
                    token = draw(q, sampler.generator)
                if self.min_p and float(logits[row].softmax(-1)[token]) < self.min_p:
                    continue  # unsure: this slot drafts no more (draft.ModelDrafter's rule)
                tid = int(token)
                out[i][0].append(tid)
                if q is not None:
                    out[i][1].append(q)
                if j + 1 < it.k:  # the last draft is fed next round, with the target's own id after it
                    going.append(i)
                    tokens.append(tid)
                    rows.append(it.slot)
                    if q is not None:
                        history[i] = torch.cat((history[i], token.view(1)))
            if not going:
                break
            logits = self.rt.decode_slots(self.slots, rows, torch.tensor(tokens, dtype=torch.long, device=self.rt.device))
            for s, t in zip(rows, tokens):
                self.held[s].append(t)
            live = going
        return [(ids, torch.stack(qs) if qs else None) for ids, qs in out]

    def catch_up(self, items: list[Draft]) -> torch.Tensor:
        """Feed each draft slot the ids of seq it lacks (at least the last) -> logits (N, V) after each
        seq's last id: short feeds in one verify_slots pass (the last row of each taken), long ones (a
        new prompt) in one prefill_slots pass."""
        feeds = []
        for it in items:
            have = min(common_prefix(self.held[it.slot], it.seq), len(it.seq) - 1, self.slots.lengths[it.slot])
            self.slots.lengths[it.slot] = have
            feeds.append(it.seq[have:])
            self.held[it.slot] = list(it.seq)
        rows: dict[int, torch.Tensor] = {}
        short = [i for i, f in enumerate(feeds) if len(f) <= LONG_FEED]
        long = [i for i, f in enumerate(feeds) if len(f) > LONG_FEED]
        if short:
            flat = self.rt.verify_slots(self.slots, [items[i].slot for i in short], [feeds[i] for i in short])
            ends = torch.tensor([len(feeds[i]) for i in short]).cumsum(0) - 1
            for i, e in zip(short, ends.tolist()):
                rows[i] = flat[e]
        if long:
            last = self.rt.prefill_slots(self.slots, [items[i].slot for i in long], [feeds[i] for i in long],
                                         [self.slots.lengths[items[i].slot] for i in long])
            for n, i in enumerate(long):
                rows[i] = last[n]
        return torch.stack([rows[i] for i in range(len(items))])


def speculative_step(spec: Speculation, rt: Runtime, slots: Slots, items: list[Draft]) -> list[tuple[list[int], torch.Tensor, int]]:
    """One round over items (distinct slots, each target slot holding its seq[:-1]) -> per item (the new
    ids: kept drafts then the target's id; logits (len(new ids), V) of the target at each; drafted)."""
    drafts = spec.propose(items)
    which = [it.slot for it in items]
    start = [slots.lengths[s] for s in which]
    feeds = [it.seq[-1:] + d for it, (d, _) in zip(items, drafts)]
    if all(len(f) == 1 for f in feeds):  # no drafts at all: the plain step (the portable path's batch invariance)
        flat = rt.decode_slots(slots, which, torch.tensor([f[0] for f in feeds], dtype=torch.long, device=rt.device))
    else:
        flat = rt.verify_slots(slots, which, feeds)
    out, at = [], 0
    for it, (d, q), f, s0 in zip(items, drafts, feeds, start):
        logits = flat[at:at + len(f)]
        at += len(f)
        m, token = verdict(logits, d, q, it.sampler, it.history, it.sampler is None)
        slots.lengths[it.slot] = s0 + 1 + m  # the rows of rejected drafts are stale
        out.append((d[:m] + [token], logits[:m + 1], len(d)))
    return out


def speculative_round(eng, runs: list) -> None:
    """One speculative round over an Engine step's slots (runs: engine_requests.Running): each emits its
    kept drafts and the target's id, in order, until one of them finishes it."""
    items = []
    for r in runs:
        seq = eng.held[r.slot] + [r.next_id]  # the slot's rows hold seq[:-1]
        room = eng.capacity - len(seq)  # the round writes len(seq) - 1 + 1 + k rows
        k = max(0, min(r.schedule.k(), r.budget - 1, room))
        items.append(Draft(r.slot, seq, k, r.history, None if r.greedy else r.sampler, r.draft_sampler))
    results = speculative_step(eng.speculation, eng.runtime, eng.slots, items)
    eng.stats.steps += 1
    eng.stats.speculative_steps += 1
    for r, (new, logits, drafted) in zip(runs, results):
        eng.stats.decoded += len(new)
        eng.stats.drafted += drafted
        eng.stats.accepted += len(new) - 1
        r.schedule.update(drafted, len(new) - 1)
        eng.held[r.slot] += [r.next_id] + new[:-1]  # the rows kept: the last id, the kept drafts
        for i, token in enumerate(new):
            eng.take(r, token, logits[i])
            if eng.running_in(r.slot) is not r:
                break  # finished (a stop id, its budget): the ids after it are not emitted
