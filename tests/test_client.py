"""`complete --server URL` (localllm/client.py, commands/remote.py): the CLI streaming from a running
`localllm serve` (module-scoped, the default model on the CPU, with an API key). Oracles: generate() run
alone on a fresh cache (the greedy text, as `complete` prints it), the server's own error messages, and
sys.modules (the client path imports no torch: its point is a start-up without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from ports import free_port
from serve_helpers import reference

from localllm.client import completion_body, server_url
from localllm.errors import LocalLLMError
from localllm.runner import encode_prompt, open_model
from localllm.settings import DEFAULT_SERVE, SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
KEY = "client-key"
CTX = 128
# runs the CLI in a fresh interpreter, then says whether torch was imported: `cli ARGS...`
RUN = ("import runpy, sys\nsys.argv = ['localllm'] + sys.argv[1:]\ncode = 0\n"
       "try:\n    runpy.run_module('localllm.cli', run_name='__main__')\n"
       "except SystemExit as e:\n    code = e.code or 0\n"
       "sys.stderr.write('TORCH IMPORTED\\n' if 'torch' in sys.modules else '')\nsys.exit(code)\n")


@pytest.fixture(scope="module")
def lm(default_path):
    return open_model(str(default_path), "cpu")


@pytest.fixture(scope="module")
def server(lm):
    from localllm.commands.serve import build_served
    from localllm.server.run import serve_in_thread, stop_thread_server

    served = build_served(lm, None, 2, CTX, KEY, limits=replace(DEFAULT_SERVE, max_queue=4))
    srv, url = serve_in_thread(served)
    yield url, served
    stop_thread_server(srv)


def cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", RUN, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_complete_from_the_server_is_the_greedy_reference_without_torch(lm, server):
    url, served = server
    prompt = "The three primary colors are"
    want = lm.tokenizer.decode(reference(lm, encode_prompt(lm, prompt), 12, CTX))
    r = cli("complete", prompt, "-n", 12, "--temp", 0, "--server", url, "--api-key", KEY, "-v")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "TORCH IMPORTED" not in r.stderr
    assert "generated 12 tokens" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    named = cli("complete", served.names[0], prompt, "-n", 12, "--temp", 0, "--server", url + "/v1/",
                "--api-key", KEY, "--json")
    record = json.loads(named.stdout)
    assert record["text"] == want and record["generated_tokens"] == 12 and record["finish_reason"] == "length"
    assert record["prompt_tokens"] == len(encode_prompt(lm, prompt))


def test_stop_strings_and_seeded_sampling_reach_the_server(lm, server):
    url, served = server
    prompt = "1, 2, 3, 4,"
    whole = lm.tokenizer.decode(reference(lm, encode_prompt(lm, prompt), 16, CTX))
    stop = whole.strip()[2:4]  # a string the greedy text holds, not at its start
    r = cli("complete", prompt, "-n", 16, "--temp", 0, "--stop", stop, "--server", url, "--api-key", KEY)
    assert r.returncode == 0 and r.stdout == whole[:whole.index(stop)] + "\n", (r.stdout, whole, stop)
    runs = [cli("complete", "Once upon a time", "-n", 10, "--temp", 1.0, "--seed", 7, "--server", url, "--api-key", KEY)
            for _ in range(2)]
    assert runs[0].returncode == 0 and runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()


@pytest.mark.parametrize("case,args,needle", [
    ("no server", ["--server", "127.0.0.1:{free}"], "no server at http://127.0.0.1:"),
    ("wrong key", ["--server", "{url}", "--api-key", "nope"], "answered 401"),
    ("unknown model", ["nosuchmodel", "--server", "{url}", "--api-key", KEY], "nosuchmodel"),
    ("a local option", ["--server", "{url}", "--device", "cuda", "--tp", "2"], "--device, --tp cannot be used with --server"),
    ("out of range", ["--server", "{url}", "--api-key", KEY, "--top-p", "3"], "top_p"),
])
def test_errors_are_one_line(server, case, args, needle):
    url, _ = server
    args = [a.format(url=url, free=free_port()) for a in args]
    model = [args.pop(0)] if not args[0].startswith("--") else []
    r = cli("complete", *model, "hello", "-n", 4, *args)
    lines = r.stderr.replace("TORCH IMPORTED\n", "").strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and needle in lines[0], (case, r.stderr)
    assert "TORCH IMPORTED" not in r.stderr, case


def test_api_key_needs_server():
    r = cli("complete", "hello", "--api-key", "k")
    assert r.returncode == 2 and "--api-key goes with --server" in r.stderr


def test_request_body_and_address():
    body = completion_body("m", "p", -1, SamplingSettings(temperature=0, seed=3), ("x",))
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "max_tokens" not in body and body["seed"] == 3 and body["stop"] == ["x"] and body["temperature"] == 0
    assert server_url("localhost:8080/v1/") == "http://localhost:8080"
    assert server_url("https://h/") == "https://h"
    with pytest.raises(LocalLLMError, match="http"):
        server_url("ftp://h")


class _Fake:
    """A server that answers every POST with these SSE lines (then, after `pause` seconds, closes)."""

    def __init__(self, lines: list[str], pause: float = 0.0):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for line in lines:
                    self.wfile.write(f"{line}\n\n".encode())
                    self.wfile.flush()
                time.sleep(pause)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


CHUNK = 'data: {"choices": [{"text": "Hi", "finish_reason": null}]}'


@pytest.mark.parametrize("lines,pause,needle", [
    ([CHUNK], 0.0, "ended the stream before its end"),
    ([CHUNK, "data: {not json"], 0.0, "not JSON"),
    ([CHUNK], 3.0, "stopped streaming"),
    ([CHUNK, 'data: {"error": {"message": "out of memory"}}'], 0.0, "out of memory"),
])
def test_a_stream_that_breaks_off_is_one_error(monkeypatch, lines, pause, needle):
    """A server that closes early, sends a chunk that is not JSON, falls silent past the timeout or
    reports an error mid-stream: the pieces before it, then one LocalLLMError naming it."""
    from localllm import client

    monkeypatch.setattr(client, "TIMEOUT", 1.0)
    fake = _Fake(lines, pause)
    try:
        got = []
        with pytest.raises(LocalLLMError, match=needle):
            for piece in client.stream_completion(fake.url, {"prompt": "x"}, client.RemoteStats()):
                got.append(piece)
        assert got == ["Hi"]
    finally:
        fake.close()
