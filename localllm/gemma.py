"""Gemma 2 and Gemma 3 (text): their ModelConfig fields from GGUF metadata and from config.json.

Both families are the Llama layer plus fields (config.ModelConfig): embeddings times sqrt(dim), a
gelu-tanh GLU, RMSNorm on each sublayer's output before the residual add (post_attention_norm,
post_ffw_norm), their own attention scale, and sliding-window attention on most layers. Gemma 2
soft-caps attention scores and logits; Gemma 3 has q/k norm, a rope base of its own on sliding
layers, and linear rope scaling on its global layers only (4B and larger).

GGUF: what llama.cpp reads (llama-model.cpp load_hparams for LLM_ARCH_GEMMA2 / GEMMA3), which is
not always what the converter wrote: the layer pattern, the sliding layers' rope base and the
attention scale are llama.cpp's constants, not keys. config.json: what transformers reads
(Gemma2Config, Gemma3TextConfig; a Gemma3Config's text_config), its class defaults included, since
real Gemma 3 configs leave most fields to them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .errors import LocalLLMError

GEMMA_ARCHS = frozenset({"gemma2", "gemma3"})

# llama.cpp's set_swa_pattern(n): layer i slides unless (i + 1) % n == 0; transformers' default
# layer_types (Gemma2Config: every 2nd layer global; Gemma3TextConfig: sliding_window_pattern, 6).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's LLM_TYPE_27B block counts: there f_attention_scale = (n_embd / n_head)^-0.5 (the 27B
# models' query_pre_attn_scalar), elsewhere key_length^-0.5. The converter writes no scale key.
LAYERS_27B = {"gemma2": 46, "gemma3": 62}
# llama.cpp's rope_freq_base_train_swa for Gemma 3 (the converter writes no key for it).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's n_swa default for Gemma 2, used when the file has no attention.sliding_window.
GEMMA2_WINDOW = 4096

# transformers' class defaults (Gemma2Config, Gemma3TextConfig) for the keys ModelConfig reads.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=None, attn_logit_softcapping=None, sliding_window_pattern=6),
}
# HF model_type -> our (GGUF) architecture name.
HF_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
# transformers' GELU names that are the tanh approximation (ACT2FN), which llama.cpp's Gemma graphs use.
GELU_TANH = frozenset({"gelu_pytorch_tanh", "gelu_new", "gelu_fast"})


def pattern_layers(n_layers: int, pattern: int) -> tuple[bool, ...]:
    return tuple(bool((i + 1) % pattern) for i in range(n_layers))


def gguf_fields(f, arch: str, n_layers: int, dim: int, n_heads: int, head_dim: int,
                max_context: int) -> dict[str, Any]:
    """f: config_fields.Fields over the `{arch}.` GGUF keys -> the Gemma fields of ModelConfig."""
    default_window = GEMMA2_WINDOW if arch == "gemma2" else 0  # Gemma 3 without the key: no sliding
    window = f.int("attention.sliding_window", 0, max_context, default_window)
    scale_dim = dim // n_heads if n_layers == LAYERS_27B[arch] else head_dim  # integer division, as llama.cpp
    out = dict(
        embed_scale=math.sqrt(dim), activation="gelu_tanh", post_norms=True, attn_scale=scale_dim**-0.5,
        final_softcap=_gguf_float(f, "final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        sliding_window=window or None, sliding_layers=pattern_layers(n_layers, SWA_PATTERN[arch]) if window else (),
    )
    if arch == "gemma2":
        out["attn_softcap"] = f.float("attn_logit_softcapping", 50.0)
    elif window:  # llama.cpp sets it after reading keys: a rope.freq_base_swa key does not change it
        out["rope_theta_local"] = GEMMA3_LOCAL_ROPE_BASE
    return out


def _gguf_float(f, key: str, default: float | None) -> float | None:
    return default if f.raw(key, None) is None else f.float(key)


def hf_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma config.json -> the flat text config transformers builds: a Gemma3Config's text_config
    (its tie_word_embeddings from the top level when given there), absent keys at the class defaults,
    model_type our architecture name. JSON null stays null: for the soft-caps it means "none"."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: the text model's config is nested
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise LocalLLMError("config.json of model_type 'gemma3' has no 'text_config' object")
        text = dict(text)
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    else:
        text = dict(cfg)
    arch = HF_MODEL_TYPES[model_type]
    return {**HF_DEFAULTS[arch], **text, "model_type": arch}


def _optional_float(f, key: str) -> float | None:
    """A positive number, or None where config.json says null (transformers: the feature is off)."""
    return None if f.values.get(key) is None else f.float(key)


def hf_fields(f, arch: str, n_layers: int, dim: int, max_context: int,
              rope_scaling: Callable[[Any, str], Any]) -> dict[str, Any]:
    """f: config_fields.Fields over hf_text_config's dict -> the Gemma fields of ModelConfig, rope included
    (Gemma 3 keeps two rope settings: rope_parameters {"full_attention", "sliding_attention"}, or
    the older rope_theta / rope_local_base_freq / rope_scaling keys). rope_scaling: config's reader
    of one HF rope object (config_hf.hf_rope_scaling_dict)."""
    act = f.raw("hidden_activation", f.raw("hidden_act", "gelu_pytorch_tanh"))
    if not isinstance(act, str) or act not in GELU_TANH:
        raise f.bad("hidden_activation", act, f"one of {', '.join(sorted(GELU_TANH))} (GELU, tanh approximation)")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if f.values.get(key):
            raise LocalLLMError(f"config.json {key!r} is true: not supported for {arch}")
    sliding = _hf_sliding_layers(f, arch, n_layers)
    window = f.int("sliding_window", 1, max_context) if any(sliding) else None
    out = dict(
        embed_scale=math.sqrt(dim), activation="gelu_tanh", post_norms=True,
        attn_scale=f.float("query_pre_attn_scalar") ** -0.5,
        attn_softcap=_optional_float(f, "attn_logit_softcapping"),
        final_softcap=_optional_float(f, "final_logit_softcapping"),
        sliding_window=window, sliding_layers=sliding if any(sliding) else (),
    )
    if arch == "gemma3":
        rp = f.values.get("rope_parameters")
        if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
            full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
            label = "rope_parameters.full_attention."
        else:
            full, local, label = f.values.get("rope_scaling") or {}, {}, "rope_scaling."
        for part, value in (("full_attention", full), ("sliding_attention", local)):
            if not isinstance(value, dict):
                raise f.bad(f"rope_parameters.{part}" if label != "rope_scaling." else "rope_scaling", value,
                            "an object")
        theta = full.get("rope_theta", f.values.get("rope_theta", 1_000_000.0))
        local_theta = local.get("rope_theta", f.values.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise LocalLLMError(f"config.json rope_parameters.sliding_attention.rope_type is {local['rope_type']!r},"
                                " expected 'default'")
        check = type(f)({"rope_theta": theta, "rope_local_base_freq": local_theta}, "config.json")
        out |= dict(rope_theta=check.float("rope_theta"), rope_scaling=rope_scaling(full, label))
        if any(sliding):
            out["rope_theta_local"] = check.float("rope_local_base_freq")
    return out


def _hf_sliding_layers(f, arch: str, n_layers: int) -> tuple[bool, ...]:
    """transformers' layer_types, else its default pattern (Gemma 3: sliding_window_pattern)."""
    types = f.values.get("layer_types")
    if types is None:
        pattern = SWA_PATTERN["gemma2"] if arch == "gemma2" else f.int("sliding_window_pattern", 1, 1 << 20)
        return pattern_layers(n_layers, pattern)
    kinds = {"sliding_attention": True, "full_attention": False}
    if not isinstance(types, list) or len(types) != n_layers or any(not isinstance(t, str) or t not in kinds
                                                                    for t in types):
        raise f.bad("layer_types", types, f"a list of {n_layers} 'sliding_attention' / 'full_attention'")
    return tuple(kinds[t] for t in types)
