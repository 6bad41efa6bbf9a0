"""Tensor parallelism's process group: which rank this process is, of how many, and the collectives a
sharded forward needs (issue 23). torch.distributed does the work (NCCL on CUDA, gloo on the CPU);
processes are started by torch's launcher (torchrun / torch.distributed.run), which sets the standard
variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT that backends.launch.from_launcher
reads (the process group's kind depends on the device: a backend's choice).

The sharded model holds one TensorParallel, passed in when it is built (never set on it from outside);
a model without one (tp None) is the whole model on one device.

Layout every piece agrees on (localllm.tp_shard is its arithmetic): rank r of N holds the r-th
contiguous 1/N of the attention heads (q and kv heads each, so GQA groups stay on one rank), of the
MLP's hidden columns, and of the vocabulary rows of the embedding and output head. q/k/v, gate and up
are split by output rows; o and down by input columns (block boundaries of quantized types), and their
partial outputs are summed by all_reduce; the head's logits are joined by gather_last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import LocalLLMError

# NVLink multicast (NVLS / symmetric-memory multimem) can take a shared host's GPUs out of service: every
# process this package starts, and every process group it opens, runs with it off.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """env (default os.environ) with NO_MULTICAST forced on: for processes we start."""
    out = dict(os.environ if env is None else env)
    out.update(NO_MULTICAST)
    return out


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    group: object = None  # a torch.distributed ProcessGroup; None: the default group

    @property
    def driver(self) -> bool:
        """Rank 0 reads the prompts and prints; the others follow it."""
        return self.rank == 0

    def part(self, n: int, what: str = "dimension") -> slice:
        """This rank's contiguous slice of n items (heads, columns, vocabulary rows)."""
        if n % self.world:
            raise LocalLLMError(f"--tp {self.world}: the model's {what} ({n}) does not split into {self.world} equal parts")
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (each rank holds a partial sum of the same shape)."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(R, .., n) on every rank -> (R, .., N * n), the ranks' parts in rank order, on every rank. out:
        (N, R, .., n) scratch for the all-gather (a CUDA graph's fixed buffer), else allocated. The
        concatenated form: the one gloo takes, and one collective into one buffer under graph capture."""
        dist = torch.distributed
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device) if out is None else out
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the newer name first)
        gather(out.view(self.world * x.shape[0], *x.shape[1:]), x.contiguous(), group=self.group)  # parts on dim 0
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])


def launched() -> bool:
    """True in a process that torch's launcher started (WORLD_SIZE set by torchrun)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
