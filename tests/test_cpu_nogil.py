"""The C++ CPU kernels run without the GIL (kernels/cpu_bind.cpp's call guard): while the engine thread
is inside a kernel, another Python thread runs (`serve`'s HTTP thread parsing requests and streaming
replies during a decode step).

Oracle: a Python thread that only records the time, over and over, needs the GIL for each record; if the
kernel call held it, no record could fall inside the call (beyond the interpreter's 5 ms switch
interval at its edges)."""

from __future__ import annotations

import sys
import threading
import time

import gguf
import pytest
import torch

from localllm.kernels.cpu import load_extension
from localllm.settings import DEFAULT_CPU

F32 = int(gguf.GGMLQuantizationType.F32)
EDGE = 3 * sys.getswitchinterval()  # a record this close to the call's ends may come from its Python edges


@pytest.fixture(scope="module")
def ext():
    ext = load_extension(DEFAULT_CPU.cache_dir)
    assert ext is not None, "the C++ CPU kernels did not build"
    return ext


def _long_gemm(ext):
    """A call of a one-thread dense product that takes >= 60 ms here (rows doubled until it does)."""
    g = torch.Generator().manual_seed(0)
    n = k = 1024
    w = torch.randn(n, k, generator=g).view(torch.uint8).reshape(n, -1).contiguous()
    for t in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        x = torch.randn(t, k, generator=g)
        began = time.perf_counter()
        ext.dense_gemm(x, w, F32, n, k, 1)
        took = time.perf_counter() - began
        if took >= 0.06:
            return lambda x=x: ext.dense_gemm(x, w, F32, n, k, 1)
    pytest.fail(f"the largest product took only {took * 1e3:.0f} ms")


def test_other_threads_run_during_a_kernel(ext):
    call = _long_gemm(ext)
    stamps: list[float] = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    time.sleep(0.01)  # the ticker is running
    began = time.perf_counter()
    call()
    ended = time.perf_counter()
    done.set()
    thread.join()
    inside = [s for s in stamps if began + EDGE < s < ended - EDGE]
    assert inside, f"no other thread ran during a {1e3 * (ended - began):.0f} ms kernel call (the GIL was held)"
