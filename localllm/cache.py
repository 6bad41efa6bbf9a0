"""The KV cache: one preallocated buffer per k and v, indexed by position and passed in explicitly.

`length` is the number of valid positions; rolling back (e.g. after rejected speculative tokens)
is just setting it lower: later writes overwrite the stale rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class KVCache:
    k: torch.Tensor  # (L, B, Hkv, S, D)
    v: torch.Tensor  # (L, B, Hkv, S, D)
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-2]  # k: one (L, ...) buffer, or a list of per-layer (B, Hkv, S, D) ones

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v (B, Hkv, T, D) at rows [start, start+T); return views of rows [0, start+T)."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def make_cache(cfg: ModelConfig, capacity: int, batch: int = 1, dtype=torch.float32, device="cpu") -> KVCache:
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
