"""Reading only a rank's shard of a checkpoint (issue 23; the cuts: localllm/tp_shard.py).

GGUF: every tensor is sliced as raw rows viewing the file's memory map (rows; whole-block byte ranges
of columns), after the fused tensors' split (Phi-3's attn_qkv, gate|up: views too) and before the
llama q/k un-permutation (which works within a head: whole heads un-permute alone) and before any
decoding, so a rank decodes and touches only its pages. safetensors: safe_open's get_slice reads the
rank's rows / columns (a fused tensor is read whole, split, then cut: Phi-3 folders only).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from localllm.quantize.decode import dequantize_torch
from localllm.quantize.formats import SUPPORTED_TYPES

from .config import ModelConfig
from .errors import LocalLLMError
from .fused import fused_parts, split_rows
from .parallel import TensorParallel
from .tp_shard import COLS, RANK0, ROWS, shard_tensor, split_of
from .weights import (DENSE_BLOCK_TYPES, EMBEDDINGS, PERMUTED_QK_ARCHS, QuantizedTensor, gguf_to_ours,
                      to_module_name, unpermute_qk)


def gguf_shard(f, cfg: ModelConfig, tp: TensorParallel, keep_quantized: frozenset = frozenset(),
               keep_embedding: bool = False) -> dict:
    """weights.gguf_state_dict's result for rank tp.rank's shard only (cfg: the file's whole config;
    tp_shard.check_supported holds): quantized (kept) tensors as QuantizedTensor views of the mapping."""
    out = {}
    for name, t in f.tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise LocalLLMError(f"tensor {name!r} has unsupported type {t.tensor_type.name}")
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: (rows, cols) or (n,)
        if len(shape) == 1:  # norms, biases, rope divisors: small, decoded whole, then cut
            whole = dequantize_torch(np.ascontiguousarray(t.data), t.tensor_type).reshape(shape)
            for n, part in split_rows(cfg, gguf_to_ours(cfg.arch, name), whole):
                mod = to_module_name(n)
                out[mod] = shard_tensor(mod, part, cfg, tp).clone()
            continue
        if len(shape) != 2:
            raise LocalLLMError(f"--tp: tensor {name!r} has {len(shape)} dimensions (only 1-D and 2-D are sharded)")
        raw = torch.from_numpy(t.data.view(np.uint8).reshape(shape[0], -1))  # a view of the mapping
        for n, rows in split_rows(cfg, gguf_to_ours(cfg.arch, name), raw):
            mod = to_module_name(n)
            part = shard_tensor(mod, rows, cfg, tp, t.tensor_type)
            cols = shape[1] * part.shape[1] // raw.shape[1]
            if cfg.arch in PERMUTED_QK_ARCHS and n.endswith(("attn_q.weight", "attn_k.weight")):
                heads = part.shape[0] // cfg.head_dim  # this rank's whole heads
                part = unpermute_qk(part, heads)
            out[mod] = kept_or_decoded(n, part, cols, t.tensor_type, keep_quantized, keep_embedding)
    return out


def kept_or_decoded(name: str, part: torch.Tensor, cols: int, qtype, keep_quantized: frozenset,
                    keep_embedding: bool):
    """raw rows (rows, row bytes) of this rank -> a QuantizedTensor (kept as weights.gguf_state_dict
    keeps them) or float32 (rows, cols), decoded from the part alone."""
    keep = qtype in keep_quantized and name.endswith(".weight") and (keep_embedding or name not in EMBEDDINGS)
    if qtype in DENSE_BLOCK_TYPES and cols % 32:
        keep = False
    if keep:  # a column part (strided view) is copied: this rank's bytes only; rows stay views of the map
        return QuantizedTensor(qtype, part if part.is_contiguous() else part.contiguous())
    return dequantize_torch(part.contiguous(), qtype).reshape(part.shape[0], cols)


def hf_shard(folder: Path, keys: dict, cfg: ModelConfig, tp: TensorParallel) -> dict:
    """weights.hf_state_dict's result for rank tp.rank's shard (dense checkpoints; keys as validated by
    validate.check_hf_folder: GGUF name -> (file, checkpoint key))."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for name, source in keys.items():
        if not isinstance(source, tuple):
            raise LocalLLMError("--tp is not supported for mixture-of-experts checkpoints")
        path, key = source
        try:
            with safe_open(str(path), framework="pt") as f:
                if fused_parts(cfg, name) != [name]:  # read whole, split, cut
                    for n, part in split_rows(cfg, name, f.get_tensor(key)):
                        out[to_module_name(n)] = shard_tensor(to_module_name(n), part, cfg, tp).clone()
                    continue
                mod = to_module_name(name)
                split = split_of(mod, cfg, tp)
                view = f.get_slice(key)
                if split.kind == ROWS:
                    w = view[split.start:split.stop]
                elif split.kind == COLS:
                    w = view[:, split.start:split.stop]
                else:
                    w = view[:]
                    if split.kind == RANK0 and tp.rank:
                        w = torch.zeros_like(w)
                out[mod] = w.clone()  # owns its memory (see weights.hf_state_dict)
        except (SafetensorError, OSError) as e:
            raise LocalLLMError(f"cannot read tensor {key!r} from {path}: {e}") from None
    return out


def shard_bytes(state: dict) -> int:
    """Bytes of a state dict's tensors (QuantizedTensor: its raw rows): what a rank holds."""
    return sum(math.prod(v.data.shape) if isinstance(v, QuantizedTensor) else v.numel() * v.element_size()
               for v in state.values())


__all__ = ["gguf_shard", "hf_shard", "kept_or_decoded", "shard_bytes"]
