"""`complete --keep-alive DURATION` (localllm/resident.py, serve --idle-exit): the first command starts a
background `localllm serve` of the model and streams from it, the next finds the same server and streams
without importing torch, and the server exits by itself after DURATION without a request. Oracles:
generate() run alone on a fresh cache (the greedy text), sys.modules (no torch in the warm command), the
server process itself (its pid, its exit, its log), and the one-line errors of a bad start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_helpers import reference

from localllm import resident
from localllm.errors import LocalLLMError
from localllm.runner import encode_prompt, open_model
from localllm.server.run import Activity
from localllm.settings import DEFAULT_CPU

ROOT = Path(__file__).resolve().parents[1]
CTX = 128
# the CLI in a fresh interpreter, then whether torch was imported (as tests/test_client.py)
RUN = ("import runpy, sys\nsys.argv = ['localllm'] + sys.argv[1:]\ncode = 0\n"
       "try:\n    runpy.run_module('localllm.cli', run_name='__main__')\n"
       "except SystemExit as e:\n    code = e.code or 0\n"
       "sys.stderr.write('TORCH IMPORTED\\n' if 'torch' in sys.modules else '')\nsys.exit(code)\n")


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME of the test's own (its records, its servers) sharing this process's built C++ kernels (the
    servers would otherwise build them again: a minute on a 2-core machine)."""
    cache = tmp_path / ".cache" / "localllm"
    cache.mkdir(parents=True)
    for name in ("cpu_ext", "cpu_encode_lib"):
        if (DEFAULT_CPU.cache_dir / name).is_dir():
            (cache / name).symlink_to(DEFAULT_CPU.cache_dir / name)
    return tmp_path


def cli(home: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(home), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", RUN, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def records(home: Path) -> list[dict]:
    folder = home / ".cache" / "localllm" / "resident"
    return [json.loads(p.read_text()) for p in folder.glob("*.json")]


def gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not resident.alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_kept_alive_server_serves_the_next_command_then_exits_when_idle(default_path, home):
    tmp_path = home
    lm = open_model(str(default_path), "cpu")
    prompt = "The three primary colors are"
    want = lm.tokenizer.decode(reference(lm, encode_prompt(lm, prompt), 12, CTX))
    args = ("complete", prompt, "-n", 12, "--temp", 0, "--ctx", CTX, "--keep-alive", "10s")
    pids = []
    try:
        # other load options: a server of its own, kept long (started first: its load must not eat into
        # the short-lived server's idle time below)
        other = cli(tmp_path, *args[:-4], "--ctx", 64, "--keep-alive", "5m")
        assert other.returncode == 0, other.stderr
        [kept] = records(tmp_path)
        first = cli(tmp_path, *args)
        assert first.returncode == 0, first.stderr
        assert first.stdout == want + "\n"
        [record] = [r for r in records(tmp_path) if r["pid"] != kept["pid"]]
        pids += [kept["pid"], record["pid"]]
        assert resident.alive(record["pid"]) and record["args"] == ["--ctx", str(CTX)]
        warm = cli(tmp_path, *args)
        assert warm.returncode == 0 and warm.stdout == want + "\n", warm.stderr
        assert "TORCH IMPORTED" not in warm.stderr  # the warm command loads nothing
        assert sorted(r["pid"] for r in records(tmp_path)) == sorted(pids)  # the same two servers
        listed = cli(tmp_path, "ps").stdout.splitlines()
        assert len(listed) == 3 and listed[0].split()[:2] == ["MODEL", "PID"], listed
        assert [line.split()[1] for line in listed[1:]] == [str(p) for p in pids]  # oldest first
        assert listed[1].endswith("--ctx 64") and "300 s" in listed[1]
        assert gone(record["pid"], 60)  # --idle-exit 10
        logs = "".join(p.read_text() for p in (tmp_path / ".cache" / "localllm" / "resident").glob("*.log"))
        assert "no request for 10 s: stopping" in logs
        assert len(cli(tmp_path, "ps").stdout.splitlines()) == 2  # the other one still runs
        stopped = cli(tmp_path, "stop", default_path)
        assert stopped.returncode == 0 and f"(pid {kept['pid']})" in stopped.stderr, stopped.stderr
        assert not resident.alive(kept["pid"]) and len(cli(tmp_path, "ps").stdout.splitlines()) == 1
        none = cli(tmp_path, "stop")
        assert none.returncode == 0 and "no background server is running" in none.stderr
    finally:
        for pid in pids:
            resident.stop(pid)


def test_a_server_that_fails_to_start_is_one_line_and_no_record(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    fails = [sys.executable, "-c", "import sys; sys.stderr.write('load 1 s\\nerror: truncated GGUF: m.gguf\\n'); sys.exit(1)"]
    monkeypatch.setattr(resident, "serve_command", lambda *a: fails)
    with pytest.raises(LocalLLMError, match=r"^the background server for m.gguf exited: truncated GGUF: m.gguf$"):
        resident.kept_alive(tmp_path / "state", model, 5.0, [])
    assert not list((tmp_path / "state").glob("*.json"))
    with pytest.raises(LocalLLMError, match="file not found"):
        resident.kept_alive(tmp_path / "state", tmp_path / "missing.gguf", 5.0, [])


def test_an_interrupted_start_stops_the_server(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(resident, "serve_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    started = []
    real_popen = subprocess.Popen

    def popen(*a, **k):
        started.append(real_popen(*a, **k))
        return started[-1]

    def interrupted(url, timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(resident.subprocess, "Popen", popen)
    monkeypatch.setattr(resident, "answers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resident.kept_alive(tmp_path / "state", model, 5.0, [])
    assert started[0].wait(10) == -signal.SIGTERM
    assert not list((tmp_path / "state").glob("*.json"))


def test_a_stale_record_is_dropped(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    resident.write_record(tmp_path / "k.json", resident.Resident(dead.pid, "http://127.0.0.1:9"))
    assert resident.find(tmp_path, "k") is None
    assert not (tmp_path / "k.json").exists()


def test_durations_and_keys(tmp_path):
    assert [resident.parse_duration(t) for t in ("90", "90s", "5m", "1.5h", "1d")] == [90, 90, 300, 5400, 86400]
    for bad in ("0", "-5m", "5 minutes", "", "m"):
        with pytest.raises(LocalLLMError, match="--keep-alive takes a duration"):
            resident.parse_duration(bad)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" * 4)
    key = resident.resident_key(model, ["--ctx", "64"])
    assert key == resident.resident_key(model, ["--ctx", "64"])
    assert key != resident.resident_key(model, ["--ctx", "128"])
    model.write_bytes(b"GGUF" * 5)  # a rewritten file: a new server
    assert key != resident.resident_key(model, ["--ctx", "64"])


def test_activity_counts_v1_requests_until_their_response_ends():
    activity = Activity()
    seen = []

    async def app(scope, receive, send):
        seen.append(activity.active)

    counted = activity.counting(app)
    asyncio.run(counted({"type": "http", "path": "/health"}, None, None))
    asyncio.run(counted({"type": "http", "path": "/v1/completions"}, None, None))
    assert seen == [0, 1] and activity.active == 0
    assert 0 <= activity.idle_seconds() < 5
    activity.active = 1
    assert activity.idle_seconds() == 0.0


def test_chat_kept_alive_replies_as_the_local_chat_and_drops_old_turns(default_path, home):
    """`chat --keep-alive` (localllm/conversation.RemoteChat through the server's chat endpoint): the
    greedy replies of a scripted chat equal the local chat's (the oracle: the same command without
    --keep-alive); a conversation past the slot's context loses its oldest turns (a note) and goes on."""
    lines = "What is the capital of France?\n/stats\nAnd of Italy?\n"
    args = ("chat", "--temp", 0, "-n", 16)
    env = dict(os.environ, HOME=str(home), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def chat(*more):
        return subprocess.run([sys.executable, "-m", "localllm", *map(str, args + more)], input=lines,
                              capture_output=True, text=True, env=env, timeout=300)

    try:
        local, kept = chat(), chat("--keep-alive", "1m")
        assert local.returncode == 0 and kept.returncode == 0, kept.stderr
        assert kept.stdout == local.stdout and len(kept.stdout.splitlines()) == 2
        assert "context " in kept.stderr  # /stats answered from the server's usage
        lines = "Tell me about the sea and the sky and the sun.\n" * 6
        small = chat("--keep-alive", "1m", "--ctx", 96)
        assert small.returncode == 0 and "context full: dropped the" in small.stderr, small.stderr
        assert len(small.stdout.splitlines()) >= 6
    finally:
        for record in records(home):
            resident.stop(record["pid"])
