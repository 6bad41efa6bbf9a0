"""A Hugging Face config.json -> ModelConfig (config.py), every field checked (config_fields.Fields),
rope scaling objects included; and the JSON file reads behind it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import gemma, moe_config
from .config import OWN_READERS, ModelConfig, RopeScaling
from .config_fields import Fields, arch_fields, check_shape_fields, read_head_dim
from .errors import LocalLLMError
from .settings import DEFAULT_LIMITS, LoaderLimits

# model_types whose transformers config ties the output to the embedding unless config.json says not
TIED_BY_DEFAULT = frozenset({"smollm3"})


def _hf_rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    return hf_rope_scaling_dict(rs, "rope_scaling.")


def hf_rope_scaling_dict(rs: Any, label: str) -> RopeScaling | None:
    """One HF rope-parameters object ({"rope_type": ..., "factor": ...}) -> RopeScaling or None."""
    if not isinstance(rs, dict):
        raise LocalLLMError(f"config.json {label.rstrip('.')!r} is {rs!r}, expected an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    f = Fields(rs, "config.json", label=label)
    if kind == "linear":  # transformers' _compute_linear_scaling_rope_parameters: inv_freq / factor
        return RopeScaling(factor=f.float("factor"), kind="linear")
    if kind == "yarn":
        return _hf_yarn(f)
    if kind != "llama3":
        raise LocalLLMError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear, yarn)")
    scaling = RopeScaling(
        factor=f.float("factor"),
        low_freq_factor=f.float("low_freq_factor", 1.0),
        high_freq_factor=f.float("high_freq_factor", 4.0),
        original_context=f.int("original_max_position_embeddings", 1, DEFAULT_LIMITS.max_context, 8192),
    )
    if scaling.low_freq_factor >= scaling.high_freq_factor:  # llama3_rope_factors divides by the gap
        raise f.bad("low_freq_factor", scaling.low_freq_factor, f"below high_freq_factor {scaling.high_freq_factor}")
    return scaling


def _hf_yarn(f: Fields) -> RopeScaling:
    """transformers' _compute_yarn_parameters' inputs (beta_fast/slow default 32/1, truncate true)."""
    return RopeScaling(factor=f.float("factor"), kind="yarn", beta_fast=f.float("beta_fast", 32.0),
                       beta_slow=f.float("beta_slow", 1.0), truncate=f.bool("truncate", True),
                       original_context=f.int("original_max_position_embeddings", 1, DEFAULT_LIMITS.max_context))


def yarn_attn_factor(f: Fields, rs: RopeScaling | None) -> dict[str, float]:
    """YaRN's cos/sin multiplier: attention_factor, else transformers' get_mscale (0.1 ln(factor) + 1,
    or mscale / mscale_all_dim's ratio); {} without YaRN. f: the rope scaling object's fields."""
    if rs is None or rs.kind != "yarn":
        return {}
    if f.raw("attention_factor", None) is not None:
        return dict(rope_attn_factor=f.float("attention_factor"))

    mscale = moe_config.yarn_mscale
    m, m_all = f.raw("mscale", None), f.raw("mscale_all_dim", None)
    if m and m_all:
        return dict(rope_attn_factor=mscale(rs.factor, f.float("mscale")) / mscale(rs.factor, f.float("mscale_all_dim")))
    return dict(rope_attn_factor=mscale(rs.factor))


def config_from_hf(cfg: Any, limits: LoaderLimits = DEFAULT_LIMITS) -> ModelConfig:
    """A Hugging Face config.json value -> ModelConfig, every field type- and range-checked."""
    if not isinstance(cfg, dict):
        raise LocalLLMError(f"config.json holds a {type(cfg).__name__}, expected an object")
    if isinstance(cfg.get("model_type"), str) and cfg["model_type"] in gemma.HF_MODEL_TYPES:
        cfg = gemma.hf_text_config(cfg)
    arch = cfg.get("model_type")
    if isinstance(arch, str) and (arch in OWN_READERS or arch == "gemma4_text"):
        raise LocalLLMError(f"a {arch} config.json is read by localllm/gemma4.py (validate.check_hf_folder)")
    fields = arch_fields(arch, "config.json 'model_type'")
    f = Fields(cfg, "config.json")
    n_heads = f.int("num_attention_heads", 1, limits.max_heads)
    dim = f.int("hidden_size", 1, limits.max_dim)
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = f.float("rope_theta", None) if cfg.get("rope_theta") is not None else None
    if theta is None:
        theta = Fields(rope_params, "config.json", label="rope_parameters.").float("rope_theta", 10000.0)
    out = ModelConfig(
        arch=arch,
        n_layers=f.int("num_hidden_layers", 1, limits.max_layers),
        dim=dim,
        ffn_dim=f.int("intermediate_size", 1, limits.max_ffn_dim),
        n_heads=n_heads,
        n_kv_heads=f.int("num_key_value_heads", 1, n_heads, n_heads),
        head_dim=read_head_dim(f, "head_dim", dim, n_heads, "num_attention_heads", limits),
        vocab_size=f.int("vocab_size", 1, limits.max_vocab),
        context_length=f.int("max_position_embeddings", 1, limits.max_context, 2048),
        norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        tied_output=f.bool("tie_word_embeddings", arch in TIED_BY_DEFAULT),
        rope_scaling=None if arch == "phi3" else _hf_rope_scaling(cfg),  # phi3's is LongRoPE (config_phi3)
        **{**fields, "qkv_bias": f.bool("attention_bias", fields["qkv_bias"])},
    )
    if arch in gemma.GEMMA_ARCHS:
        out = replace(out, **gemma.hf_fields(f, arch, out.n_layers, dim, limits.max_context, hf_rope_scaling_dict))
    from .config_phi3 import hf_fields  # here: config_phi3 is called with config_fields.Fields

    out = replace(out, **hf_fields(arch, f, out.n_layers, out.head_dim, out.context_length))
    out = replace(out, **moe_config.hf_fields(f, out, limits, RopeScaling))
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    out = replace(out, **yarn_attn_factor(Fields(rs, "config.json", label="rope_scaling."), out.rope_scaling))
    names = dict(n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", head_dim="head_dim")
    check_shape_fields(out, names, "config.json", limits)
    return out


def read_hf_config(folder: Path, limits: LoaderLimits = DEFAULT_LIMITS) -> ModelConfig:
    """folder/config.json -> ModelConfig; a missing, non-UTF-8 or malformed file is one line naming it."""
    return config_from_hf(hf_config_json(folder), limits)


def hf_config_json(folder: Path) -> Any:
    """The value of folder/config.json; a missing, non-UTF-8 or malformed file is one line naming it."""
    path = folder / "config.json"
    if not path.is_file():
        raise LocalLLMError(f"not a model folder: {folder} has no config.json")
    return read_json(path)


def read_json(path: Path) -> Any:
    """A JSON file's value; bad bytes or syntax: one line naming the file and where."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"{path.name} in {path.parent} is not UTF-8 (invalid byte at offset {e.start})") from None
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LocalLLMError(f"bad {path.name} in {path.parent}: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise LocalLLMError(f"bad {path.name} in {path.parent}: nested too deeply") from None
