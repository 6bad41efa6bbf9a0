"""SIGTERM handled like Ctrl-C, so that an interrupted command cleans up as it does for Ctrl-C.

Without a handler SIGTERM ends the process at once: no `finally` runs, and a file being written
(quantize's OUT, perplexity's --save-logits) leaves its partial file behind. With `sigterm_interrupts`
it raises `Terminated` in the main thread: a BaseException, so every `finally` and `except
BaseException` cleanup runs, but not a KeyboardInterrupt, so that no code which takes Ctrl-C as "stop
this step and go on" (the chat REPL's reply) swallows it. The CLI then prints "interrupted" and exits
143 (128 + SIGTERM), as a shell reports it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class Terminated(BaseException):
    """The process received SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated (only the main thread can take signals in Python)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
