"""The parent side of the fuzzer: a pool of worker subprocesses (fuzz_worker.py) fed case indices,
each case given a timeout; a worker that hangs is asked for its stack (SIGUSR1), killed and
restarted, one that dies is restarted; every outcome goes to a callback."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from fuzz_worker import project_frame

HERE = Path(__file__).resolve().parent
FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
READY_TIMEOUT = 600.0  # torch import plus loading every vocabulary on a busy 2-core machine


@dataclass
class PoolConfig:
    seeds: Path
    scratch: Path
    run_seed: int
    targets: list[str]
    vocabs: list[str]
    jobs: int = 1
    timeout: float = 20.0  # seconds per case
    mem_mb: int = 4096
    recycle: int = 50000  # cases before a worker is replaced (bounds slow leaks)


@dataclass
class Worker:
    n: int
    proc: subprocess.Popen
    log: Path
    case: tuple[str, int] | None = None
    since: float = 0.0
    done: int = 0
    ready: bool = False
    ending: bool = False  # said it outgrew its memory: no more cases, its exit is expected
    buf: bytes = field(default=b"")


def start_worker(cfg: PoolConfig, n: int) -> Worker:
    log = cfg.scratch / f"worker{n}.log"
    cmd = [sys.executable, str(HERE / "fuzz_worker.py"), "--seeds", str(cfg.seeds), "--scratch",
           str(cfg.scratch / f"w{n}"), "--run-seed", str(cfg.run_seed), "--targets", ",".join(cfg.targets),
           "--vocabs", ",".join(cfg.vocabs), "--mem-mb", str(cfg.mem_mb)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.environ.get("PYTHONPATH", ""), str(HERE)]).strip(os.pathsep)}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), env=env)
    os.set_blocking(proc.stdout.fileno(), False)
    return Worker(n, proc, log, since=time.monotonic())


def stack_of(log: Path) -> tuple[str, str]:
    """(innermost project frame, innermost frame) from the last faulthandler dump in a worker's log."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "", ""
    text = text[text.rfind("START "):]
    frames = [(m[0], int(m[1]), m[2]) for m in FRAME.findall(text)]  # innermost first
    if not frames:
        return "", ""
    inner = f"{Path(frames[0][0]).name}:{frames[0][1]} {frames[0][2]}"
    return project_frame(frames[::-1]), inner


def _stop(w: Worker) -> None:
    if w.proc.poll() is None:
        w.proc.kill()
    w.proc.wait()
    for pipe in (w.proc.stdin, w.proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def _lines(w: Worker) -> Iterator[str]:
    try:
        chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
    except BlockingIOError:
        return
    if not chunk:
        raise EOFError
    w.buf += chunk
    *full, w.buf = w.buf.split(b"\n")
    for line in full:
        yield line.decode()


def run_pool(cfg: PoolConfig, cases: Iterator[tuple[str, int]], report: Callable[[dict], None],
             seconds: float) -> float:
    """Run cases until they run out or `seconds` have passed since the first worker was ready (the
    cases in flight then finish). Returns the seconds since the first worker was ready."""
    workers = {n: start_worker(cfg, n) for n in range(cfg.jobs)}
    sel = selectors.DefaultSelector()
    for w in workers.values():
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
    state = dict(pending=True, deadline=None, started=None)

    def restart(w: Worker) -> None:
        sel.unregister(w.proc.stdout)
        _stop(w)
        new = start_worker(cfg, w.n)
        workers[w.n] = new
        sel.register(new.proc.stdout, selectors.EVENT_READ, new)

    def feed(w: Worker) -> None:
        if not state["pending"] or time.monotonic() > state["deadline"] or w.done >= cfg.recycle or w.ending:
            return
        try:
            w.case, w.since = next(cases), time.monotonic()
        except StopIteration:
            state["pending"] = False
            return
        w.proc.stdin.write(f"{w.case[0]} {w.case[1]}\n".encode())
        w.proc.stdin.flush()

    def receive(w: Worker) -> None:
        try:
            for line in _lines(w):
                if line == "READY":
                    w.ready = True
                    if state["started"] is None:
                        state["started"] = time.monotonic()
                        state["deadline"] = state["started"] + seconds
                elif w.case is None:  # "recycle" after the case's own result: the worker is ending
                    w.ending = True
                    report(json.loads(line))
                else:
                    report(json.loads(line))
                    w.case, w.done = None, w.done + 1
        except EOFError:
            code = w.proc.wait()
            if not w.ready:
                raise RuntimeError(f"fuzz worker {w.n} died at start (exit {code}); log: {w.log}") from None
            if w.case:
                frame, inner = stack_of(w.log)
                report(dict(target=w.case[0], idx=w.case[1], outcome="crash", exc=f"exit {code}",
                            message=_signal_name(code), frame=frame, inner=inner))
            restart(w)

    def check(w: Worker, now: float) -> None:
        if w.case and now - w.since > cfg.timeout:
            w.proc.send_signal(signal.SIGUSR1)  # faulthandler: the stack, to the log
            time.sleep(0.5)
            frame, inner = stack_of(w.log)
            report(dict(target=w.case[0], idx=w.case[1], outcome="hang", exc=f"> {cfg.timeout:g} s",
                        message="no result within the per-case timeout", frame=frame, inner=inner))
            restart(w)
        elif not w.ready and now - w.since > READY_TIMEOUT:
            raise RuntimeError(f"fuzz worker {w.n} did not start in {READY_TIMEOUT:g} s; log: {w.log}")
        elif w.ready and w.case is None and w.done >= cfg.recycle:
            restart(w)
        elif w.ready and w.case is None:
            feed(w)

    try:
        while True:
            for key, _ in sel.select(timeout=0.2):
                receive(key.data)
            now = time.monotonic()
            for w in list(workers.values()):
                check(w, now)
            finished = not state["pending"] or (state["deadline"] is not None and now > state["deadline"])
            if finished and not any(w.case for w in workers.values()):
                return now - (state["started"] or now)
    finally:
        for w in workers.values():
            _stop(w)


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"
