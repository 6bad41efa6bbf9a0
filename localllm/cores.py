"""CPU thread counts without torch: the physical cores (the default of -t/--threads) and -t's check.
device.set_threads hands the count to torch; `localllm quantize`'s torch-free preset path
(commands/quantize_native.py) hands it to the C++ encoders."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LocalLLMError


def physical_cores() -> int:
    """Cores without their SMT siblings (the default of -t/--threads), within this process's affinity."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    return max(1, len(cores))


def thread_count(threads: int | None) -> tuple[int, str | None]:
    """-t/--threads -> (threads to use, a notice when capped): the physical cores when None; more than
    the logical cores only oversubscribes them (OpenMP threads spin), so it is capped there."""
    if threads is None:
        return physical_cores(), None
    if threads < 1:
        raise LocalLLMError(f"--threads must be at least 1, got {threads}")
    logical = os.cpu_count() or 1
    if threads > logical:
        return logical, f"--threads {threads} is more than the {logical} logical cores: using {logical}"
    return threads, None
