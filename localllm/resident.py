"""A model kept loaded between commands (`complete --keep-alive DURATION`), as ollama keeps a model loaded
after `ollama run`: the first such command starts `localllm serve` in the background for that model and
those load options (one slot, localhost, a free port) and streams from it (localllm/client.py); later
commands find it and stream at once, without importing torch, opening the file or compiling kernels, the
seconds a loading command waits (docs/PERFORMANCE.md: `import torch` alone is 4-6 s on a GPU machine).
The server exits by itself once DURATION has passed without a request (serve --idle-exit).

State, one set of files per (model file, load options) key in `folder` (FileSettings.cache_dir /
"resident"): KEY.json (the server's pid and address, written once it answers), KEY.log (its stderr: the
error line when it fails to start) and KEY.lock (held while one command looks for or starts the server,
so two commands started together share one server). A record whose process is gone or does not answer is
stale: the next command starts a new server. Nothing here imports torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Sequence

from .errors import LocalLLMError

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
HOST = "127.0.0.1"
POLL_SECONDS = 0.05  # between readiness checks of a starting server
ANSWER_SECONDS = 2.0  # a running server's /health answers within this, or the record is stale


@dataclass(frozen=True)
class Resident:
    """A background server: its process and base URL (http://127.0.0.1:PORT); the model file it serves,
    its load options, its keep-alive seconds and when it started (time.time(); `localllm ps`)."""

    pid: int
    url: str
    model: str = ""
    args: tuple[str, ...] = ()
    idle: float = 0.0
    started: float = 0.0


def parse_duration(text: str, option: str = "--keep-alive") -> float:
    """"90" / "90s" / "5m" / "1h" / "1d" -> seconds (> 0), as ollama's keep-alive values."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*", text or "")
    seconds = float(m.group(1)) * UNITS[m.group(2) or "s"] if m else 0.0
    if seconds <= 0:
        raise LocalLLMError(f"{option} takes a duration such as 30s, 5m or 1h, got {text!r}")
    return seconds


def resident_key(model: Path, serve_args: Sequence[str]) -> str:
    """One key per model file (its resolved path, size and modification time: a rewritten file gets a new
    server) and load options."""
    path = model.resolve()
    st = path.stat()
    blob = json.dumps([str(path), st.st_size, st.st_mtime_ns, list(serve_args)])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def answers(url: str, timeout: float) -> bool:
    """Whether a server at url answers GET /health with 200 within timeout seconds."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def alive(pid: int) -> bool:
    """Whether a process of ours has this pid (another user's is not ours: PermissionError)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def find(folder: Path, key: str) -> Resident | None:
    """The running server of key, or None (no record, or a stale one)."""
    path = folder / f"{key}.json"
    try:
        record = Resident(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if alive(record.pid) and answers(record.url, ANSWER_SECONDS):
        return record
    path.unlink(missing_ok=True)  # the server has exited (--idle-exit) or hangs: a new one replaces it
    return None


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(model: Path, port: int, idle_seconds: float, serve_args: Sequence[str]) -> list[str]:
    """The background server's command line: one slot, localhost, exiting after idle_seconds without a
    request; no warm-up (serve's compiles every prompt variant and graph before listening: 22 s of a cold
    CUDA start, where the first command needs only its own: docs/PERFORMANCE.md)."""
    return [sys.executable, "-m", "localllm", "serve", str(model), "--host", HOST, "--port", str(port),
            "--parallel", "1", "--no-warm-up", "--idle-exit", f"{idle_seconds:g}", "--log-level", "warning",
            *serve_args]


def last_line(log: Path) -> str:
    """The log's last non-empty line without its "error: " prefix (the server's one error line)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    line = lines[-1] if lines else "no output"
    return line[len("error: "):] if line.startswith("error: ") else line


def start(folder: Path, key: str, model: Path, idle_seconds: float, serve_args: Sequence[str]) -> Resident:
    """Start the server and wait until it answers -> its record (written to KEY.json). Its own error line
    when it exits first (a model it cannot load: the same line the loading command would print); stopped
    again when the wait is interrupted (Ctrl-C): no half-started server is left behind."""
    port = free_port()
    log = folder / f"{key}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(serve_command(model, port, idle_seconds, serve_args), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    record = Resident(proc.pid, f"http://{HOST}:{port}", str(model.resolve()), tuple(serve_args), idle_seconds, time.time())
    try:
        while not answers(record.url, ANSWER_SECONDS):
            if proc.poll() is not None:
                raise LocalLLMError(f"the background server for {model.name} exited: {last_line(log)}")
            time.sleep(POLL_SECONDS)
    except BaseException:
        stop(proc.pid)
        raise
    write_record(folder / f"{key}.json", record)
    return record


def write_record(path: Path, record: Resident) -> None:
    """Written whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def stop(pid: int) -> None:
    """SIGTERM to the server's process group (serve shuts down gracefully; a --tp server's ranks too)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def running(folder: Path) -> list[Resident]:
    """The background servers running now (stale records dropped), oldest first."""
    found = (find(folder, p.stem) for p in folder.glob("*.json")) if folder.is_dir() else ()
    return sorted((r for r in found if r is not None), key=lambda r: r.started)


def stop_running(folder: Path, model: Path | None = None, wait_seconds: float = 30.0) -> list[Resident]:
    """Stop the running servers of `model` (every one without it), each awaited until its process is gone
    (serve's graceful shutdown) -> those stopped."""
    want = str(model.resolve()) if model is not None else None
    chosen = [r for r in running(folder) if want is None or r.model == want]
    for r in chosen:
        stop(r.pid)
    deadline = time.monotonic() + wait_seconds
    for r in chosen:
        while alive(r.pid) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
    return chosen


@contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def kept_alive(folder: Path, model: Path, idle_seconds: float, serve_args: Sequence[str],
               starting: Callable[[], ContextManager] | None = None) -> Resident:
    """The running server of (model, serve_args), started first when there is none; starting(): a context
    (a spinner) around the wait for a new server's load."""
    if not model.exists():
        raise LocalLLMError(f"file not found: {model}")
    folder.mkdir(parents=True, exist_ok=True)
    key = resident_key(model, serve_args)
    with locked(folder / f"{key}.lock"):
        if (found := find(folder, key)) is not None:
            return found
        with (starting or nullcontext)():
            return start(folder, key, model, idle_seconds, serve_args)
