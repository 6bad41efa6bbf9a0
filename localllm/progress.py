"""Progress on stderr for long library work: bars for work reported as (stage, done, total) callbacks,
and a spinner with the elapsed time for one long step that reports nothing (a C++ build, a first parse);
on a non-terminal, a plain line with the elapsed seconds every few seconds instead (as llama.cpp-style
tools log long steps: no redrawn lines in a pipe or a CI log, no silent minute either)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .settings import FIRST_PIECES, FIRST_TOKENS_SPINNER_DELAY, PROGRESS_LINE_SECONDS

T = TypeVar("T")


@contextmanager
def stage_progress(enabled: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """Yields report(stage, done, total); each new stage name gets its own bar (on stderr)."""
    if not enabled:
        yield lambda stage, done, total: None
        return
    bars = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=False,
    )
    tasks: dict[str, int] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total)
        bars.update(tasks[stage], completed=done, total=total)

    with bars:
        yield report


@contextmanager
def elapsed_spinner(description: str, delay: float = 0.0, console: Console | None = None,
                    every: float = PROGRESS_LINE_SECONDS) -> Iterator[None]:
    """A spinner, `description` and the elapsed time on a terminal's stderr while the block runs, shown
    once it has run `delay` seconds (quick work stays quiet) and removed when it ends. Not a terminal
    (a pipe, a log file): one plain line "description: N s elapsed" every `every` seconds while it
    runs (elapsed_lines), never redrawn."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        with elapsed_lines(description, console, every):
            yield
        return
    bar = Progress(SpinnerColumn(), TextColumn(description), TimeElapsedColumn(), console=console, transient=True)
    bar.add_task(description, total=None)
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                bar.start()
                state["started"] = True

    timer = threading.Timer(delay, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                bar.stop()


@contextmanager
def elapsed_lines(description: str, console: Console, every: float) -> Iterator[None]:
    """While the block runs, "description: N s elapsed" on console's file at every `every` seconds
    (none for work quicker than that); no line after the block has ended."""
    stop = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not stop.wait(every):
            console.file.write(f"{description}: {time.monotonic() - t0:.0f} s elapsed\n")
            console.file.flush()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def first_items_announced(items: Iterable[T], description: str, count: int = FIRST_PIECES,
                          delay: float = FIRST_TOKENS_SPINNER_DELAY, console: Console | None = None) -> Iterator[T]:
    """items, the first `count` of them awaited inside elapsed_spinner(description, delay) (work before
    them that reports nothing: a GPU's first kernel compilations), then the rest as they come. The
    spinner is gone before the first item is handed on (a caller printing items draws no line under it)."""
    it = iter(items)
    first = []
    with elapsed_spinner(description, delay=delay, console=console):
        for item in it:
            first.append(item)
            if len(first) == count:
                break
    yield from first
    yield from it
