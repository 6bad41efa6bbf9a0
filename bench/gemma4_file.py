"""A synthetic Gemma 4 GGUF of a small E2B-like shape, for bench/vs_llamacpp.py (bench/family_files.py
writes it beside the other families' files).

The shape scales gemma-4-E2B down to the other families' size class (smollm2-135m: ~100 M parameters
without the embeddings): sliding layers with 1 kv head of 128 dims and full ones (every 5th, and the
last) with 256-dim heads and the proportional partial rope, per-layer embeddings, the last layers KV-shared
with a double-wide MLP, layer output scales, final soft cap. Written as llama.cpp's converter +
llama-quantize lay a Gemma 4 file out (gemma4_gguf.gemma4_metadata's keys, rope_freqs.weight, the
embeddings quantized), with synthetic.synthetic_state's random weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import torch

from localllm.config import ModelConfig
from localllm.gemma4_gguf import gemma4_metadata
from localllm.quantize.presets import find_preset
from localllm.quantize.writer import MetaValue, TensorSlot, write_gguf
from localllm.synthetic import quantize_embedding, synthetic_state
from localllm.weights import QuantizedTensor, gguf_name


def gemma4_shape(vocab_size: int) -> ModelConfig:
    """gemma-4-E2B (35 layers of 1536, heads 256 / 512, PLE 256, 20 KV-shared) scaled down. As in E2B the
    last layer that owns a cache is a full one and the one before it sliding: llama.cpp's KV reuse
    (n_layer_kv_from_start - 1 for full layers, - 2 for sliding ones) assumes it."""
    L, dim = 15, 512
    sliding = tuple((i + 1) % 5 != 0 for i in range(L - 1)) + (False,)
    return ModelConfig(
        arch="gemma4", n_layers=L, dim=dim, ffn_dim=2048, n_heads=4, n_kv_heads=1, head_dim=128,
        vocab_size=vocab_size, context_length=4096, norm_eps=1e-6, rope_theta=1e6, qkv_bias=False, qk_norm=True,
        tied_output=True, embed_scale=math.sqrt(dim), activation="gelu_tanh", post_norms=True, attn_scale=1.0,
        attn_v_norm=True, sliding_window=512, sliding_layers=sliding, rope_theta_local=10000.0,
        final_softcap=30.0, head_dim_global=256, n_kv_heads_global=1, rope_partial_global=0.25,
        n_kv_shared_layers=5, double_wide_mlp=True, per_layer_dim=128, layer_out_scale=True,
    )


def write_gemma4_gguf(cfg: ModelConfig, wtype: str, out: Path, tokenizer: dict) -> Path:
    preset = find_preset(wtype)
    if preset is None:
        raise ValueError(f"unknown GGUF file type {wtype!r}")
    meta = gemma4_metadata(cfg, out.parent) | tokenizer
    V = gguf.GGUFValueType
    meta[gguf.Keys.General.NAME] = MetaValue(f"synthetic {out.stem}", V.STRING)
    meta[gguf.Keys.General.FILE_TYPE] = MetaValue(int(preset.file_type), V.UINT32)
    meta[gguf.Keys.General.QUANTIZATION_VERSION] = MetaValue(gguf.GGML_QUANT_VERSION, V.UINT32)
    state = quantize_embedding(synthetic_state(cfg, wtype, "cpu")[0], wtype)
    # (per_layer_token_embd, 2-D, comes quantized as the linear weights are)
    # layer scalars near 1 (random ones would shrink or blow up the residual over 15 layers)
    for i in range(cfg.n_layers):
        state[f"blk.{i}.layer_output_scale.weight"] = torch.ones(1)
    names, slots = list(state), []
    for name in names:
        v = state[name]
        if isinstance(v, QuantizedTensor):
            block, size = gguf.GGML_QUANT_SIZES[v.qtype]
            slots.append(TensorSlot(gguf_name(name), (v.data.shape[0], v.data.shape[1] // size * block), v.qtype))
        else:
            slots.append(TensorSlot(gguf_name(name), tuple(v.shape), gguf.GGMLQuantizationType.F32 if v.dim() == 1
                                    else gguf.GGMLQuantizationType.F16))

    def make_tensor(i: int):
        v, slot = state.pop(names[i]), slots[i]
        data = v.data if isinstance(v, QuantizedTensor) else v.to(
            torch.float32 if slot.type == gguf.GGMLQuantizationType.F32 else torch.float16)
        return data.contiguous().numpy()

    return write_gguf(out, "gemma4", meta, slots, make_tensor, progress=False)
