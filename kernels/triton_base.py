"""What every Triton kernel here shares: whether Triton runs on the CPU (its interpreter, in tests),
programmatic dependent launch, and the modules' rounding of activations."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's own switch: its interpreter runs the kernels on the CPU (the tests set it)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _pdl_available() -> bool:
    """Programmatic dependent launch: Hopper or newer, and a Triton that launches with it."""
    if INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


# Decode-step kernels launch with programmatic dependent launch where it exists: a kernel's programs
# may be scheduled while the kernel before it drains (inside the step's CUDA graph too), and each
# waits (griddepcontrol.wait, _pdl_wait first thing) until that kernel's writes are complete.
PDL = _pdl_available()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _round(y, ACT: tl.constexpr, ROUND: tl.constexpr):
    if ROUND:
        y = y.to(ACT).to(tl.float32)
    return y
