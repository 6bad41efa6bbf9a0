"""Phases with their seconds, and a watchdog that names a stall (bench/tp_speed.py, bench/tp_vs_llamacpp.py).

Every rank keeps where it is (row, phase, since when); rank 0 prints each phase's seconds as it ends
(flushed). A thread checks once a second: past a row's limit (or the run's), it prints this rank's row
and phase with every thread's Python stack (faulthandler) and ends the process with exit status 3, so
the launcher stops the other ranks and the device command never waits out its own limit silently.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager

STALL_EXIT = 3


class Watchdog:
    def __init__(self, rank: int, row_limit: float, total_limit: float, loud: bool | None = None):
        self.rank, self.row_limit, self.total_limit = rank, row_limit, total_limit
        self.loud = rank == 0 if loud is None else loud
        self.t0 = time.monotonic()
        self.row, self.phase_name = "-", "start"
        self.row_start = self.phase_start = self.t0
        self.limit = row_limit
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def say(self, text: str) -> None:
        if self.loud:
            print(f"[{time.monotonic() - self.t0:7.1f} s] {text}", flush=True)

    def enter_row(self, row: str, limit: float | None = None) -> None:
        """A new row: its own limit (default row_limit) counts from now."""
        self.row, self.limit = row, limit or self.row_limit
        self.row_start = time.monotonic()
        self.say(f"{row}: start")

    @contextmanager
    def phase(self, name: str):
        self.phase_name, self.phase_start = name, time.monotonic()
        yield
        self.say(f"{self.row}: {name} {time.monotonic() - self.phase_start:.1f} s")
        self.phase_name = f"after {name}"

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            over_row = now - self.row_start > self.limit
            over_all = now - self.t0 > self.total_limit
            if over_row or over_all:
                what = f"row limit {self.limit:.0f} s" if over_row else f"run limit {self.total_limit:.0f} s"
                print(f"[rank {self.rank}] STALLED ({what}): row {self.row}, phase '{self.phase_name}' for "
                      f"{now - self.phase_start:.1f} s, row for {now - self.row_start:.1f} s; stacks:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(STALL_EXIT)
