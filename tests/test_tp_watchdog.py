"""bench/tp_watchdog.py (the speed runs' stall guard): a row past its limit ends the process with exit
status 3, naming the row and the phase it was in (and the stack); phases print their seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

SCRIPT = """
import sys, time
sys.path.insert(0, {bench!r})
from tp_watchdog import Watchdog
wd = Watchdog(0, row_limit=1.5, total_limit=60)
wd.enter_row("8b-bf16-tp2")
with wd.phase("weights"):
    pass
with wd.phase("first step"):
    time.sleep(30)
"""


def test_a_stalled_phase_is_named_and_ends_the_run():
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(bench=str(BENCH))], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert "8b-bf16-tp2: weights" in done.stdout  # the finished phase, with its seconds
    assert "STALLED (row limit 2 s): row 8b-bf16-tp2, phase 'first step'" in done.stderr
    assert "time.sleep" in done.stderr or "<string>" in done.stderr  # the main thread's stack


def test_rows_parse():
    sys.path.insert(0, str(BENCH))
    from tp_speed import ROWS, parse_row

    assert parse_row("8b-Q4_K_M-tp2") == ("llama-3.1-8b", "Q4_K_M", 2)
    assert parse_row("70b-bf16-tp2") == ("llama-3.1-70b", "bf16", 2)
    assert len({parse_row(r) for r in ROWS}) == len(ROWS)
