"""Continuous batching: many requests share each decode step of one model (the server's scheduler).

A background thread loops: admit waiting requests into free slots (their prompts prefilled together in
one Runtime.prefill_slots pass, up to ServeSettings.prefill_tokens ids a step, a longer prompt in parts
over several steps; sample each first id), then one Runtime.decode_slots over every active slot (each at
its own position, its own cache rows), sample each row with its request's own Sampler, emit events, and
free the slots of finished requests. Requests, events, handles: engine_requests.py.
New requests join between steps; finished ones leave. No HTTP here: localllm/server/ drives it.
With a Speculation (--draft / --lookup) and few running slots, a step is a speculative round instead
(engine_spec.py): several ids per slot, verified in one Runtime.verify_slots pass.

Prefix cache: each slot keeps the ids its rows hold after its last request. A new prompt goes to the
free slot sharing the longest prefix with it and only the rest is prefilled; when a busy slot shares a
longer prefix (the same system prompt, sent by several clients at once), its rows are copied first; a
prompt sharing a longer prefix with another of the same prefill pass waits for a second pass to copy it.

Determinism: each request samples with its own torch.Generator seeded from its seed, and decode_slots
is batch-invariant (a row's logits do not depend on the other rows), so a seeded request repeats its
output whatever else runs beside it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .chat import common_prefix
from .engine_spec import Draft, Speculation, speculative_step
from .engine_requests import EngineStopped, Event, Handle, QueueFull, Request, Sink, error_message
from .errors import LocalLLMError
from .generate import token_budget
from .nonfinite import check_logits
from .runtime import Runtime
from .sampling import Sampler, is_plain_greedy
from .speculative import AdaptiveK
from .settings import DEFAULT_SERVE

# DEBUG: one line per prefill pass (`localllm serve --log-level debug`): its prompts, ids and time to
# their first ids, and how long ago each of its requests was submitted (issue 22's TTFT stalls)
log = logging.getLogger("localllm.engine")


def check_fits(prompt_len: int, capacity: int) -> None:
    """A prompt needs its ids and one more row for the reply (generate.check_fits's rule, per slot)."""
    if prompt_len == 0:
        raise LocalLLMError("the prompt is empty (no tokens to start from)")
    if prompt_len >= capacity:
        raise LocalLLMError(f"the prompt is {prompt_len} tokens but the context holds {capacity}"
                            f" (one more is needed for the reply)")


@dataclass
class _Running:
    handle: Handle
    slot: int
    sampler: Sampler
    greedy: bool
    budget: int  # ids it may still produce
    history: torch.Tensor  # prompt + generated ids (the repeat penalty's window)
    next_id: int = -1  # the last sampled id, fed to the next decode step
    filled: int = 0  # prompt ids in the slot's rows; it joins the decode steps once the prompt is whole
    schedule: AdaptiveK | None = None  # speculative decoding's K (engine_spec.py), when it drafts
    draft_sampler: Sampler | None = None  # a sampled request's draft-model sampler


@dataclass
class EngineStats:
    steps: int = 0  # decode steps run
    decoded: int = 0  # rows decoded over all steps
    prefilled: int = 0  # prompt ids prefilled
    prefill_passes: int = 0  # prefill passes run (each one prefill_slot or prefill_slots call)
    slowest_prefill: float = 0.0  # seconds of the slowest pass, to its first ids (host-synced by sampling)
    reused: int = 0  # prompt ids taken from the prefix cache instead
    cancelled: int = 0  # requests ended by cancel() (their clients left) or by shutdown
    speculative_steps: int = 0  # steps run as speculative rounds (engine_spec.py)
    drafted: int = 0  # ids drafted over those steps
    accepted: int = 0  # drafts the target kept


@dataclass
class Engine:
    runtime: Runtime
    stop_ids: frozenset[int]
    parallel: int
    capacity: int  # KV rows of each slot (the per-sequence context)
    max_queue: int = 64
    prefill_tokens: int = DEFAULT_SERVE.prefill_tokens  # prompt ids prefilled per step
    share_min: int = DEFAULT_SERVE.prefill_share_min
    speculation: Speculation | None = None  # --draft / --lookup: speculative rounds (engine_spec.py)
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self):
        if self.parallel < 1:
            raise LocalLLMError(f"--parallel must be at least 1, got {self.parallel}")
        if self.prefill_tokens < 1:
            raise LocalLLMError(f"prefill_tokens must be at least 1, got {self.prefill_tokens}")
        self.slots = self.runtime.new_slots(self.parallel, self.capacity)
        self.held: list[list[int]] = [[] for _ in range(self.parallel)]  # ids in each slot's rows [0, len)
        self.last_used = [0] * self.parallel  # admission counter of each slot's last request (LRU)
        self._admitted = 0
        self._waiting: list[Handle] = []
        self._admitting: list[Handle] = []  # taken from the queue, being prefilled
        self._running: dict[int, _Running] = {}  # slot -> its request
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the caller's side (any thread) ---------------------------------------------------------

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="localllm-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Request, sink: Sink | None = None) -> Handle:
        """Queue a request -> its Handle. Raises LocalLLMError when the prompt does not fit a slot,
        QueueFull when the queue is full, EngineStopped during shutdown."""
        check_fits(len(request.prompt), self.capacity)
        handle = Handle(request, sink)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            # a place in a slot or in the queue: counted together, so that requests arriving while the
            # engine thread is busy (a prefill) are not refused with slots about to be free
            if len(self._running) + len(self._admitting) + len(self._waiting) >= self.parallel + self.max_queue:
                raise QueueFull(f"all {self.parallel} slots are busy and {len(self._waiting)} requests wait")
            self._waiting.append(handle)
            self._cv.notify()
        return handle

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"slots_idle": self.parallel - len(self._running), "slots_processing": len(self._running),
                    "queued": len(self._waiting) + len(self._admitting)}

    def stop(self) -> None:
        """Begin shutdown: no new requests; running and waiting ones end with finish "cancelled" at the
        next step. Safe from a signal handler (no waiting here); join() waits for the thread."""
        self._stopping = True
        if self._cv.acquire(blocking=False):
            self._cv.notify()
            self._cv.release()

    def join(self, timeout: float | None = None) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._waiting and not self._running and not self._stopping:
                        self._cv.wait(timeout=1.0)  # stop() from a signal handler may not notify
                    if self._stopping:
                        break
                    gone = [h for h in self._waiting if h.cancelled]  # their clients left while they waited
                    self._waiting = [h for h in self._waiting if not h.cancelled]
                self.stats.cancelled += len(gone)
                for handle in gone:
                    handle.emit(Event(finish="cancelled"))
                with self._cv:
                    while self._waiting and len(self._running) + len(self._admitting) < self.parallel:
                        self._admitting.append(self._waiting.pop(0))
                if self._admitting or any(r.filled < len(r.handle.request.prompt) for r in self._running.values()):
                    self._admit_waiting()
                self._drop_cancelled()
                if self._running:
                    self._guarded(self._step, None)
        with self._cv:
            left, self._waiting = self._admitting + self._waiting, []
        for handle in left:
            handle.emit(Event(finish="cancelled", message="the server is shutting down"))
        for slot in list(self._running):
            self._finish(slot, Event(finish="cancelled", message="the server is shutting down"))

    def _guarded(self, fn, handle: Handle | None) -> None:
        """A failure ends the requests it touched ("error" events), never the engine."""
        try:
            fn(handle) if handle is not None else fn()
        except Exception as e:  # noqa: BLE001 -- one bad request must not take the server down
            message = error_message(e)
            if handle is not None:
                slot = next((s for s, r in self._running.items() if r.handle is handle), None)
                if slot is not None:
                    self._finish(slot, Event(finish="error", message=message))
                else:
                    handle.emit(Event(finish="error", message=message))
            else:
                for slot in list(self._running):
                    self._finish(slot, Event(finish="error", message=message))

    def _pick_slot(self, prompt: list[int]) -> tuple[int, int, int]:
        """(free slot, ids of the prompt its rows will hold, busy slot to copy them from or -1): the free
        slot with the longest common prefix, the least recently used on a tie; rows of a busy slot that
        shares more, copied by _place. Changes nothing."""
        free = [s for s in range(self.parallel) if s not in self._running]
        slot = max(free, key=lambda s: (common_prefix(self.held[s], prompt), -self.last_used[s]))
        have = common_prefix(self.held[slot], prompt)
        busy = [(common_prefix(self.held[s][: self.slots.lengths[s]], prompt), s) for s in self._running]
        best, src = max(busy, default=(0, -1))
        if best > have:
            return min(free, key=lambda s: self.last_used[s]), best, src  # keep the other free slots' prefixes
        return slot, have, -1

    def _admit_waiting(self) -> None:
        """Prefill at most prefill_tokens prompt ids this step, several prompts in one prefill_slots pass:
        first the next part of prompts already partly in their slots, then requests taken from the queue
        (_admitting); a prompt longer than what is left runs in parts over the next steps (its slot is
        taken, it joins the decode steps once whole). Requests left over go back to the queue's front. A
        prompt sharing share_min ids more with one of the pass than it has waits for a second pass, from
        that one's rows (_pick_slot copies them)."""
        budget = self.prefill_tokens
        batch: list[tuple[_Running, int, int]] = []  # (request, first position of this part, its ids)
        for run in self._running.values():
            rest = len(run.handle.request.prompt) - run.filled
            if rest and budget > 0:
                batch.append((run, run.filled, min(rest, budget)))
                budget -= batch[-1][2]
        pending = list(self._admitting)
        while True:
            later = []
            for handle in pending:
                if handle.cancelled:
                    with self._cv:
                        self._admitting.remove(handle)
                    self.stats.cancelled += 1
                    handle.emit(Event(finish="cancelled"))
                    continue
                prompt = handle.request.prompt
                if budget <= 0:
                    later.append(handle)
                    continue
                slot, have, src = self._pick_slot(prompt)
                reuse = min(have, len(prompt) - 1)  # at least one id runs: its logits give the first new id
                shared = max((common_prefix(prompt, r.handle.request.prompt) for r, _, _ in batch), default=0)
                if shared - reuse >= self.share_min:
                    later.append(handle)
                    continue
                try:
                    run = self._place(handle, slot, have, src, reuse)
                except Exception as e:  # noqa: BLE001 -- that request ends, the others go on
                    with self._cv:
                        self._admitting.remove(handle)
                    handle.emit(Event(finish="error", message=error_message(e)))
                    continue
                batch.append((run, reuse, min(len(prompt) - reuse, budget)))
                budget -= batch[-1][2]
            if batch:
                self._prefill(batch)
            batch, pending = [], later
            if not pending or budget <= 0:
                break
        with self._cv:  # not admitted this step: first in line for the next
            for handle in pending:
                self._admitting.remove(handle)
            self._waiting[:0] = pending

    def _place(self, handle: Handle, slot: int, have: int, src: int, reuse: int) -> _Running:
        """The request into its slot (the shared prefix's rows copied from slot src first, if any; its
        first `reuse` prompt ids kept): from admitting to running."""
        req = handle.request
        if src >= 0:
            self.runtime.copy_prefix(self.slots, src, slot, have)
        self._admitted += 1
        self.last_used[slot] = self._admitted
        self.held[slot] = []  # until the prefill has written the rows
        sampler = Sampler(req.sampling, self.runtime.device)
        budget, _ = token_budget(req.max_tokens, len(req.prompt), self.capacity)
        run = _Running(handle, slot, sampler, is_plain_greedy(sampler), budget,
                       torch.tensor(req.prompt, dtype=torch.long, device=self.runtime.device), filled=reuse)
        if self.speculation is not None:
            run.schedule = self.speculation.schedule()
            run.draft_sampler = None if run.greedy else self.speculation.draft_sampler(sampler)
        self.stats.reused += reuse
        with self._cv:  # from admitting to running in one move (submit counts both)
            self._admitting.remove(handle)
            self._running[slot] = run
        return run

    def _prefill(self, batch: list[tuple[_Running, int, int]]) -> None:
        """One pass over the batch's prompt parts, then the first id of each prompt now whole. A failure
        of the pass ends the batch's requests, one of a request's sampling that request ("error")."""
        which = [r.slot for r, _, _ in batch]
        prompts = [r.handle.request.prompt[start:start + n] for r, start, n in batch]
        starts = [start for _, start, _ in batch]
        self.stats.prefill_passes += 1
        began = time.perf_counter()
        try:
            if len(batch) == 1:  # a backend's own single-prompt path (CUDA's), the same logits
                logits = self.runtime.prefill_slot(self.slots, which[0], prompts[0], starts[0])[None]
            else:
                logits = self.runtime.prefill_slots(self.slots, which, prompts, starts)
        except Exception as e:  # noqa: BLE001 -- the batch's requests end, the engine goes on
            for run, _, _ in batch:
                self._finish(run.slot, Event(finish="error", message=error_message(e)))
            return
        for i, (run, start, n) in enumerate(batch):
            prompt = run.handle.request.prompt
            run.filled = start + n
            self.held[run.slot] = list(prompt[:run.filled])
            self.stats.prefilled += n
            if run.filled == len(prompt):
                self._guarded(lambda _h, run=run, row=logits[i]: self._first(run, row), run.handle)
        self._timed(batch, began)

    def _timed(self, batch: list[tuple[_Running, int, int]], began: float) -> None:
        """The pass's time (its first ids sampled: a host sync) into stats; its DEBUG line."""
        took = time.perf_counter() - began
        self.stats.slowest_prefill = max(self.stats.slowest_prefill, took)
        if log.isEnabledFor(logging.DEBUG):
            waits = ", ".join(f"{1e3 * (began - r.handle.queued_at):.0f}" for r, _, _ in batch)
            log.debug("prefill pass: %d prompts, %d ids (parts %s), %.1f ms to the first ids; submitted ms ago: [%s]",
                      len(batch), sum(n for _, _, n in batch), [n for _, _, n in batch], 1e3 * took, waits)

    def _first(self, run: _Running, logits: torch.Tensor) -> None:
        check_logits(self.runtime.model, logits)
        token = logits.argmax() if run.greedy else run.sampler(logits, run.history)
        self._take(run, int(token), logits)

    def _step(self) -> None:
        runs = [r for r in self._running.values() if r.filled == len(r.handle.request.prompt)]
        if not runs:  # every running prompt is still being prefilled
            return
        if self.speculation is not None and len(runs) <= self.speculation.max_slots:
            self._speculative_step(runs)
            return
        which = [r.slot for r in runs]
        tokens = torch.tensor([r.next_id for r in runs], dtype=torch.long, device=self.runtime.device)
        logits = self.runtime.decode_slots(self.slots, which, tokens)  # (B, V)
        self.stats.steps += 1
        self.stats.decoded += len(runs)
        for r in runs:
            self.held[r.slot].append(r.next_id)
        greedy = logits.argmax(-1)
        if all(r.greedy for r in runs):  # the common case: no per-row tensors to stack
            ids = greedy.tolist()  # the one host sync of the step
        else:
            picked = [greedy[i] if r.greedy else r.sampler(logits[i], r.history) for i, r in enumerate(runs)]
            ids = torch.stack(picked).tolist()  # the one host sync of the step
        for i, r in enumerate(runs):
            self._take(r, ids[i], logits[i])

    def _speculative_step(self, runs: list[_Running]) -> None:
        """One speculative round over the step's slots (engine_spec.py): each emits its kept drafts and
        the target's id, in order, until one of them finishes it."""
        items = []
        for r in runs:
            seq = self.held[r.slot] + [r.next_id]  # the slot's rows hold seq[:-1]
            room = self.capacity - len(seq)  # the round writes len(seq) - 1 + 1 + k rows
            k = max(0, min(r.schedule.k(), r.budget - 1, room))
            items.append(Draft(r.slot, seq, k, r.history, None if r.greedy else r.sampler, r.draft_sampler))
        results = speculative_step(self.speculation, self.runtime, self.slots, items)
        self.stats.steps += 1
        self.stats.speculative_steps += 1
        for r, (new, logits, drafted) in zip(runs, results):
            self.stats.decoded += len(new)
            self.stats.drafted += drafted
            self.stats.accepted += len(new) - 1
            r.schedule.update(drafted, len(new) - 1)
            self.held[r.slot] += [r.next_id] + new[:-1]  # the rows kept: the last id, the kept drafts
            for i, token in enumerate(new):
                self._take(r, token, logits[i])
                if r.slot not in self._running or self._running[r.slot] is not r:
                    break  # finished (a stop id, its budget): the ids after it are not emitted

    def _take(self, run: _Running, token: int, logits: torch.Tensor) -> None:
        """Emit a sampled id (or finish at an end-of-turn id / the budget's end)."""
        req = run.handle.request
        if token in self.stop_ids and not req.ignore_eos:
            self._finish(run.slot, Event(finish="stop"))
            return
        logprob, top = None, ()
        if req.top_logprobs is not None:
            lp = logits.float().log_softmax(-1)
            logprob = float(lp[token])
            if req.top_logprobs:
                values, idx = lp.topk(req.top_logprobs)
                top = tuple(zip(idx.tolist(), values.tolist()))
        run.handle.emit(Event(token=token, logprob=logprob, top=top))
        run.budget -= 1
        if run.budget <= 0:
            self._finish(run.slot, Event(finish="length"))
            return
        run.next_id = token
        if req.sampling.repeat_penalty != 1.0:
            run.history = torch.cat((run.history, run.history.new_tensor([token])))

    def _drop_cancelled(self) -> None:
        for slot, run in list(self._running.items()):
            if run.handle.cancelled:
                self._finish(slot, Event(finish="cancelled"))

    def _finish(self, slot: int, event: Event) -> None:
        run = self._running.pop(slot)
        self.stats.cancelled += event.finish == "cancelled"
        self.held[slot] = self.held[slot][: self.slots.lengths[slot]]
        run.handle.emit(event)
