"""Continuous batching: many requests share each decode step of one model (the server's scheduler).

A background thread loops: admit waiting requests into free slots (their prompts prefilled together in
one Runtime.prefill_slots pass, up to ServeSettings.prefill_tokens ids a step, a longer prompt in parts
over several steps; sample each first id), then one Runtime.decode_slots over every active slot (each at
its own position, its own cache rows), sample each row with its request's own Sampler, emit events, and
free the slots of finished requests. Requests, events, handles: engine_requests.py.
New requests join between steps; finished ones leave. No HTTP here: localllm/server/ drives it.
With a Speculation (--draft / --lookup) and few running slots, a step is a speculative round instead
(engine_spec.py): several ids per slot, verified in one Runtime.verify_slots pass.

Prefix cache (prefix_slots.py): a new prompt goes to the free slot whose rows share the longest prefix
with it, or gets a busy slot's rows copied, and only the rest is prefilled; a prompt sharing a longer
prefix with another of the same prefill pass waits for a second pass to copy it.

Running ahead (CUDA, whose steps are asynchronous): once the ids of a step of run_ahead or more rows are
read, and nothing waits to be prefilled, no row ends with them and none asks for log-probs, the next
step is launched before the step's events are handed out, so the GPU decodes while the host does the
rest (issue 22: at 64 streams the events and the loop took ~3 ms of host time between 7.5 ms steps:
bench/serve_timeline.py). A row whose request is cancelled meanwhile is decoded once more and dropped.

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
from .engine_spec import Speculation, speculative_round
from .engine_requests import (EngineStopped, Event, Handle, QueueFull, Request, Running, Sink, check_fits,
                              error_message)
from .errors import LocalLLMError
from .generate import token_budget
from .nonfinite import check_logits
from .prefix_slots import pick_slot
from .runtime import Runtime
from .sampling import Sampler, is_plain_greedy
from .settings import DEFAULT_SERVE

# DEBUG (`localllm serve --log-level debug`): one line per prefill pass (its prompts, ids, start and time to
# their first ids, and how long ago each of its requests was submitted: issue 22's TTFT stalls) and one
# per decode step (rows, start, time to its ids, time to its events); bench/serve_timeline.py sums them
log = logging.getLogger("localllm.engine")


@dataclass
class EngineStats:
    steps: int = 0  # decode steps run
    ahead: int = 0  # of which launched ahead of the events of the step before (run_ahead)
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
    # least rows of a step that launches the next before handing out its events (0: never; None:
    # ServeSettings.run_ahead_rows where the runtime's steps are asynchronous, else 0)
    run_ahead: int | None = None
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
        self._running: dict[int, Running] = {}  # slot -> its request
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if self.run_ahead is None:
            self.run_ahead = DEFAULT_SERVE.run_ahead_rows if self.runtime.steps_async else 0
        if self.speculation is not None:
            self.run_ahead = 0
        self._ahead: tuple[list[Running], torch.Tensor, torch.Tensor | None] | None = None  # a launched step

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
                else:
                    self._ahead = None  # every row of a step launched ahead was cancelled
        self._ahead = None  # (its rows end below; the GPU's work is dropped)
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

    def _admit_waiting(self) -> None:
        """Prefill at most prefill_tokens prompt ids this step, several prompts in one prefill_slots pass:
        first the next part of prompts already partly in their slots, then requests taken from the queue
        (_admitting); a prompt longer than what is left runs in parts over the next steps (its slot is
        taken, it joins the decode steps once whole). Requests left over go back to the queue's front. A
        prompt sharing share_min ids more with one of the pass than it has waits for a second pass, from
        that one's rows (prefix_slots.pick_slot: _place copies them)."""
        budget = self.prefill_tokens
        batch: list[tuple[Running, int, int]] = []  # (request, first position of this part, its ids)
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
                slot, have, src = pick_slot(prompt, self.held, self.slots.lengths, self._running, self.last_used)
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

    def _place(self, handle: Handle, slot: int, have: int, src: int, reuse: int) -> Running:
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
        run = Running(handle, slot, sampler, is_plain_greedy(sampler), budget,
                      torch.tensor(req.prompt, dtype=torch.long, device=self.runtime.device), filled=reuse)
        if self.speculation is not None:
            run.schedule = self.speculation.schedule()
            run.draft_sampler = None if run.greedy else self.speculation.draft_sampler(sampler)
        self.stats.reused += reuse
        with self._cv:  # from admitting to running in one move (submit counts both)
            self._admitting.remove(handle)
            self._running[slot] = run
        return run

    def _prefill(self, batch: list[tuple[Running, int, int]]) -> None:
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

    def _timed(self, batch: list[tuple[Running, int, int]], began: float) -> None:
        """The pass's time (its first ids sampled: a host sync) into stats; its DEBUG line."""
        took = time.perf_counter() - began
        self.stats.slowest_prefill = max(self.stats.slowest_prefill, took)
        if log.isEnabledFor(logging.DEBUG):
            waits = ", ".join(f"{1e3 * (began - r.handle.queued_at):.0f}" for r, _, _ in batch)
            log.debug("prefill pass: %d prompts, %d ids (parts %s), at %.4f, %.2f ms to the first ids; "
                      "submitted ms ago: [%s]",
                      len(batch), sum(n for _, _, n in batch), [n for _, _, n in batch], began, 1e3 * took, waits)

    def _first(self, run: Running, logits: torch.Tensor) -> None:
        check_logits(self.runtime.model, logits)
        token = logits.argmax() if run.greedy else run.sampler(logits, run.history)
        self.take(run, int(token), logits)

    def _step(self) -> None:
        """Read the step launched ahead, else launch one over the rows whose prompts are whole; sample its
        ids (the one host sync), launch the next step ahead where it may, then hand out the events."""
        began = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            runs = [r for r in self._running.values() if r.filled == len(r.handle.request.prompt)]
            if not runs:  # every running prompt is still being prefilled
                return
            if self.speculation is not None and len(runs) <= self.speculation.max_slots:
                speculative_round(self, runs)
                return
            ahead = (runs, *self._launch(runs))
        runs, logits, greedy = ahead
        if greedy is not None:  # the common case: no per-row tensors to stack
            ids = greedy.tolist()
        else:
            top = logits.argmax(-1)
            picked = [top[i] if r.greedy else r.sampler(logits[i], r.history) for i, r in enumerate(runs)]
            ids = torch.stack(picked).tolist()
        synced = time.perf_counter()
        live = [(i, r) for i, r in enumerate(runs) if self._running.get(r.slot) is r]  # (cancelled meanwhile)
        if self._may_run_ahead(live, ids):
            for i, r in live:
                r.next_id = ids[i]
            rows = [r for _, r in live]
            self._ahead = (rows, *self._launch(rows))
            self.stats.ahead += 1
        for i, r in live:
            self.take(r, ids[i], logits[i])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decode step: %d rows, at %.4f, %.2f ms to the ids, %.2f ms to the events%s", len(runs),
                      began, 1e3 * (synced - began), 1e3 * (time.perf_counter() - synced),
                      ", next launched" * bool(self._ahead))

    def _launch(self, runs: list[Running]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode_slots step over the runs, fed their next ids -> (logits (B, V), the greedy ids (B,)
        where every run is greedy, else None), not waited for."""
        tokens = torch.tensor([r.next_id for r in runs], dtype=torch.long, device=self.runtime.device)
        logits = self.runtime.decode_slots(self.slots, [r.slot for r in runs], tokens)  # (B, V)
        self.stats.steps += 1
        self.stats.decoded += len(runs)
        for r in runs:
            self.held[r.slot].append(r.next_id)
        return logits, logits.argmax(-1) if all(r.greedy for r in runs) else None

    def _may_run_ahead(self, live: list[tuple[int, Running]], ids: list[int]) -> bool:
        """The next step may be launched now: the same rows go on (none ends with its id, none asks for
        log-probs: take reads the logits the next step overwrites) and no prompt waits for a prefill."""
        if not self.run_ahead or len(live) < self.run_ahead or self._stopping or self._waiting or self._admitting:
            return False
        if len(live) != len(self._running):  # a prompt in parts (not in the step) waits for its next part
            return False
        for i, r in live:
            req = r.handle.request
            if (r.budget <= 1 or req.top_logprobs is not None or r.handle.cancelled
                    or (ids[i] in self.stop_ids and not req.ignore_eos)):
                return False
        return True

    def take(self, run: Running, token: int, logits: torch.Tensor) -> None:
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

    def running_in(self, slot: int) -> Running | None:
        return self._running.get(slot)

    def _drop_cancelled(self) -> None:
        for slot, run in list(self._running.items()):
            if run.handle.cancelled:
                self._finish(slot, Event(finish="cancelled"))

    def _finish(self, slot: int, event: Event) -> None:
        run = self._running.pop(slot)
        self.stats.cancelled += event.finish == "cancelled"
        self.held[slot] = self.held[slot][: self.slots.lengths[slot]]
        run.handle.emit(event)
