"""The backends, and the one place a model's device picks one (load.load_model calls it once).

    cpu   backends/cpu.py   C++ kernels on the file's blocks, one C++ call per decoded token
    cuda  backends/cuda.py  Triton kernels, CUDA graphs for decode, verify and repeated prompts
    mps   runtime.Runtime   the portable torch backend (also the reference the others are tested against)
"""

from __future__ import annotations

import torch

from ..runtime import Runtime


def runtime_class(device: str | torch.device) -> type[Runtime]:
    kind = torch.device(device).type
    if kind == "cuda":
        from .cuda import CudaRuntime  # Triton is imported only where it runs

        return CudaRuntime
    if kind == "cpu":
        from .cpu import CpuRuntime

        return CpuRuntime
    return Runtime
