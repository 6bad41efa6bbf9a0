"""Temporary files written beside their destination and renamed onto it when complete.

A partial file is named `.NAME.PID.XXXXXXXX.partial` (hidden, in OUT's folder, so that the final
os.replace is a rename on one file system): PID is the writer's process id. A writer that was killed
(SIGKILL, a power cut) cannot delete its partial; the next writer of the same NAME removes those whose
process is gone, and any not modified for `stale_seconds` (a live writer appends to its partial
continuously; this also covers a pid reused by another process, and partials of older versions,
which carry no pid).
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path


def make_partial(out: Path) -> Path:
    """Create an empty partial file for OUT (raises OSError when OUT's folder cannot be written)."""
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.{os.getpid()}.", suffix=".partial")
    os.close(fd)
    return Path(name)


def partial_pid(partial: Path, out_name: str) -> int | None:
    """The writer's pid in a partial's name, None when the name carries none."""
    middle = partial.name.removeprefix(f".{out_name}.").removesuffix(".partial")
    pid, _, rest = middle.partition(".")
    return int(pid) if pid.isdigit() and rest else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):  # a number no process can have
        return False
    return True


def remove_stale_partials(out: Path, stale_seconds: float) -> list[Path]:
    """Delete the partials of OUT left by writers that are gone; returns those deleted."""
    removed = []
    try:
        found = list(out.parent.glob(f".{glob.escape(out.name)}.*.partial"))
    except OSError:
        return removed
    now = time.time()
    for p in found:
        pid = partial_pid(p, out.name)
        try:
            old = now - p.stat().st_mtime > stale_seconds
            if old or (pid is not None and pid != os.getpid() and not pid_alive(pid)):
                p.unlink()
                removed.append(p)
        except OSError:  # gone meanwhile, or not ours to delete: leave it
            continue
    return removed
