"""`localllm quantize` refuses bad input in one line, before any expensive work, and leaves no file.

Each case asserts: a non-zero exit, exactly one `error:` line naming the problem, no traceback, and
nothing left in the output folder (neither OUT nor a `.OUT.*.partial`). The refusals that could come
after loading or calibrating must come before: the model loader and the planner are replaced by
functions that fail the test if called. The process boundary matters only for signals: those tests
start the real command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tiny_gguf import add_tokenizer, write_gguf
from tiny_hf import write_hf_folder
from tiny_spec import Q, TinySpec
from _bad_files import default_model, start_cli
from cli_helpers import assert_one_error
from cli_helpers import invoke_quantize as invoke
from localllm.commands import evaluate as ev
from localllm import load, mixed
from localllm.errors import LocalLLMError
from localllm.quantize_checks import check_tensors
from localllm.commands.quantize_cmd import quantize_model, read_source
from localllm.signals import Terminated, sigterm_interrupts
from localllm.quantize.partial import make_partial, remove_stale_partials

SMALL = TinySpec("llama", dim=64, ffn_dim=256, n_heads=4, n_kv_heads=2, n_layers=2, seed=5)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_gguf(SMALL, tmp_path_factory.mktemp("bad-quantize") / "small-f32.gguf")


@pytest.fixture
def no_expensive_work(monkeypatch):
    """Loading the model, measuring an imatrix or planning: each fails the test if reached."""
    def reached(*args, **kwargs):
        raise AssertionError("expensive work started before the input was checked")

    monkeypatch.setattr(load, "load_model", reached)
    monkeypatch.setattr(mixed, "plan_mixed", reached)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def refused(tmp_path: Path, needle: str, *args) -> None:
    """One error line naming `needle`, and the folder holds what it held before."""
    before = listing(tmp_path)
    assert_one_error(invoke(*args), needle)
    assert listing(tmp_path) == before


# ---- the output path

def test_output_paths(small, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "a_dir").mkdir()
    refused(tmp_path, "is not a folder", small, a_file / "out.gguf", "--type", "Q8_0")
    refused(tmp_path, "output folder does not exist", small, tmp_path / "missing" / "out.gguf", "--type", "Q8_0")
    refused(tmp_path, "is a folder", small, tmp_path / "a_dir", "--type", "Q8_0")
    refused(tmp_path, "is the input file", small, small, "--type", "Q8_0")


def test_output_folder_not_writable(small, tmp_path):
    """/proc takes no new files, for root too (the tests run as root: a chmod would not stop it)."""
    assert_one_error(invoke(small, "/proc/out.gguf", "--type", "Q8_0"), "cannot write in output folder /proc")


# ---- option values, refused before anything is loaded

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "33", "1e308"])
def test_target_bpw_values(small, tmp_path, no_expensive_work, value):
    refused(tmp_path, "--target-bpw must be a positive number", small, tmp_path / "o.gguf", "--target-bpw", value)


@pytest.mark.parametrize("target", [("--target-bpw", "0.5"), ("--target-size", "1K"), ("--target-size", "5000")])
def test_unreachable_target_refused_before_calibration(small, tmp_path, no_expensive_work, target):
    start = time.perf_counter()
    refused(tmp_path, "target too small", small, tmp_path / "o.gguf", *target)
    assert time.perf_counter() - start < 10  # no calibration ran (it takes ~15 s on the default model)


def test_unreachable_target_names_the_smallest(small, tmp_path):
    """The smallest size named is the real edge: just above it the plan is made, just below refused."""
    result = invoke(small, tmp_path / "o.gguf", "--target-bpw", "0.5")
    smallest = float(result.stderr.split("reaches is")[1].split()[0])
    assert 2.625 < smallest < 4.5  # Q2_K's bpw for the 256-value rows, Q4_0's for the 64-value ones
    assert_one_error(invoke(small, tmp_path / "o.gguf", "--target-bpw", smallest - 0.001), "target too small")
    result = invoke(small, tmp_path / "o.gguf", "--target-bpw", smallest + 0.001)
    assert result.exit_code == 0, result.stderr


def test_imatrix_paths(small, tmp_path, no_expensive_work):
    (tmp_path / "a_dir").mkdir()
    refused(tmp_path, "--imatrix folder does not exist", small, tmp_path / "o.gguf", "--type", "Q4_0",
            "--imatrix", tmp_path / "missing" / "x.imatrix")
    refused(tmp_path, "is a folder", small, tmp_path / "o.gguf", "--type", "Q4_0", "--imatrix", tmp_path / "a_dir")
    refused(tmp_path, "--imatrix folder does not exist", small, tmp_path / "o.gguf", "--target-bpw", "5",
            "--imatrix", tmp_path / "missing" / "x.imatrix")


@pytest.mark.parametrize("text, needle", [("", "is empty"), (" \n\t\n", "is empty"),
                                          ("a few words only", "calibration text too short")])
def test_calibration_text(small, tmp_path, no_expensive_work, text, needle):
    calib = tmp_path / "calib.txt"
    calib.write_text(text)
    refused(tmp_path, needle, small, tmp_path / "o.gguf", "--target-bpw", "5", "--calib", calib)
    refused(tmp_path, needle, small, tmp_path / "o.gguf", "--type", "Q4_0", "--imatrix",
            tmp_path / "x.imatrix", "--calib", calib)


def test_calibration_text_not_utf8(small, tmp_path, no_expensive_work):
    calib = tmp_path / "calib.txt"
    calib.write_bytes(b"caf\xe9 " * 1000)
    refused(tmp_path, "is not UTF-8", small, tmp_path / "o.gguf", "--target-bpw", "5", "--calib", calib)


# ---- inputs the loader would refuse are not written

def test_vocab_only_input(tmp_path):
    """A tokenizer and no tensors (as llama.cpp's ggml-vocab-*.gguf files): was "0.0000 bits per weight"."""
    vocab = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(vocab), "llama")
    add_tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    refused(tmp_path, "the input has no weights", vocab, tmp_path / "o.gguf", "--type", "Q8_0")


def test_shapes_disagree_with_config(tmp_path):
    """attn_k of 4 heads where the config says 2 kv heads: was written, then refused by the loader."""
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((64, 64), dtype=np.float32)
    src = write_gguf(SMALL, tmp_path / "wide_k.gguf", raw={"blk.1.attn_k.weight": (wide, Q.F32)})
    refused(tmp_path, "tensor 'blk.1.attn_k.weight' has shape (64, 64), expected (32, 64) from the config",
            src, tmp_path / "o.gguf", "--type", "Q8_0")


def test_safetensors_shapes_disagree_with_config(tmp_path):
    """The same check for a safetensors folder: its config.json says 4 kv heads, the weights hold 2."""
    import json

    hf = write_hf_folder(SMALL, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    refused(tmp_path, "tensor 'model.layers.0.self_attn.k_proj.weight' has shape (32, 64), expected (64, 64) from the config",
            hf, tmp_path / "o.gguf", "--type", "Q8_0")


def test_non_finite_weights_leave_no_file(tmp_path):
    """Found while encoding (after the header is written): one line, and the partial file removed."""
    nan = np.full((256, 64), np.nan, dtype=np.float32)
    src = write_gguf(SMALL, tmp_path / "nan.gguf", raw={"blk.1.ffn_up.weight": (nan, Q.F32)})
    refused(tmp_path, "cannot quantize tensor 'blk.1.ffn_up.weight' to Q8_0", src, tmp_path / "o.gguf", "--type", "Q8_0")


def test_check_tensors_names_the_tensor(small):
    src = read_source(small, None)
    infos = [t.info for t in src.tensors]
    with pytest.raises(LocalLLMError, match="unexpected tensor 'blk.2.attn_q.weight' for this config \\(llama, 2 layers"):
        check_tensors(src.config, infos + [infos[3].__class__("blk.2.attn_q.weight", (64, 64), infos[3].source)])
    with pytest.raises(LocalLLMError, match="missing tensor 'blk.0.ffn_up.weight'"):
        check_tensors(src.config, [t for t in infos if t.name != "blk.0.ffn_up.weight"])
    check_tensors(src.config, infos)  # the whole model passes


# ---- partial files left by killed writers

def test_stale_partials_removed_by_the_next_writer(small, tmp_path):
    out = tmp_path / "out.gguf"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = tmp_path / f".out.gguf.{2**30}.abcd1234.partial"  # no process has this pid
        old = tmp_path / ".out.gguf.abcd1234.partial"  # an older version's name: no pid
        live = tmp_path / f".out.gguf.{sleeper.pid}.abcd1234.partial"  # a writer still running
        fresh = tmp_path / ".out.gguf.efgh5678.partial"
        other = tmp_path / f".other.gguf.{2**30}.abcd1234.partial"  # another OUT's
        for p in (dead, old, live, fresh, other):
            p.write_bytes(b"x" * 100)
        hours_ago = time.time() - 7 * 3600
        os.utime(old, (hours_ago, hours_ago))
        quantize_model(str(small), out, "Q8_0", progress=False)
        assert listing(tmp_path) == sorted([out.name, live.name, fresh.name, other.name])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_partials(out, 3600) == [live]  # its writer is gone now


def test_partial_names_carry_the_pid(tmp_path):
    p = make_partial(tmp_path / "x.gguf")
    assert p.name.startswith(f".x.gguf.{os.getpid()}.") and p.name.endswith(".partial")
    assert remove_stale_partials(tmp_path / "x.gguf", 3600) == []  # ours, alive


def test_logits_writer_removes_stale_partials(tmp_path):
    path = tmp_path / "base.logits"
    dead = tmp_path / f".base.logits.{2**30}.abcd1234.partial"
    dead.write_bytes(b"x")
    writer = ev.LogitsWriter(path, ev.make_chunks(list(range(100)), 16), vocab=50)
    assert writer.partial.name.startswith(f".base.logits.{os.getpid()}.")
    writer.abort()
    assert listing(tmp_path) == []


# ---- signals through the real command

def wait_for_partial(proc: subprocess.Popen, folder: Path, timeout: float = 240) -> Path:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        found = list(folder.glob(".out.gguf.*.partial"))
        if found and found[0].stat().st_size > 0:
            return found[0]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no partial file appeared: {proc.communicate()}")


def test_sigterm_cleans_up(tmp_path):
    out = tmp_path / "out.gguf"
    proc = start_cli("quantize", default_model(), out, "--type", "Q8_0", "--allow-requantize")
    wait_for_partial(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert stderr.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in stderr
    assert listing(tmp_path) == []


def test_sigkill_partial_removed_by_next_run(small, tmp_path):
    out = tmp_path / "out.gguf"
    proc = start_cli("quantize", default_model(), out, "--type", "Q8_0", "--allow-requantize")
    partial = wait_for_partial(proc, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert listing(tmp_path) == [partial.name]  # nothing could clean up after SIGKILL
    result = invoke(small, out, "--type", "Q8_0")
    assert result.exit_code == 0, result.stderr
    assert listing(tmp_path) == [out.name]


def test_sigterm_during_save_logits_leaves_nothing(small, tmp_path, monkeypatch):
    """perplexity --save-logits: SIGTERM (the real handler, signalled to this process) mid-run."""
    lm = load.load_model(str(small), "cpu", torch.float32)
    chunks = ev.make_chunks(list(range(1, 200)), 16)
    real, calls = ev.chunk_logits, []

    def terminated_on_second(lm_, ids):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
            raise AssertionError("SIGTERM was not turned into Terminated")
        return real(lm_, ids)

    monkeypatch.setattr(ev, "chunk_logits", terminated_on_second)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_interrupts():
        for _ in ev.evaluate_steps(lm, chunks, batch=1, save_to=tmp_path / "x.logits"):
            pass
    assert len(calls) == 2 and listing(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is removed again
