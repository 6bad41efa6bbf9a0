"""Device and dtype selection: the one place where `--device auto` and default dtypes are decided."""

from __future__ import annotations


import torch

from .cores import thread_count  # noqa: F401 (torch-free home; re-exported)
from .errors import LocalLLMError

# Dtypes each device runs; the first is the default. MPS uses only ops it supports (fp16/fp32).
DEVICE_DTYPES = {
    "cpu": ("float32", "bfloat16", "float16"),  # default chosen by cpu_default_dtype()
    "cuda": ("bfloat16", "float16", "float32"),
    "mps": ("float16", "float32"),
}


def pick_device(name: str = "auto") -> str:
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if name not in DEVICE_DTYPES:
        raise LocalLLMError(f"unknown device {name!r} (choose auto, cpu, cuda or mps)")
    if name == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda asked for, but torch sees no CUDA GPU")
    if name == "mps" and not torch.backends.mps.is_available():
        raise LocalLLMError("--device mps asked for, but torch sees no Apple MPS device")
    return name


def encoder_device(name: str) -> str:
    """The quantize encoders' device: auto is cuda when torch sees one, else cpu (they do not target mps)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return pick_device(name)


DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}


def check_dtype_name(option: str, name: str) -> None:
    """A dtype some device runs (which device: checked once it is picked), before any model loads."""
    known = sorted({d for ds in DEVICE_DTYPES.values() for d in ds})
    if DTYPE_ALIASES.get(name, name) not in known:
        raise LocalLLMError(f"{option} {name} is no dtype we run (choose {', '.join(known)})")


def pick_dtype(device: str | torch.device, name: str | None = None) -> torch.dtype:
    device = torch.device(device).type  # "cuda:0" -> "cuda"
    allowed = DEVICE_DTYPES[device]
    name = DTYPE_ALIASES.get(name, name)
    if name is None:
        name = cpu_default_dtype() if device == "cpu" else allowed[0]
    if name not in allowed:
        raise LocalLLMError(f"dtype {name} is not supported on {device} (choose {', '.join(allowed)})")
    return getattr(torch, name)


def widest_float(device: torch.device) -> torch.dtype:
    """float64, except on MPS, which has none (float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def cpu_default_dtype() -> str:
    """float16 where the CPU has AVX-512 (oneDNN's fp16 matrix-vector product streams weights faster
    than bf16 and fp32 there: docs/PERFORMANCE.md); float32 elsewhere.
    This is the dtype of dense checkpoints (safetensors folders): a GGUF file on the CPU keeps its
    blocks, run by kernels/cpu.py's kernels with float32 activations (load.load_model)."""
    return "float16" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "float32"


def set_threads(threads: int | None) -> str | None:
    """Set torch's (and the CPU kernels') thread count from -t/--threads (thread_count) -> its notice."""
    n, notice = thread_count(threads)
    torch.set_num_threads(n)
    return notice


def gpu_layers_notice(n_gpu_layers: int | None, device: str | torch.device) -> str | None:
    """llama.cpp's -ngl N, accepted for its users: localllm never splits a model between CPU and GPU, so
    the notice says where every layer runs (device: the loaded model's)."""
    if n_gpu_layers is None:
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return f"-ngl {n_gpu_layers} is ignored: the model runs on the CPU (no GPU in use; --device picks one)"
    where = {"cuda": "GPU", "mps": "Apple GPU (MPS)"}.get(kind, kind)
    return (f"-ngl {n_gpu_layers}: every layer runs on the {where} (localllm does not split a model between "
            "CPU and GPU; --device cpu runs it all on the CPU)")


def rank_device(dev: str, tp) -> str:
    """A tensor-parallel rank's device (tp: parallel.TensorParallel or None): its own GPU on CUDA (the
    one backends.launch.from_launcher set current), else dev."""
    if tp is not None and dev == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return dev


def check_gpus_for(n: int, dev: str) -> None:
    """--tp N on CUDA needs N GPUs on this machine (the single-machine launch); the CPU runs any N."""
    if dev.startswith("cuda"):
        found = torch.cuda.device_count()
        if found < n:
            raise LocalLLMError(f"--tp {n} needs {n} GPUs, {found} found")
