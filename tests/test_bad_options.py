"""Bad option values through the real command in this process (typer's runner): each must give exactly
one `error:` line naming the option and its valid range, a non-zero exit and no traceback, before any
model loads. Also: -n -1 runs to the end of the context with a note, and NaN or Inf weights are named."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from _bad_files import TINY, tiny_tensors, write_gguf, write_tiny_model
from test_bad_input import assert_one_error_line

NO_MODEL = "no-such-model-7b"  # a check that ran after the load would say "no such file" instead

# case -> (arguments, words the one error line must contain)
CASES = {
    "temp_negative": (["complete", NO_MODEL, "hi", "--temp", "-1"], ["--temp", "at least 0"]),
    "temp_nan": (["complete", NO_MODEL, "hi", "--temp", "nan"], ["--temp", "finite", "nan"]),
    "temp_inf": (["complete", NO_MODEL, "hi", "--temp", "inf"], ["--temp", "finite", "inf"]),
    "top_p_2": (["complete", NO_MODEL, "hi", "--top-p", "2"], ["--top-p must be between 0 and 1, got 2"]),
    "top_p_negative": (["complete", NO_MODEL, "hi", "--top-p", "-1"], ["--top-p", "between 0 and 1", "-1"]),
    "top_p_nan": (["chat", NO_MODEL, "--top-p", "nan"], ["--top-p", "between 0 and 1", "nan"]),
    "top_k_negative": (["complete", NO_MODEL, "hi", "--top-k", "-5"], ["--top-k", "at least 0", "-5"]),
    "min_p_nan": (["complete", NO_MODEL, "hi", "--min-p", "nan"], ["--min-p", "between 0 and 1"]),
    "penalty_inf": (["complete", NO_MODEL, "hi", "--repeat-penalty", "inf"], ["--repeat-penalty", "finite"]),
    "last_n": (["complete", NO_MODEL, "hi", "--repeat-last-n", "-2"], ["--repeat-last-n", "at least -1"]),
    "seed_huge": (["complete", NO_MODEL, "hi", "--seed", str(2**64)], ["--seed", "between 0 and 2^64-1"]),
    "seed_negative": (["chat", NO_MODEL, "--seed", "-3"], ["--seed", "between 0"]),
    "ctx_0": (["complete", NO_MODEL, "hi", "--ctx", "0"], ["--ctx", "at least 2", "got 0"]),
    "ctx_1_chat": (["chat", NO_MODEL, "--ctx", "1"], ["--ctx", "at least 2", "got 1"]),
    "n_0": (["complete", NO_MODEL, "hi", "-n", "0"], ["-n/--max-tokens", "at least 1", "-1", "got 0"]),
    "n_minus_2": (["chat", NO_MODEL, "-n", "-2"], ["--max-tokens", "got -2"]),
    "threads_0": (["complete", NO_MODEL, "hi", "--threads", "0"], ["--threads", "at least 1"]),
    "draft_max_0": (["complete", NO_MODEL, "hi", "--lookup", "2", "--draft-max", "0"], ["--draft-max", "at least 1"]),
    "draft_min_p": (["complete", NO_MODEL, "hi", "--lookup", "2", "--draft-min-p", "nan"], ["--draft-min-p", "between 0 and 1"]),
    "lookup_negative": (["complete", NO_MODEL, "hi", "--lookup", "-1"], ["--lookup", "at least 0"]),
    "draft_dtype": (["complete", NO_MODEL, "hi", "--draft", "self:Q4_0", "--draft-dtype", "int3"], ["--draft-dtype int3"]),
    "not_a_number": (["complete", NO_MODEL, "hi", "--top-k", "abc"], ["--top-k", "complete --help"]),
    "unknown_option": (["complete", NO_MODEL, "hi", "--bogus"], ["--bogus"]),
    "bench_p0_n0": (["bench", NO_MODEL, "-p", "0", "-n", "0"], ["-p/--n-prompt", "at least 1", "'0'"]),
    "bench_p_abc": (["bench", NO_MODEL, "-p", "abc"], ["-p/--n-prompt", "'abc'"]),
    "bench_p_negative": (["bench", NO_MODEL, "-p", "-5"], ["-p/--n-prompt", "'-5'"]),
    "bench_p_empty": (["bench", NO_MODEL, "-p", ","], ["-p/--n-prompt"]),
    "bench_r_0": (["bench", NO_MODEL, "-r", "0"], ["-r/--repetitions", "at least 1", "got 0"]),
    "bench_r_negative": (["bench", NO_MODEL, "-r", "-2"], ["-r/--repetitions", "got -2"]),
    "bench_d_negative": (["bench", NO_MODEL, "-d", "-3"], ["-d/--depth", "'-3'"]),
    "bench_b_garbage": (["bench", NO_MODEL, "-b", "x2"], ["-b/--batch", "'x2'"]),
    "bench_spec_n0": (["bench", NO_MODEL, "--lookup", "2", "-n", "0"], ["-n/--n-gen", "at least 1"]),
    "ppl_ctx": (["perplexity", NO_MODEL, "-f", "x.txt", "--ctx", "2"], ["--ctx", "at least 3"]),
    "ppl_chunks": (["perplexity", NO_MODEL, "-f", "x.txt", "--chunks", "0"], ["--chunks", "at least 1"]),
}


def invoke(args):
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})
    # Anything but the CLI's own exit would have been a traceback outside the test runner.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_option_gives_one_line(name):
    args, needles = CASES[name]
    assert_one_error_line(invoke(args), needles)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("opts") / "tiny.gguf")


def test_bench_beyond_context(tiny):
    """-p 100000 on a model of 128 tokens: one line naming the numbers, not minutes of prefill."""
    r = invoke(["bench", tiny, "-p", "100000", "-n", "4", "-r", "1"])
    assert_one_error_line(r, ["prompt 100000", "generated 4", "context is 128"])


def test_threads_capped_with_a_note(tiny):
    import os

    r = invoke(["complete", tiny, "the", "-n", "2", "--temp", "0", "--threads", "10000"])
    assert r.returncode == 0, r.stderr
    assert f"--threads 10000 is more than the {os.cpu_count()} logical cores" in r.stderr


def test_ctx_capped_with_a_note(tiny):
    r = invoke(["complete", tiny, "the", "-n", "2", "--temp", "0", "--ctx", "100000"])
    assert r.returncode == 0, r.stderr
    assert f"--ctx 100000 is more than the model's context: using {TINY['ctx']}" in r.stderr


def test_n_minus_one_runs_until_the_context_is_full(tiny):
    """The tiny model never emits its end token greedily here: -n -1 fills the context, and says so."""
    from localllm.generate import Stats, generate
    from localllm.runner import open_model
    from localllm.cache import make_cache
    from localllm.sampling import Sampler
    from localllm.settings import SamplingSettings

    lm = open_model(str(tiny), "cpu", "float32")
    cache = make_cache(lm.config, 16, dtype=torch_float32(), device="cpu")
    stats = Stats()
    prompt = [1, 2, 3]
    ids = list(generate(lm.runtime, cache, prompt, Sampler(SamplingSettings(temperature=0)), -1, (), stats))
    assert len(ids) == 16 - len(prompt) and stats.context_full == 16
    r = invoke(["complete", tiny, "the", "-n", "-1", "--temp", "0", "--ctx", "16"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "generation stopped: the context (16 tokens) is full" in r.stderr


def torch_float32():
    import torch

    return torch.float32


def write_poisoned(path: Path, value: float) -> Path:
    """The tiny model with one weight of blk.1.ffn_up.weight set to value (NaN or Inf)."""
    up = tiny_tensors()["blk.1.ffn_up.weight"]
    up[3, 5] = value
    return write_gguf(path, tensors={"blk.1.ffn_up.weight": up})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weights_are_named(tmp_path, value):
    path = write_poisoned(tmp_path / "poisoned.gguf", value)
    r = invoke(["complete", path, "the the the", "-n", "4", "--temp", "0"])
    assert_one_error_line(r, ["not finite", "blk.1.ffn_up.weight"])
    r = invoke(["complete", path, "the the the", "-n", "4", "--temp", "0", "--lookup", "2"])  # speculative
    assert_one_error_line(r, ["not finite", "blk.1.ffn_up.weight"])
