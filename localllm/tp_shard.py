"""Tensor parallelism's arithmetic (issue 23): which part of each weight rank r of N holds, as plain
functions of the config, the rank and the weight's name (our module names: weights.to_module_name).

Layout (localllm/parallel.py's, and Megatron-LM's / vLLM's for the Llama layer):
  attn_q / attn_k / attn_v (+ bias)  rows: this rank's heads (q heads and kv heads each split in N,
                                      so every GQA group stays on one rank)
  ffn_gate / ffn_up                  rows: this rank's 1/N of the MLP's hidden columns
  attn_output / ffn_down             columns (the same heads / hidden columns); each rank's product is a
                                      partial sum that all_reduce completes. attn_output's bias is
                                      added by rank 0 only (zeros elsewhere), so the sum holds it once
  token_embd / output                vocabulary rows (vocab_part); logits gathered to the full V
  norms (q/k norms are per head dim), rope buffers   replicated

Vocabulary: rank r holds rows [r * k, min(V, (r + 1) * k)) with k = ceil(V / N): the last rank may
hold fewer (V need not divide by N); its logits are padded to k before the gather and the padding is
trimmed, so callers always see (.., V). ModelConfig.vocab_size stays the full V (the logits' width).

Quantized GGUF rows are blocks laid end to end: a column part is a byte range of whole blocks, so the
part's width and start must be multiples of the type's block size (32 for Q8_0, 256 for K-quants).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import gguf
import torch

from .config import ModelConfig
from .errors import LocalLLMError
from .parallel import TensorParallel

# Config fields (at a value other than their default) whose layers we do not shard yet: mixtures of
# experts, Gemma 4's per-layer embeddings, layers of differing shapes or shared caches, attention sinks.
UNSHARDED_FIELDS = ("n_experts", "moe_with_mlp", "per_layer_dim", "head_dim_global", "n_kv_heads_global",
                    "n_kv_shared_layers", "double_wide_mlp", "attn_k_eq_v", "attn_v_norm", "layer_out_scale",
                    "attn_sinks")

ROWS, COLS, WHOLE, RANK0 = "rows", "cols", "whole", "rank0"


@dataclass(frozen=True)
class Split:
    """How one tensor is cut: kind ROWS (dim 0 [start, stop)), COLS (last dim [start, stop)), WHOLE
    (replicated) or RANK0 (whole on rank 0, zeros on the others: a bias added before a reduce)."""

    kind: str
    start: int = 0
    stop: int = 0


def check_supported(cfg: ModelConfig, world: int) -> None:
    """One-line LocalLLMError for a config --tp cannot shard (yet) or whose shapes do not split."""
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    for name in UNSHARDED_FIELDS:
        if getattr(cfg, name) != defaults[name]:
            raise LocalLLMError(f"--tp is not supported for {cfg.arch} (its {name}: only the dense Llama-style "
                                f"layer families are sharded)")
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        n = getattr(cfg, name)
        if n % world:
            raise LocalLLMError(f"--tp {world}: the model's {name} ({n}) does not split into {world} equal parts")
    if cfg.vocab_size <= (world - 1) * -(-cfg.vocab_size // world):
        raise LocalLLMError(f"--tp {world}: the vocabulary ({cfg.vocab_size}) is too small to give every rank rows")


def local_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of rank tp.rank's shard: n_heads, n_kv_heads and ffn_dim divided by N, head_dim kept
    (explicit already); vocab_size stays the full vocabulary (see the module's docstring)."""
    check_supported(cfg, tp.world)
    return replace(cfg, n_heads=cfg.n_heads // tp.world, n_kv_heads=cfg.n_kv_heads // tp.world,
                   ffn_dim=cfg.ffn_dim // tp.world)


def vocab_part(vocab: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(start, stop, k): this rank's vocabulary rows [start, stop) and every rank's padded width k."""
    k = -(-vocab // tp.world)
    start = min(vocab, tp.rank * k)
    return start, min(vocab, start + k), k


def _part(n: int, tp: TensorParallel) -> tuple[int, int]:
    k = n // tp.world
    return tp.rank * k, (tp.rank + 1) * k


def split_of(name: str, cfg: ModelConfig, tp: TensorParallel) -> Split:
    """How tensor `name` (module name, e.g. blk.3.attn.attn_q.weight) of the WHOLE model's cfg is cut
    for tp.rank. cfg is the full config (the file's); check_supported must hold."""
    parts = name.split(".")
    kind = parts[-2] if len(parts) >= 2 else parts[0]
    bias = parts[-1] == "bias"
    D = cfg.head_dim
    if kind == "attn_q":
        a, b = _part(cfg.n_heads, tp)
        return Split(ROWS, a * D, b * D)
    if kind in ("attn_k", "attn_v"):
        a, b = _part(cfg.n_kv_heads, tp)
        return Split(ROWS, a * D, b * D)
    if kind in ("ffn_gate", "ffn_up"):
        return Split(ROWS, *_part(cfg.ffn_dim, tp))
    if kind == "attn_output":
        if bias:
            return Split(RANK0)
        a, b = _part(cfg.n_heads, tp)
        return Split(COLS, a * D, b * D)
    if kind == "ffn_down":
        return Split(COLS, *_part(cfg.ffn_dim, tp))
    if name in ("token_embd.weight", "output.weight"):
        start, stop, _ = vocab_part(cfg.vocab_size, tp)
        return Split(ROWS, start, stop)
    return Split(WHOLE)


def byte_range(qtype: gguf.GGMLQuantizationType, start: int, stop: int, name: str = "tensor") -> tuple[int, int]:
    """Columns [start, stop) of a row of qtype -> its bytes [a, b): whole blocks only, else a one-line
    LocalLLMError naming the tensor, the type and its block size."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if start % block or stop % block:
        raise LocalLLMError(f"--tp: {name} ({qtype.name}) splits at column {start if start % block else stop}, "
                            f"not on a {block}-value block boundary of its type")
    return start // block * size, stop // block * size


def shard_rows(data, split: Split, qtype: gguf.GGMLQuantizationType | None = None, name: str = "tensor"):
    """This rank's part of data by split: data is a dense tensor (..., cols) (qtype None) or raw GGUF rows
    (rows, row bytes) of qtype. Slicing is a view (of a file's mapping: only its pages are read later);
    RANK0 parts of non-zero ranks are zeros (the caller passes the rank's flag through split)."""
    if split.kind == WHOLE or split.kind == RANK0:
        return data
    if split.kind == ROWS:
        return data[split.start:split.stop]
    if qtype is None:
        return data[..., split.start:split.stop]
    a, b = byte_range(qtype, split.start, split.stop, name)
    return data[:, a:b]


def shard_tensor(name: str, data, cfg: ModelConfig, tp: TensorParallel,
                 qtype: gguf.GGMLQuantizationType | None = None):
    """split_of + shard_rows, RANK0 included (zeros on ranks other than 0)."""
    split = split_of(name, cfg, tp)
    if split.kind == RANK0 and tp.rank:
        return torch.zeros_like(data)
    return shard_rows(data, split, qtype, name)
