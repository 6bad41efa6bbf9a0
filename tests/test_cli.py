"""The `localllm` command as a user runs it: complete streams and reports speeds, info describes the
default model (checked against the gguf package's own reading), tokenize prints llama.cpp's ids, every
command explains its options, and a seed fixes the sampled text.

The slow runs (each a process of its own) start together in one module fixture; the tests read them.
One process per command keeps the installed command covered (complete streaming the default model,
complete with a seed, info, tokenize); the other runs go through typer's runner in this process (no
start-up: a Python and torch import each), the seeded ones on the tiny model (its size adds nothing to
seeding) and compared with the process's text (the same seed gives the same text in another process).
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from typer.testing import CliRunner

from _bad_files import VOCAB_DIR, default_model, parallel_jobs, run_cli, start_cli, write_tiny_model

PROMPT = "Once upon a time, there was a little"
SPM_VOCAB = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
DEFAULT_TEXT = "<|im_start|>user\nHi there, 😁 ünïcödé!"
SPM_TEXT = "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～"  # one of llama.cpp's cases


class Streamed:
    """Runs the CLI and reads its stdout as it comes, noting per chunk whether it was still running."""

    def __init__(self, *args: str):
        self.proc = start_cli(*args)
        self.chunks: list[tuple[bytes, bool]] = []  # (bytes, process still running)
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 1 << 16):
            self.chunks.append((chunk, self.proc.poll() is None))
        self.stderr = self.proc.stderr.read().decode()
        self.proc.wait(timeout=600)

    def result(self) -> tuple[str, str, int]:
        return b"".join(c for c, _ in self.chunks).decode(), self.stderr, self.proc.returncode


def seeded(tiny, seed: int) -> list[str]:
    return ["complete", tiny, PROMPT, "-n", "16", "--temp", "0.8", "--seed", str(seed)]


def invoke(*args: str):
    """The command in this process through typer's runner, as a CompletedProcess-like result."""
    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = default_model()
    tiny = write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    jobs = {  # the slowest first
        "stream": lambda: Streamed("complete", PROMPT, "-n", "8", "--temp", "0", "--verbose"),
        "info": lambda: run_cli("info"),
        "seed1": lambda: run_cli(*seeded(tiny, 1234)),
        "ids": lambda: run_cli("tokenize", SPM_VOCAB, SPM_TEXT, "--ids"),
    }
    with ThreadPoolExecutor(parallel_jobs()) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        out = {
            "seed1_again": invoke(*seeded(tiny, 1234)),
            "seed2": invoke(*seeded(tiny, 99)),
            "ids_default": invoke("tokenize", model, DEFAULT_TEXT, "--ids"),
            "ids_bos": invoke("tokenize", SPM_VOCAB, SPM_TEXT, "--ids", "--bos"),
        }
        out.update({name: f.result() for name, f in futures.items()})
    out["model"] = model
    return out


def ok(result) -> str:
    if isinstance(result, Streamed):
        stdout, stderr, rc = result.result()
    else:  # a process's result, or typer's runner's (exit_code)
        stdout, stderr = result.stdout, result.stderr
        rc = result.returncode if hasattr(result, "returncode") else result.exit_code
    assert rc == 0 and "Traceback" not in stderr, f"exit {rc}\n{stderr}"
    return stdout


# ---- complete


def test_complete_streams_pieces(runs):
    s = runs["stream"]
    text = ok(s)
    assert text.endswith("\n") and text.strip(), repr(text)
    pieces = [c for c, _ in s.chunks if c.strip()]
    # Streaming: text arrives in several writes while the process runs, not once at the end.
    assert len(pieces) >= 2, s.chunks
    assert s.chunks[0][1], "the first text came only after the process had ended"


def test_complete_verbose_speeds(runs):
    _, stderr, rc = runs["stream"].result()
    assert rc == 0
    prompt = re.search(r"prompt (\d+) tokens, ([\d.]+) tokens/s", stderr)
    gen = re.search(r"generated (\d+) tokens, ([\d.]+) tokens/s", stderr)
    assert prompt and gen, stderr
    assert int(prompt.group(1)) > 0 and float(prompt.group(2)) > 0
    assert 0 < int(gen.group(1)) <= 8 and float(gen.group(2)) > 0


def test_same_seed_same_text(runs):
    a, b = ok(runs["seed1"]), ok(runs["seed1_again"])
    assert a.strip() and a == b


def test_different_seed_different_text(runs):
    # 16 tokens at temperature 0.8: two seeds agreeing everywhere is very unlikely.
    assert ok(runs["seed1"]) != ok(runs["seed2"])


# ---- info


def info_rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*(\S.*?)\s{2,}(\S.*?)\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.fixture(scope="module")
def reader(runs):
    """The default model as the gguf package itself reads it (no localllm code involved)."""
    import gguf

    return gguf.GGUFReader(str(runs["model"]))


def test_info_default_model(runs, reader):
    stdout = ok(runs["info"])
    rows = info_rows(stdout)
    assert rows["architecture"] == "llama"
    # Parameters: every tensor's elements, counted here from the shapes the gguf package reads.
    expected = sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)
    assert rows["parameters"].startswith(f"{expected:,} ")
    types = dict(item.rsplit(" ", 1) for item in rows["tensor types"].split(", "))
    assert int(types["Q4_1"]) > 0 and int(types["Q8_0"]) > 0
    assert sum(int(n) for n in types.values()) == len(reader.tensors)
    assert rows["context length"] == "8192"
    assert "bpe" in rows["tokenizer"] and "smollm" in rows["tokenizer"]
    # SmolLM2's own template (not a built-in one): named as the file's, with its first line
    assert rows["chat template"].startswith("from the file: {% for message in messages %}")
    # The path is shown whole (folded, never cut with an ellipsis), whatever the width.
    assert str(runs["model"]) in "".join(stdout.split())


# ---- tokenize


def expected_spm_ids() -> list[int]:
    """llama.cpp's ids for SPM_TEXT from the .inp/.out pair of the vocab file."""
    texts = SPM_VOCAB.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = SPM_VOCAB.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    return [int(t) for t in lines[texts.index(SPM_TEXT)].split()]


def test_tokenize_ids_vocab_only(runs):
    from localllm.load import load_tokenizer

    stdout = ok(runs["ids"])
    assert stdout.count("\n") == 1 and stdout.endswith("\n"), repr(stdout)
    ids = json.loads(stdout)
    assert ids == expected_spm_ids()
    assert ids == load_tokenizer(str(SPM_VOCAB)).encode(SPM_TEXT, add_bos=False)


def test_tokenize_bos(runs):
    ids = json.loads(ok(runs["ids_bos"]))
    assert ids == [1] + expected_spm_ids()  # <s> is id 1 in this vocabulary


def test_tokenize_default_model_matches_library(runs, reader):
    """The command prints exactly what the model's own tokenizer gives (special tokens not parsed)."""
    from localllm.gguf_file import read_metadata_fields
    from localllm.tokenizer import load_gguf_tokenizer

    ids = json.loads(ok(runs["ids_default"]))
    tok = load_gguf_tokenizer(read_metadata_fields(reader))
    assert ids == tok.encode(DEFAULT_TEXT, add_bos=False, parse_special=False)
    assert tok.decode(ids) == DEFAULT_TEXT


# ---- help


@pytest.mark.parametrize(
    "command, options",
    [
        (
            "complete",
            [
                "--max-tokens",
                "--temp",
                "--top-k",
                "--top-p",
                "--min-p",
                "--repeat-penalty",
                "--repeat-last-n",
                "--seed",
                "--ctx",
                "--stop",
                "--device",
                "--dtype",
                "--verbose",
            ],
        ),
        ("info", ["--help"]),
        ("tokenize", ["--ids", "--bos", "--special"]),
    ],
)
def test_help_lists_options(command, options):
    r = run_cli(command, "--help")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "Usage" in r.stdout
    for option in options:
        assert option in r.stdout, f"{option} missing from `localllm {command} --help`"


def test_top_level_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for command in ("complete", "info", "tokenize", "pull", "list", "rm"):
        assert command in r.stdout
