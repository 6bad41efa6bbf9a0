"""The requests of the continuous-batching engine (localllm/engine.py) as its callers see them: what
a request asks, the events it gets back, the handle that carries them, the errors submit raises."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .errors import LocalLLMError
from .sampling import Sampler
from .settings import DEFAULT_SAMPLING, SamplingSettings
from .speculative import AdaptiveK


def error_message(e: Exception) -> str:
    """The one line an "error" event carries."""
    return str(e) if isinstance(e, LocalLLMError) else f"{type(e).__name__}: {e}"


class QueueFull(LocalLLMError):
    """Every slot is busy and the waiting queue is full (the server answers 503 + Retry-After)."""


class EngineStopped(LocalLLMError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: SamplingSettings = DEFAULT_SAMPLING
    max_tokens: int = -1  # -1: until an end-of-turn id or the slot's context is full
    top_logprobs: int | None = None  # None: no log-probs; k >= 0: the chosen id's and the k most likely
    ignore_eos: bool = False  # end-of-turn ids do not end it (benchmarks with fixed output lengths)


@dataclass(frozen=True)
class Event:
    """One generated id (token set), or the end (finish set): "stop" (an end-of-turn id), "length"
    (max_tokens or the context), "cancelled" (cancel() or shutdown), "error" (message says why)."""

    token: int | None = None
    logprob: float | None = None  # log-softmax of the model's logits at the chosen id
    top: tuple[tuple[int, float], ...] = ()  # the top_logprobs most likely (id, log-prob), best first
    finish: str | None = None
    message: str = ""


Sink = Callable[[Event], None]


class Handle:
    """One submitted request. Iterate it for its events (with the default sink), or pass submit() a sink
    (the server's: a thread-safe put into its event loop). cancel() frees the slot at the next step."""

    def __init__(self, request: Request, sink: Sink | None = None):
        self.request = request
        self._queue: queue.Queue[Event] | None = None if sink is not None else queue.Queue()
        self._sink = sink if sink is not None else self._queue.put
        self.cancelled = False
        self.done = False
        self.queued_at = time.perf_counter()  # submitted (the engine's debug log of queue waits)

    def cancel(self) -> None:
        self.cancelled = True

    def emit(self, event: Event) -> None:
        if self.done:
            return
        self.done = event.finish is not None
        try:
            self._sink(event)
        except RuntimeError:  # the consumer's event loop is closed: it is gone, so is its interest
            self.cancelled = True

    def __iter__(self) -> Iterator[Event]:
        assert self._queue is not None, "a handle with its own sink is not iterable"
        while True:
            ev = self._queue.get()
            yield ev
            if ev.finish is not None:
                return


def check_fits(prompt_len: int, capacity: int) -> None:
    """A prompt needs its ids and one more row for the reply (generate.check_fits's rule, per slot)."""
    if prompt_len == 0:
        raise LocalLLMError("the prompt is empty (no tokens to start from)")
    if prompt_len >= capacity:
        raise LocalLLMError(f"the prompt is {prompt_len} tokens but the context holds {capacity}"
                            f" (one more is needed for the reply)")


@dataclass
class Running:
    """A request in its slot (the engine thread's own state of it)."""

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
