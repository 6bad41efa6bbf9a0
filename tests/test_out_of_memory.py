"""Running out of memory, anywhere in the CLI, is one `error:` line naming the device and what to try,
exit status 1, no traceback, and no output file or partial left (the writers delete their temporary
file on any exception). The allocations fail for real on the CPU (torch's own allocator error, Python's
MemoryError from numpy); CUDA's error is raised with the text torch gives it (tests/gpu/ has the real one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import tiny_models as tm
from tiny_gguf import write_gguf
from cli_helpers import assert_one_error
from cli_helpers import invoke_quantize as invoke
from localllm.commands import quantize_cmd, quantize_native
from localllm.errors import out_of_memory

# torch 2.x's text for a CUDA allocation that failed (c10/cuda/CUDACachingAllocator.cpp), as an H100 printed it
CUDA_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.04 GiB is free. Including non-PyTorch memory, this process has 78.14 GiB memory in use. Of the "
             "allocated memory 77.50 GiB is allocated by PyTorch, and 12.3 MiB is reserved by PyTorch but unallocated.")


def cpu_alloc_fails(*args, **kwargs):
    return torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: the allocator refuses (RuntimeError)


def numpy_alloc_fails(*args, **kwargs):
    return np.empty(2**60, np.uint8)  # MemoryError


def cuda_alloc_fails(*args, **kwargs):
    raise torch.OutOfMemoryError(CUDA_TEXT)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tm.CASES["llama"], tmp_path_factory.mktemp("oom") / "llama-f32.gguf")


def encode_then(fail, real):
    """An encoder (real: quantize_cmd.encode, quantize_native.encode_tensor) that encodes the first tensor,
    then fails: the writer has a partial file open."""
    calls = []

    def encode(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) if len(calls) == 1 else fail()
    return encode


@pytest.mark.parametrize("fail, needle", [
    (cuda_alloc_fails, "out of GPU memory on cuda allocating 2.00 GiB (GPU 0: 79.19 GiB, 1.04 GiB free): try --device cpu"),
    (cpu_alloc_fails, "out of memory on the CPU allocating 1073741824.00 GiB: try a smaller --ctx"),
    (numpy_alloc_fails, "out of memory on the CPU: try a smaller --ctx"),
])
def test_out_of_memory_while_writing(model, tmp_path, monkeypatch, fail, needle):
    # both writers: the torch path's and the torch-free preset path's (which a GGUF on the CPU takes)
    monkeypatch.setattr(quantize_cmd, "encode", encode_then(fail, quantize_cmd.encode))
    monkeypatch.setattr(quantize_native, "encode_tensor", encode_then(fail, quantize_native.encode_tensor))
    out = tmp_path / "out.gguf"
    result = invoke(model, out, "--type", "Q8_0", "--device", "cpu")
    assert_one_error(result, needle)
    assert result.exit_code == 1
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its .out.gguf.PID.XXXX.partial


def test_out_of_memory_while_planning(model, tmp_path, monkeypatch):
    """--target-bpw: the calibration passes (where issue 20's H100 run failed) run out."""
    from localllm import mixed

    monkeypatch.setattr(mixed, "fisher_rows", cuda_alloc_fails)
    assert_one_error(invoke(model, tmp_path / "out.gguf", "--target-bpw", "6", "--device", "cpu"),
                     "out of GPU memory on cuda allocating 2.00 GiB")
    assert list(tmp_path.iterdir()) == []


def test_other_runtime_errors_are_not_hidden(model, tmp_path, monkeypatch):
    """A bug stays a bug: a RuntimeError that is no allocation failure propagates with its traceback."""
    from localllm.cli import app

    def broken(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(quantize_cmd, "encode", broken)
    monkeypatch.setattr(quantize_native, "encode_tensor", broken)
    result = CliRunner().invoke(app, ["quantize", str(model), str(tmp_path / "out.gguf"), "--type", "Q8_0"])
    assert isinstance(result.exception, RuntimeError) and "shapes" in str(result.exception)


def test_message_without_torchs_details():
    """An OutOfMemoryError whose text lacks the sizes still names the device and the remedy."""
    assert out_of_memory(torch.OutOfMemoryError("out of memory")).startswith("out of GPU memory on cuda: try --device cpu")
    assert out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 8 GiB)")).startswith("out of GPU memory on mps")
    assert out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory")) is None
