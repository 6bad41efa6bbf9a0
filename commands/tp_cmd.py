"""`--tp N` (issue 23): start N ranks through torch's launcher, and each rank's part of a command.

Outside the launcher, `--tp N` (N > 1) runs the same command under torch.distributed.run (its `run`,
in this process: `python -m torch.distributed.run --standalone --nproc-per-node N -m localllm ARGS`)
with NVLink multicast off, and exits with the driver's status (rank 0's), its error being the one line
the driver printed: the launcher's own failure report is kept quiet. Inside the launcher (started so by
us, or by the user's own `torchrun --nnodes ... -m localllm ...`), rank 0 drives and the others follow
(localllm/tp_runtime.py); the others read no stdin and print nothing."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

from localllm.errors import LocalLLMError
from localllm.backends.launch import from_launcher
from localllm.parallel import NO_MULTICAST, TensorParallel, launched
from localllm.tp_runtime import close, follow, lead


def check_gpus(n: int, device: str) -> None:
    """--tp N: at least 1, and N GPUs on this machine on CUDA."""
    from localllm.device import check_gpus_for

    if n < 1:
        raise LocalLLMError(f"--tp {n}: give 1 or more ranks")
    check_gpus_for(n, device)


def launch(n: int, argv: list[str], stops_on_signal: bool = False) -> int:
    """Run `localllm ARGV` as N ranks on this machine -> the driver's exit status. stops_on_signal: a
    command whose normal end is Ctrl-C / SIGTERM (serve: exit 0, its streams ended first); the launcher
    hands the signal to the ranks and waits for them, so that is the end here too."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.update(NO_MULTICAST)  # the ranks inherit it
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    for name in list(logging.root.manager.loggerDict):  # the launcher's loggers set their own levels
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failures: the driver's own line says it
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={n}", "-m", "localllm", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        failure = e.failures.get(0)
        return failure.exitcode if failure is not None and failure.exitcode > 0 else 1
    except SignalException as e:  # Ctrl-C / SIGTERM: the launcher ended the ranks (the driver said so)
        if stops_on_signal and e.sigval in (signal.SIGINT, signal.SIGTERM):
            return 0
        return 128 + int(e.sigval)
    return 0


def start(n: int, device: str, stops_on_signal: bool = False) -> TensorParallel | None:
    """At a command's start: `--tp N` outside the launcher runs the command as N ranks and exits with
    the driver's status (SystemExit; launch's stops_on_signal); inside it -> this rank's TensorParallel
    (worker ranks' stdin and stdout go to /dev/null); None for one process."""
    from localllm.device import pick_device

    if not launched():
        if n == 1:
            return None
        check_gpus(n, pick_device(device))
        raise SystemExit(launch(n, sys.argv[1:], stops_on_signal))
    if int(os.environ["RANK"]) != 0:  # a worker is silent from its start: one that the launcher ends while
        quiet()  # it joins the group (the driver failed first: a missing file) printed "interrupted"
    tp = from_launcher(pick_device(device))
    if tp is not None:  # the group closed at exit, also after an error before the driver's lead()
        atexit.register(close)
    world = 1 if tp is None else tp.world
    if n not in (1, world):
        raise LocalLLMError(f"--tp {n}, but the launcher started {world} ranks")
    return tp


def quiet() -> None:
    """A worker rank: stdin, stdout and stderr on /dev/null (the driver's terminal is the user's)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def run_rank(lm, tp: TensorParallel | None):
    """After the load: a worker follows the driver until it stops, then exits (SystemExit 0); the driver
    gets lm with its runtime wrapped (tp_runtime.Driver); one process: lm as it is."""
    if tp is None:
        return lm
    if not tp.driver:
        follow(lm.runtime, tp)
        close()
        raise SystemExit(0)
    lm.runtime = lead(lm.runtime, tp)
    return lm


def check_draft(ds, tp: TensorParallel | None) -> None:
    """--draft self:TYPE quantizes the target in memory: a rank's shard is no whole draft model."""
    if tp is not None and ds.draft is not None and ds.draft.startswith("self:"):
        raise LocalLLMError("--draft self:TYPE does not work with --tp: give a draft model (it runs on rank 0, whole)")


def bench_argv(argv: list[str], degree: int) -> list[str]:
    """`bench` ARGV with its --tp and -o/--output replaced: one degree, JSON rows."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--tp", "-o", "--output"):
            skip = True
        elif not a.startswith(("--tp=", "--output=")):
            out.append(a)
    return [*out, "--tp", str(degree), "-o", "json"]


def bench_degrees(degrees: list[int], device: str, fmt: str) -> str:
    """`bench --tp 1,2,...`: every degree's rows in one table; degree 1 in this process, each degree > 1
    as its own launch of that many ranks (torch.distributed.run), whose driver prints its rows as JSON."""
    import json
    import subprocess

    from localllm.commands.bench import Row, format_rows
    from localllm.device import pick_device
    from localllm.parallel import no_multicast_env

    if launched():
        raise LocalLLMError("bench --tp with several degrees starts its own launches: run it without torchrun")
    rows, roof = [], None
    for n in degrees:
        check_gpus(n, pick_device(device))
        argv = bench_argv(sys.argv[1:], n)
        cmd = ([sys.executable, "-m", "localllm", *argv] if n == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "localllm",
                *argv])
        env = no_multicast_env()
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if done.returncode:
            raise LocalLLMError(f"bench --tp {n} failed (exit status {done.returncode}; its error is above)")
        got = json.loads(done.stdout)
        roof = roof or got["roofline"]
        rows += [Row(**r) for r in got["rows"]]
    return format_rows(rows, roof, fmt)
