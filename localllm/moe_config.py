"""Config readers of the mixture-of-experts families (localllm/moe.py): Mixtral, Qwen3-MoE, gpt-oss.

config_gguf.py / config_hf.py call gguf_fields / hf_fields with their typed reader (config_fields.Fields)
and the config built so far; they return the ModelConfig fields these families set (none for a dense
model). This module sits below config.py: RopeScaling comes in as an argument.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import LocalLLMError


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention factor: transformers' get_mscale (llama.cpp: 1 + 0.1 ln(factor))."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def gguf_fields(f, cfg, limits, rope_scaling) -> dict[str, Any]:
    """GGUF metadata -> the MoE fields (and gpt-oss's); rope_scaling: config.RopeScaling."""
    out = moe_gguf_fields(f, cfg, limits)
    if cfg.arch == "gpt-oss":
        out |= gpt_oss_gguf_fields(f, cfg, limits, rope_scaling)
    return out


def hf_fields(f, cfg, limits, rope_scaling) -> dict[str, Any]:
    """config.json -> the MoE fields (and gpt-oss's)."""
    out = moe_hf_fields(f, cfg, limits)
    if cfg.arch == "gpt_oss":
        out |= gpt_oss_hf_fields(f, cfg, limits, rope_scaling)
    return out


# HF model_type -> (experts key, expert hidden width key)
_HF_EXPERT_KEYS = {"mixtral": ("num_local_experts", "intermediate_size"),
                   "qwen3_moe": ("num_experts", "moe_intermediate_size"),
                   "gpt_oss": ("num_local_experts", "intermediate_size")}


def _experts(f, count_key: str, used_key: str, ffn_key: str, limits, **ffn_default: int) -> dict[str, Any]:
    """ffn_default: default=... for the expert width key (absent: the key is required)."""
    n = f.int(count_key, 1, limits.max_heads)
    return dict(n_experts=n, n_experts_used=f.int(used_key, 1, n),
                expert_ffn_dim=f.int(ffn_key, 1, limits.max_ffn_dim, **ffn_default))


def moe_gguf_fields(f, cfg, limits) -> dict[str, Any]:
    """`{arch}.expert_count` etc. (as llama.cpp's converter writes them) -> the MoE fields; none for a
    dense model. llama.cpp renormalises the chosen experts' weights for Mixtral (`llama`) and
    Qwen3-MoE unless `{arch}.expert_weights_norm` says otherwise."""
    if f.raw("expert_count", 0) == 0:
        return {}
    out = _experts(f, "expert_count", "expert_used_count", "expert_feed_forward_length", limits, default=cfg.ffn_dim)
    return out | dict(moe_norm_topk=f.bool("expert_weights_norm", True))


def moe_hf_fields(f, cfg, limits) -> dict[str, Any]:
    """config.json's expert counts -> the MoE fields (Mixtral always renormalises; Qwen3-MoE when
    norm_topk_prob, transformers' default False)."""
    if cfg.arch not in _HF_EXPERT_KEYS:
        return {}
    count_key, ffn_key = _HF_EXPERT_KEYS[cfg.arch]
    out = _experts(f, count_key, "num_experts_per_tok", ffn_key, limits)
    if cfg.arch in ("mixtral", "gpt_oss"):  # gpt-oss: softmax over the k chosen (gpt_oss_hf_fields)
        return out | dict(moe_norm_topk=True)
    # transformers' Qwen3MoeDecoderLayer: a dense MLP in mlp_only_layers and off the sparse step
    if f.raw("mlp_only_layers", []) != [] or f.int("decoder_sparse_step", 1, cfg.n_layers, 1) != 1:
        raise LocalLLMError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step)"
                            " is not supported; every layer must be a mixture of experts")
    return out | dict(moe_norm_topk=f.bool("norm_topk_prob", False))



GPT_OSS_SWIGLU_ALPHA = 1.702  # model.glu's, as transformers' GptOssExperts and llama.cpp's swiglu_oai
SWIGLU_LIMIT_MAX = 65504.0


def _gpt_oss_common(cfg, window: int, sliding: tuple[bool, ...], limit: float) -> dict[str, Any]:
    return dict(attn_out_bias=True, attn_sinks=True, sliding_window=window, sliding_layers=sliding,
                activation="swiglu_oai", swiglu_limit=limit, moe_bias=True, moe_gating="topk_softmax")


def gpt_oss_hf_fields(f, cfg, limits, rope_scaling) -> dict[str, Any]:
    """transformers' GptOssConfig: layer_types (default: sliding, full, ... from layer 0), sliding_window,
    swiglu_limit, attention_bias (q/k/v and o_proj), YaRN in rope_parameters. quantization_config
    "mxfp4" (the released files' experts) is checked against the tensors by validate.check_hf_folder."""
    quant = f.raw("quantization_config", {})
    if isinstance(quant, dict) and quant.get("quant_method") not in (None, "mxfp4"):
        raise LocalLLMError(f"config.json: {quant.get('quant_method')!r}-quantized gpt-oss safetensors are not"
                            " supported: load its GGUF, or the released MXFP4 or a bf16 checkpoint")
    types = f.raw("layer_types", None)
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(cfg.n_layers)]
    if not isinstance(types, list) or len(types) != cfg.n_layers or \
            not all(t in ("sliding_attention", "full_attention") for t in types):  # t may be any JSON value
        raise f.bad("layer_types", types, f"{cfg.n_layers} of 'sliding_attention' / 'full_attention'")
    alpha = f.float("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
    if alpha != GPT_OSS_SWIGLU_ALPHA:
        raise f.bad("swiglu_alpha", alpha, f"{GPT_OSS_SWIGLU_ALPHA} (the only value we run)")
    bias = f.bool("attention_bias", True)
    limit = f.float("swiglu_limit", 7.0)
    if limit > SWIGLU_LIMIT_MAX:  # model.glu clamps activations of the run's dtype (float16 included) at it
        raise f.bad("swiglu_limit", limit, f"at most {SWIGLU_LIMIT_MAX} (float16's largest value)")
    out = _gpt_oss_common(cfg, f.int("sliding_window", 1, limits.max_context, 128),
                          tuple(t == "sliding_attention" for t in types), limit)
    out |= dict(qkv_bias=bias, attn_out_bias=bias)
    if not (f.values.get("rope_scaling") or f.values.get("rope_parameters")):
        # GptOssConfig's defaults: base 150000 (when not given), YaRN factor 32 from 4096 positions
        theta = cfg.rope_theta if f.raw("rope_theta", None) is not None else 150000.0
        out |= dict(rope_theta=theta, rope_scaling=rope_scaling(factor=32.0, kind="yarn", truncate=False,
                                                               original_context=4096))
    return out


def gpt_oss_gguf_fields(f, cfg, limits, rope_scaling) -> dict[str, Any]:
    """llama.cpp's gpt-oss (llm_build_openai_moe_iswa): every other layer slides from layer 0 (its swa
    pattern 2), clamp 7.0 (ggml_swiglu_oai), YaRN from rope.scaling.* (beta_fast/slow, default 32/1).
    YaRN's correction range is not truncated: gpt-oss's config.json says truncate false (transformers and
    OpenAI's reference; llama.cpp rounds it, which the file cannot express)."""
    sliding = tuple(i % 2 == 0 for i in range(cfg.n_layers))
    out = _gpt_oss_common(cfg, f.int("attention.sliding_window", 1, limits.max_context), sliding, 7.0)
    kind = f.raw("rope.scaling.type", "none")
    if kind == "none":
        return out
    if kind != "yarn":
        raise f.bad("rope.scaling.type", kind, "yarn (gpt-oss)")
    rs = rope_scaling(factor=f.float("rope.scaling.factor"), kind="yarn", truncate=False,
                     original_context=f.int("rope.scaling.original_context_length", 1, limits.max_context),
                     beta_fast=f.float("rope.scaling.yarn_beta_fast", 32.0),
                     beta_slow=f.float("rope.scaling.yarn_beta_slow", 1.0))
    factor = (f.float("rope.scaling.yarn_attn_factor") if f.raw("rope.scaling.yarn_attn_factor", None) is not None
              else yarn_mscale(rs.factor))
    return out | dict(rope_scaling=rs, rope_attn_factor=factor)
