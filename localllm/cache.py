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
    # (L, B, Hkv, S, D); or, where layers differ in shape or share a cache (Gemma 4), a list of L
    # (B, Hkv_i, S, D_i) tensors in which a KV-shared layer's entry is its source layer's tensor
    k: torch.Tensor | list[torch.Tensor]
    v: torch.Tensor | list[torch.Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-2]  # k: one (L, ...) buffer, or a list of per-layer (B, Hkv, S, D) ones

    def rows(self, layer: int, end: int):
        """Views of rows [0, end) of the layer's keys and values (a KV-shared layer reads, never writes)."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v (B, Hkv, T, D) at rows [start, start+T); return views of rows [0, start+T)."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def make_cache(cfg: ModelConfig, capacity: int, batch: int = 1, dtype=torch.float32, device="cpu") -> KVCache:
    if not cfg.uniform_kv:
        return layered_cache(cfg, capacity, batch, dtype, device)
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


def layered_cache(cfg: ModelConfig, capacity: int, batch: int, dtype, device) -> KVCache:
    """One buffer per layer of its own shape (Gemma 4: full layers' heads differ from sliding ones');
    a KV-shared layer's entries are its source layer's buffers (cfg.kv_source), allocated once."""
    k, v = [], []
    for i in range(cfg.n_layers):
        src = cfg.kv_source(i)
        if src != i:
            k.append(k[src])
            v.append(v[src])
            continue
        shape = (batch, cfg.layer_kv_heads(i), capacity, cfg.layer_head_dim(i))
        k.append(torch.zeros(shape, dtype=dtype, device=device))
        v.append(torch.zeros(shape, dtype=dtype, device=device))
    return KVCache(k, v)
