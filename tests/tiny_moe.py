"""The experts of the tiny mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss): their weights and
config.json keys, and the converter's renaming, stacking and splitting of expert tensors.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from tiny_spec import TinySpec

# HF model_type -> (router, per-expert gate / up / down) names under model.layers.N., as real
# checkpoints and transformers 5's save_pretrained store them
MOE_HF_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}


def moe_weights(spec: TinySpec, p: str, randn) -> dict[str, torch.Tensor]:
    """One layer's router and experts (HF names with prefix p); a router of std 0.5 spreads the
    tokens over the experts (tests/test_moe.py checks)."""
    C, F, E = spec.dim, spec.expert_ffn_dim, spec.n_experts
    if spec.arch == "gpt_oss":  # GptOssMLP: router with bias; experts stacked, x @ W, gate/up interleaved
        return {p + "mlp.router.weight": randn(E, C, std=0.5), p + "mlp.router.bias": randn(E, std=0.2),
                p + "mlp.experts.gate_up_proj": randn(E, C, 2 * F, std=0.15),
                p + "mlp.experts.gate_up_proj_bias": randn(E, 2 * F, std=0.1),
                p + "mlp.experts.down_proj": randn(E, F, C, std=0.08),
                p + "mlp.experts.down_proj_bias": randn(E, C, std=0.05)}
    router, gate, up, down = MOE_HF_NAMES[spec.arch]
    w = {p + router + ".weight": randn(E, C, std=0.5)}
    for e in range(E):
        w[p + gate.format(e=e) + ".weight"] = randn(F, C, std=0.1)
        w[p + up.format(e=e) + ".weight"] = randn(F, C, std=0.1)
        w[p + down.format(e=e) + ".weight"] = randn(C, F, std=0.08)
    return w


def moe_hf_config(spec: TinySpec) -> dict:
    if spec.arch == "gpt_oss":
        return {"num_local_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "intermediate_size": spec.expert_ffn_dim, "attention_bias": True, "swiglu_limit": 7.0,
                "sliding_window": spec.sliding_window, "router_aux_loss_coef": 0.0,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.n_layers)]}
    if spec.arch == "mixtral":
        return {"num_local_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "intermediate_size": spec.expert_ffn_dim, "router_jitter_noise": 0.0, "sliding_window": None}
    if spec.arch == "qwen3_moe":
        return {"num_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "moe_intermediate_size": spec.expert_ffn_dim, "norm_topk_prob": spec.norm_topk,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                "use_sliding_window": False}
    return {}


def gpt_oss_converted(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GptOssModel.modify_tensors / filter_tensors (non-MXFP4 experts): sinks get `.weight`; gate_up_proj
    (E, C, 2F) transposed and split into its interleaved gate (even) and up (odd) rows; down_proj (E, F, C)
    transposed; the biases renamed (gate/up split alike). Other names pass through."""
    out = {}
    for name, t in weights.items():
        if name.endswith("self_attn.sinks"):
            out[name + ".weight"] = t
        elif name.endswith("experts.gate_up_proj"):
            t = t.transpose(-1, -2)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = t[:, 0::2].contiguous()
            out[name.replace("gate_up_proj", "up_proj.weight")] = t[:, 1::2].contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[..., 0::2].contiguous()
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[..., 1::2].contiguous()
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = t.transpose(-1, -2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        else:
            out[name] = t
    return out


def split_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """blk.N.ffn_gate_exps.weight (E, F, C) -> [(blk.N.ffn_gate.E.weight, (F, C)), ...]; others as they are."""
    m = re.match(r"^(blk\.\d+\.ffn_(?:gate|up|down))_exps\.weight$", name)
    return [(f"{m.group(1)}.{e}.weight", data[e]) for e in range(data.shape[0])] if m else [(name, data)]


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors `...experts.{e}.NAME.weight` -> one (E, ...) tensor `...experts.NAME.weight`,
    as the converter merges them (the name gguf's TensorNameMap maps to ffn_*_exps)."""
    out, experts = {}, {}
    for name, t in weights.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(.*)$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out
