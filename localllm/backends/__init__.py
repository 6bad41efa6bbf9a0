"""The backends, and the one place a model's device picks one (load.load_model calls it once).

    cpu   backends/cpu.py   C++ kernels on the file's blocks, one C++ call per decoded token
    cuda  backends/cuda.py  Triton kernels, CUDA graphs for decode, verify and repeated prompts
    mps   runtime.Runtime   the portable torch backend (also the reference the others are tested against)

A config whose layers are not the Llama layer (ModelConfig.llama_layer False: Gemma, Phi-3, MoE, ...)
runs where its backend's fast path covers it, else the model's torch forward: CUDA's decode step and
graphs implement the dense families' fields (backends/cuda.py covers: Gemma 2/3, Phi-3, SmolLM3, gpt-oss's
attention), and so does the CPU's C++ decoder (backends/cpu.py cpp_covers, with the MoE families'
experts); other configs run the torch forward on the file's blocks (their C++ products) or on QWeights
(the Triton products).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..runtime import Runtime


def runtime_class(device: str | torch.device, cfg: ModelConfig | None = None, tp=None) -> type[Runtime]:
    """The backend for a model of cfg on device (cfg None: a Llama-layer model). tp (a
    parallel.TensorParallel): a shard whose layers all-reduce inside the forward: on the CPU the eager
    runtime (the torch forward with the C++ products: the C++ decoder runs whole layers, with no place
    for a collective); on CUDA CudaRuntime, whose decode graphs capture the collectives
    (backends/cuda_tp.py), else the eager one."""
    kind = torch.device(device).type
    if kind == "cuda":
        from .cuda import CudaEagerRuntime, CudaRuntime, covers  # Triton is imported only where it runs

        return CudaRuntime if cfg is None or covers(cfg) else CudaEagerRuntime
    if kind == "cpu":
        from .cpu import CpuEagerRuntime, CpuRuntime, cpp_covers

        return CpuRuntime if tp is None and cpp_covers(cfg) else CpuEagerRuntime
    return Runtime
