"""Joining the tensor-parallel process group of a process torch's launcher started (issue 23): which
collective library serves the device (NCCL for CUDA, gloo otherwise) and which GPU a rank takes are
device decisions, so they live here with the backends (localllm/parallel.py holds the group itself)."""

from __future__ import annotations

import os

import torch

from ..parallel import NO_MULTICAST, TensorParallel, launched


def from_launcher(device: str) -> TensorParallel | None:
    """The TensorParallel of a process started by torchrun (None when not started so, or alone): joins the
    default process group (NCCL for a CUDA device, gloo otherwise) and, on CUDA, takes GPU LOCAL_RANK."""
    if not launched():
        return None
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world == 1:
        return None
    os.environ.update(NO_MULTICAST)  # before NCCL reads its settings
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return TensorParallel(rank, world)
