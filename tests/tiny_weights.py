"""The tiny models' random weights: HF-named fp32 tensors of realistic scale, rounded to the
checkpoint's storage dtype.
"""

from __future__ import annotations

import torch

from tiny_moe import moe_weights
from tiny_spec import TinySpec
from tiny_tokenizer import vocab_size


def _storage_round(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values exactly representable in the storage dtype (so every format holds the same numbers)."""
    return t.to(getattr(torch, dtype)).float()


def make_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights with realistic scales (std 0.02-0.1; norm weights around 1)."""
    g = torch.Generator().manual_seed(spec.seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    C, F, D, V = spec.dim, spec.ffn_dim, spec.hd, vocab_size()
    qd, kvd = spec.n_heads * D, spec.n_kv_heads * D
    # Gemma's RMSNorm multiplies by 1 + w: its stored norm weights sit around 0, not 1
    one = 0.0 if spec.gemma else 1.0
    w = {"model.embed_tokens.weight": randn(V, C, std=0.1)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = one + randn(C, std=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(qd, C, std=0.1)
        w[p + "self_attn.k_proj.weight"] = randn(kvd, C, std=0.1)
        w[p + "self_attn.v_proj.weight"] = randn(kvd, C, std=0.1)
        w[p + "self_attn.o_proj.weight"] = randn(C, qd, std=0.08)
        if spec.arch == "gpt_oss":  # o_proj bias and attention sinks
            w[p + "self_attn.o_proj.bias"] = randn(C, std=0.05)
            w[p + "self_attn.sinks"] = randn(spec.n_heads, std=1.0)
        if spec.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = randn(qd, std=0.1)
            w[p + "self_attn.k_proj.bias"] = randn(kvd, std=0.1)
            w[p + "self_attn.v_proj.bias"] = randn(kvd, std=0.05)
        if spec.qk_norm:
            w[p + "self_attn.q_norm.weight"] = one + randn(D, std=0.1)
            w[p + "self_attn.k_norm.weight"] = one + randn(D, std=0.1)
        # Llama: the MLP's input norm; Gemma: the attention output's norm (then pre_feedforward_layernorm)
        w[p + "post_attention_layernorm.weight"] = one + randn(C, std=0.1)
        if spec.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = randn(C, std=0.1)
            w[p + "post_feedforward_layernorm.weight"] = randn(C, std=0.1)
        if spec.n_experts:
            w |= moe_weights(spec, p, randn)
            continue
        w[p + "mlp.gate_proj.weight"] = randn(F, C, std=0.1)
        w[p + "mlp.up_proj.weight"] = randn(F, C, std=0.1)
        w[p + "mlp.down_proj.weight"] = randn(C, F, std=0.08)
    w["model.norm.weight"] = one + randn(C, std=0.1)
    if not spec.tied:
        w["lm_head.weight"] = randn(V, C, std=0.1)
    if spec.arch == "phi3":
        w = fuse_phi3(w, spec.n_layers)
    return {k: _storage_round(v, spec.storage_dtype) for k, v in w.items()}


def fuse_phi3(w: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Phi-3's checkpoint layout: q|k|v rows in self_attn.qkv_proj, gate|up rows (gate first, as
    Phi3MLP chunks them) in mlp.gate_up_proj."""
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    return w
