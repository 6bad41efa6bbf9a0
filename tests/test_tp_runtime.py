"""Tensor parallelism's driver/worker protocol (localllm/tp_runtime.py, issue 23) with 2 processes (gloo on
the CPU): greedy completions (plain, --lookup, --draft) and serve's slot steps run through the driver
equal the same calls in one process without it (the oracle: the same library calls on the whole model),
for a replicated model (each rank holds the whole) and a sharded one (load_model(tp=)); a driver that
fails still ends its workers; `localllm complete --tp 2 --device cpu` end to end through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tiny_gguf import write_gguf
from tiny_spec import TinySpec
from localllm.backends.cpu import CpuEagerRuntime
from localllm.load import load_model

WORKER = Path(__file__).with_name("tp_runtime_worker.py")
sys.path.insert(0, str(WORKER.parent))
from tp_runtime_worker import scenarios  # noqa: E402
from ports import free_port


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tp_runtime")
    target = write_gguf(TinySpec("llama", seed=11), folder / "target.gguf")
    draft = write_gguf(TinySpec("llama", n_layers=1, seed=12), folder / "draft.gguf")
    return target, draft


@pytest.fixture(scope="module")
def launched(files, tmp_path_factory) -> tuple[Path, list[int]]:
    """One launch of 2 ranks runs every mode (tp_runtime_worker.py) -> (results folder, exit statuses)."""
    out = tmp_path_factory.mktemp("tp_runtime_out")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, str(out), *map(str, files)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    return out, [p.wait(timeout=300) for p in procs]


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_driver_equals_one_process(files, launched, mode):
    got = torch.load(launched[0] / f"{mode}.pt")
    # the oracle: one process, the whole model; the sharded ranks run the eager runtime (its sums' order
    # differs from the C++ decoder's by rounding only), so the oracle does too
    backend = CpuEagerRuntime if mode == "sharded" else None
    want = scenarios(load_model(str(files[0]), "cpu", backend=backend), str(files[1]))
    assert got == want
    assert got["plain"] and got["lookup"] == got["plain"] == got["draft"]  # speculative: the same greedy text


def test_driver_error_ends_workers(launched):
    """The driver failed amid its last session (status 1); the workers ended all the same (status 0)."""
    assert launched[1] == [1, 0]


def cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    root = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "localllm.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=180)


def test_cli_complete_tp2(files):
    """One launch of `localllm complete --tp 2 --device cpu` (prompt from stdin: the driver's), against
    the library's greedy completion in one process (what --tp 1 prints); then a driver's error is one
    line, the driver's status."""
    from dataclasses import replace

    from localllm.runner import complete
    from localllm.settings import DEFAULT_GENERATION, DEFAULT_SAMPLING

    prompt = "the cat sat on the mat"
    gen = replace(DEFAULT_GENERATION, max_tokens=12)
    want = "".join(complete(load_model(str(files[0]), "cpu"), prompt, gen, replace(DEFAULT_SAMPLING, temperature=0.0)))
    two = cli("complete", files[0], "-", "-n", "12", "--temp", "0", "--device", "cpu", "--tp", "2", stdin=prompt)
    assert want.strip() and (two.returncode, two.stdout, two.stderr) == (0, want + "\n", ""), two.stderr
    bad = cli("complete", files[0], "-", "--ctx", "4", "--temp", "0", "--device", "cpu", "--tp", "2",
              stdin="the cat sat on the mat, a long prompt over the context")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), bad.stderr


def test_every_runtime_step_is_forwarded():
    """A Runtime method the driver ran alone would leave the workers out of its collectives (a hang):
    every method of Runtime is a forwarded STEP or named LOCAL."""
    from localllm.runtime import Runtime
    from localllm.tp_runtime import LOCAL, STEPS

    methods = {n for n, v in vars(Runtime).items() if callable(v) or isinstance(v, staticmethod)} - {"__init__"}
    methods = {n for n in methods if not n.startswith("_")}
    assert methods - STEPS - LOCAL == set()
    assert (STEPS | LOCAL) - methods == set()


class _Recorder:
    """A runtime that records its calls (new_slots gives a Slots whose tables hold a "graph")."""

    def __init__(self, log: list):
        self.log = log

    def new_slots(self, n, capacity):
        self.log.append("new_slots")
        from localllm.slots import Slots

        made = Slots(cache=None, lengths=[0] * n)
        made.tables["graph"] = object()
        return made

    def release(self, slots=()):
        self.log.append(("release", len(slots)))
        for one in slots:
            one.tables.clear()


def test_driver_and_workers_release_their_graphs_before_the_group_closes(monkeypatch):
    """NCCL's teardown waits for every CUDA graph that captured one of its collectives (a TP=2 `complete`
    on CUDA never exited): the driver's stop, then close() at exit, release the runtime's graphs and
    those of the slots it made and still holds, before destroy_process_group (atexit: stop registered
    after close, so run first); a worker's follow releases the driver's slots and lets go of them on
    stop; close() collects garbage first."""
    import atexit
    import gc

    from localllm import tp_runtime

    log = []
    monkeypatch.setattr(tp_runtime, "send", lambda message, group, world: log.append(("send", message[0])) or [])
    monkeypatch.setattr(tp_runtime, "control_group", lambda tp: None)
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    tp = type("TP", (), {"world": 2, "rank": 0, "driver": True, "group": None})()
    driver = tp_runtime.lead(_Recorder(log), tp)
    assert registered == [tp_runtime.close, driver.stop]  # atexit runs them last-in first: stop, then close
    kept = driver.new_slots(2, 8)
    driver.stop()
    driver.stop()
    assert log == [("send", "new_slots"), "new_slots", ("send", tp_runtime.STOP), ("release", 1)]
    assert not kept.tables

    messages = iter([("new_slots", (2, 8), {}, [], 0), (tp_runtime.STOP, (), {}, [], None)])
    monkeypatch.setattr(tp_runtime, "receive", lambda group: next(messages))
    worker_log, refs = [], []
    runtime = _Recorder(worker_log)
    real_new = runtime.new_slots
    runtime.new_slots = lambda n, capacity: refs.append(weakref.ref(made := real_new(n, capacity))) or made
    assert tp_runtime.follow(runtime, tp) == 1
    assert worker_log == ["new_slots", ("release", 1)] and refs[0]() is None

    order = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: order.append("destroy"))
    monkeypatch.setattr(gc, "collect", lambda: order.append("collect"))
    tp_runtime.close()
    assert order == ["collect", "destroy"]


def test_cuda_runtime_release_drops_its_graphs():
    """CudaRuntime.release forgets its decoders, its prompt graph and the given slots' tables (the
    objects holding captured graphs)."""
    from localllm.backends.cuda import CudaRuntime
    from localllm.slots import Slots

    rt = object.__new__(CudaRuntime)
    rt.sync = lambda: None  # (no device here)
    slots = Slots(cache=None, lengths=[0])
    slots.tables[("cuda", True)] = {1: _Graph()}
    rt.decoders, rt.prefill_graph = {(1, False): _Graph(), (1, True): _Graph()}, _Graph()
    dead = [weakref.ref(v) for v in [*rt.decoders.values(), rt.prefill_graph, slots.tables[("cuda", True)][1]]]
    rt.release([slots])
    assert rt.decoders == {} and rt.prefill_graph is None and not slots.tables and all(r() is None for r in dead)


class _Graph:
    pass
