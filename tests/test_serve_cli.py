"""`localllm serve` as a process: it serves, and SIGTERM / Ctrl-C shut it down gracefully (a stream in
flight ends with [DONE], exit status 0); bad options are one error line before any model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli_helpers import assert_one_error
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def start(default_path, port):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", str(default_path), "--port", str(port),
                             "--ctx", "128", "-np", "2", "--device", "cpu"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_streams_and_exits_0(default_path, sig):
    port = free_port()
    proc = start(default_path, port)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST", data=json.dumps(
            {"model": default_path.name, "prompt": "Once", "max_tokens": 100, "stream": True,
             "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            first = r.readline()
            assert first.startswith(b"data: {")
            proc.send_signal(sig)
            rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_options_are_one_line():
    from typer.testing import CliRunner

    from localllm.cli import app

    with socket.socket() as taken:  # a port in use: found before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, needle in ((["--parallel", "0"], "--parallel"), (["--port", "70000"], "--port"),
                             (["--ctx", "1"], "--ctx"), (["--chat-template", "nope"], "nope"),
                             (["--log-level", "loud"], "--log-level"), (["--idle-exit", "soon"], "--idle-exit"),
                             (["--port", port], f"cannot listen on 127.0.0.1:{port}"),
                             (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid")):
            result = CliRunner().invoke(app, ["serve", "no-such-model-file.gguf", *args])
            assert_one_error(result, needle)


def test_serve_loads_in_a_thread_that_ends():
    """serve's load runs in a thread of its own that has ended when serving starts (its OpenMP pool gone
    with it: commands/serve.in_own_thread); its result and its exception reach the caller as they are."""
    import threading

    from localllm.commands.serve import in_own_thread
    from localllm.errors import LocalLLMError

    seen = []
    assert in_own_thread(lambda: seen.append(threading.current_thread()) or 42) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fails():
        raise LocalLLMError("file not found: x.gguf")

    with pytest.raises(LocalLLMError, match="file not found"):
        in_own_thread(fails)


@pytest.mark.parametrize("to_group", [True, False])
def test_tp_serve_stops_with_exit_0(tmp_path, to_group):
    """`serve --tp 2` (two ranks on the CPU, gloo) ends as serve does: exit 0, a terminal's Ctrl-C (SIGINT
    to the whole process group: the launcher and both ranks) or SIGTERM to the launcher alone (which
    hands it to the ranks); no rank is left running."""
    import gguf
    from tiny_gguf import write_gguf
    from tiny_spec import TinySpec

    model = write_gguf(TinySpec("llama", dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=64, seed=21),
                       tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", str(model), "--port", str(port),
                             "--ctx", "64", "--device", "cpu", "--tp", "2", "-t", "1"], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.2)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):  # the ranks ended with the launcher
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
