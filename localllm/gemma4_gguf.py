"""A Gemma 4 safetensors folder's GGUF metadata and extra tensor, as llama.cpp's converter writes them
(conversion/gemma.py Gemma4Model.set_gguf_parameters / generate_extra_tensors, on top of Gemma3Model
and TextModel): the quantize command's HF input path uses these for gemma4 folders.

The keys are those gemma4.gemma4_config_from_gguf reads back: per-layer head_count_kv where the full
layers' differ, per-layer feed_forward_length with a double-wide MLP, key/value_length of the full
layers and *_swa of the sliding ones, the sliding pattern, shared KV layers, PLE width, experts, and
rope_freqs.weight (1 for the rotated pairs of the full layers' proportional rope, 1e30 for the rest).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from localllm.quantize.writer import MetaValue

from .config import ModelConfig
from .rope import llama3_rope_factors

V = gguf.GGUFValueType


def gemma4_metadata(cfg: ModelConfig, folder: Path) -> dict[str, MetaValue]:
    L, k = cfg.n_layers, gguf.Keys
    kv = {k.General.ARCHITECTURE: MetaValue("gemma4", V.STRING), k.General.TYPE: MetaValue("model", V.STRING),
          k.General.NAME: MetaValue(folder.resolve().name, V.STRING), k.General.FILE_TYPE: MetaValue(0, V.UINT32)}

    def put(key: str, value, vtype=V.UINT32) -> None:
        if isinstance(value, list):
            kv[key.format(arch="gemma4")] = MetaValue(value, V.ARRAY, vtype)
        elif value is not None:
            kv[key.format(arch="gemma4")] = MetaValue(value, vtype)

    ffn = [cfg.layer_ffn_dim(i) for i in range(L)]
    kv_heads = [cfg.layer_kv_heads(i) for i in range(L)]
    put(k.LLM.BLOCK_COUNT, L)
    put(k.LLM.CONTEXT_LENGTH, cfg.context_length)
    put(k.LLM.EMBEDDING_LENGTH, cfg.dim)
    put(k.LLM.FEED_FORWARD_LENGTH, ffn if len(set(ffn)) > 1 else cfg.ffn_dim)
    put(k.Attention.HEAD_COUNT, cfg.n_heads)
    put(k.Attention.HEAD_COUNT_KV, kv_heads if len(set(kv_heads)) > 1 else cfg.n_kv_heads)
    put(k.Rope.FREQ_BASE, cfg.rope_theta, V.FLOAT32)
    put(k.Rope.FREQ_BASE_SWA, cfg.rope_theta_local, V.FLOAT32)
    put(k.Attention.LAYERNORM_RMS_EPS, cfg.norm_eps, V.FLOAT32)
    put(k.Attention.KEY_LENGTH, cfg.head_dim_global)
    put(k.Attention.VALUE_LENGTH, cfg.head_dim_global)
    put(k.Attention.KEY_LENGTH_SWA, cfg.head_dim)
    put(k.Attention.VALUE_LENGTH_SWA, cfg.head_dim)
    put(k.Rope.DIMENSION_COUNT, cfg.head_dim_global)
    put(k.Rope.DIMENSION_COUNT_SWA, cfg.head_dim)
    put(k.LLM.FINAL_LOGIT_SOFTCAPPING, cfg.final_softcap, V.FLOAT32)
    put(k.Attention.SLIDING_WINDOW, cfg.sliding_window)
    put(k.Attention.SLIDING_WINDOW_PATTERN, [cfg.sliding(i) for i in range(L)], V.BOOL)
    put(k.Attention.SHARED_KV_LAYERS, cfg.n_kv_shared_layers)
    put(k.LLM.EMBD_LENGTH_PER_LAYER_INP, cfg.per_layer_dim)
    if cfg.moe_with_mlp:
        put(k.LLM.EXPERT_COUNT, cfg.n_experts)
        put(k.LLM.EXPERT_USED_COUNT, cfg.n_experts_used)
        put(k.LLM.EXPERT_FEED_FORWARD_LENGTH, cfg.expert_ffn_dim)
    return kv


def gemma4_rope_freqs(cfg: ModelConfig) -> torch.Tensor:
    """rope_freqs.weight: (global head dim / 2,) divisors of the full layers' rope."""
    return llama3_rope_factors(cfg)
