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

    cuda = tl.extra.cuda
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__)


# Every launch asks for FMA contraction (a * b + c rounded once) by name: Triton's default so far, with
# which every kernel here was measured and its bits checked (triton_mma's products equal triton_q8's
# because both contract the same expressions); Triton 3.9 warns that 3.10 turns the default off.
FUSION = {"enable_fp_fusion": True}

# Decode-step kernels launch with programmatic dependent launch where it exists: each waits
# (griddepcontrol.wait, first thing) until the kernel before it has finished and its writes are
# visible, and every read and write of a kernel comes after that wait, so their effects keep the
# stream's order; what overlaps is a kernel's launch and scheduling with the work before it.
PDL = _pdl_available()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before; the next kernel is scheduled once this one's programs exit (the
    integer-dot and float-decoding products: grids of many waves, whose last waves lose residency
    to early-scheduled successors, which made them slower with pdl_start: docs/PERFORMANCE.md)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel be scheduled once every program of this one has come here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel be scheduled as soon as all of this one's programs have started
    (griddepcontrol.launch_dependents: its programs become resident and wait), then wait for the
    kernel before. For kernels of one wave or less (the dense products, norms, rope, attention),
    where it made bf16 decode faster (docs/PERFORMANCE.md)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def round_act(y, ACT: tl.constexpr, ROUND: tl.constexpr):
    if ROUND:
        y = y.to(ACT).to(tl.float32)
    return y


@triton.jit
def load_even(ptr, mask, EVEN: tl.constexpr):
    """Load; masked (zeros outside) unless the tile is known to lie inside the tensors (EVEN)."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)
