"""The config fields of Phi-3 / Phi-3.5 / Phi-4 (`phi3`) and SmolLM3 (`smollm3`), from GGUF metadata or
config.json: LongRoPE, partial rotary, sliding window (phi3) and NoPE layers (smollm3).

LongRoPE (HF rope_scaling {"type": "longrope" | "su", short_factor, long_factor}, top-level
original_max_position_embeddings): per-frequency divisors of the rotary frequencies, one set for contexts
up to the original (pre-training) length and one beyond it, and an attention factor multiplying cos/sin
(both sets). llama.cpp's converter writes the sets as the tensors `rope_factors_short.weight` /
`rope_factors_long.weight`, the factor as `phi3.rope.scaling.attn_factor` and the original length as
`phi3.rope.scaling.original_context_length`. Which set applies is llama.cpp's rule
(llama_model::get_rope_factors): the long one when the context in use (our KV cache's capacity) exceeds
the original length, for every position. Transformers instead picks by the current sequence length; the
two agree whenever the cache is exactly as long as the sequence (tests/test_phi3_smollm3.py checks both
sides against transformers that way).

SmolLM3's NoPE layers: llama.cpp has no GGUF key for them and hard-codes every 4th layer
(`(il + 1) % 4 == 0`, its n_no_rope_layer_step); config.json lists them (`no_rope_layers`, 1 = rope) or
gives the interval (`no_rope_layer_interval`, default 4).
"""

from __future__ import annotations

import math
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the tensors are made: check_gguf's path imports none
    import torch

from .errors import LocalLLMError
from .rope_dims import ROPE_FACTOR_TENSORS  # its torch-free home (check_gguf imports it from there)

# No import of .config (config_gguf / config_hf call in here): readers are config_fields.Fields instances
# passed in, `type(f)` makes one for a nested object; cfg parameters are config.ModelConfig values.

# llama.cpp's hard-coded SmolLM3 NoPE step (src/models/smollm3.cpp, hparams.n_no_rope_layer_step)
SMOLLM3_NOPE_STEP = 4
LONGROPE_TYPES = ("longrope", "su")  # "su" is the older name transformers maps to longrope
MAX_ORIGINAL = 2**31 - 1  # the largest original context read (any positive one is meaningful)


def nope_every(n_layers: int, step: int) -> tuple[bool, ...]:
    """rope_layers with every step-th layer (1-based) NoPE, transformers' and llama.cpp's rule."""
    return tuple((i + 1) % step != 0 for i in range(n_layers))


def longrope_attn_factor(context: int, original: int) -> float:
    """The cos/sin multiplier transformers (_compute_longrope_parameters) and llama.cpp's converter use:
    sqrt(1 + ln(s) / ln(original)) with s = context / original, 1 when s <= 1."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


# ---- GGUF


def gguf_fields(arch: str, f, tensor_names: set[str], n_layers: int, head_dim: int,
                context: int) -> dict[str, Any]:
    """The phi3 / smollm3 ModelConfig fields from GGUF metadata (f: the `{arch}.` keys)."""
    if arch == "smollm3":
        return {"rope_layers": nope_every(n_layers, SMOLLM3_NOPE_STEP)}
    if arch != "phi3":
        return {}
    out: dict[str, Any] = {}
    rot = f.int("rope.dimension_count", 2, head_dim, head_dim)
    if rot % 2:
        raise f.bad("rope.dimension_count", rot, "an even number: rope rotates pairs")
    if rot != head_dim:
        out["rotary_dim"] = rot
    window = f.int("attention.sliding_window", 0, 2**31 - 1, 0)  # the converter writes 0 for "none"
    if 0 < window < context:  # one of at least the context (Phi-3.5, Phi-4-mini: 262144) never binds
        out |= {"sliding_window": window, "sliding_layers": (True,) * n_layers}
    present = [n for n in ROPE_FACTOR_TENSORS if n in tensor_names]
    if len(present) == 1:
        missing = next(n for n in ROPE_FACTOR_TENSORS if n not in tensor_names)
        raise LocalLLMError(f"GGUF file has {present[0]!r} but not {missing!r}: LongRoPE needs both")
    if present:
        # above the model's context: the long set is never used (a cache never exceeds the context)
        out["rope_original_context"] = f.int("rope.scaling.original_context_length", 1, MAX_ORIGINAL, context)
        out["rope_attn_factor"] = f.float("rope.scaling.attn_factor", 1.0)
    return out


# ---- config.json


def _factor_list(rs, key: str, n: int) -> list[float]:
    value = rs.raw(key)
    ok = isinstance(value, list) and len(value) == n and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in value)
    if not ok:
        raise rs.bad(key, value, f"a list of {n} finite numbers above 0 (one per rotated pair)")
    return [float(x) for x in value]


def hf_rotary_dim(f, cfg: dict, head_dim: int) -> int:
    """Phi-4-mini's partial_rotary_factor (top level or in rope_parameters) -> rotated dims of a head."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    key = "partial_rotary_factor"
    value = next((v for v in (cfg.get(key), params.get(key)) if v is not None), 1.0)  # null: the default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise f.bad(key, value, "a number in (0, 1]")
    rot = int(head_dim * value)  # transformers' int(head_dim * partial_rotary_factor)
    if rot < 2 or rot % 2:
        raise f.bad(key, value, f"a fraction of head_dim {head_dim} giving an even number of dims")
    return rot


def hf_longrope(top, rot: int, context: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json's LongRoPE (top: a config_fields.Fields of config.json) -> (ModelConfig fields, GGUF name ->
    (rot/2,) divisor tensors); ({}, {}) without one. The tensors are what llama.cpp's converter writes as
    rope_factors_short/long."""
    cfg = top.values
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) not in LONGROPE_TYPES:
        return {}, {}
    f = type(top)(rs, "config.json", label="rope_scaling.")
    short, long = _factor_list(f, "short_factor", rot // 2), _factor_list(f, "long_factor", rot // 2)
    # Phi-3 keeps the pre-training length at the top level (transformers prefers it there)
    original = top.int("original_max_position_embeddings", 1, MAX_ORIGINAL,
                       f.int("original_max_position_embeddings", 1, MAX_ORIGINAL, context))
    if rs.get("attention_factor") is not None:
        attn = f.float("attention_factor")
    else:  # transformers: an explicit factor, else max_position_embeddings / original
        scale = f.float("factor") if rs.get("factor") is not None else context / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    fields = {"rope_original_context": original, "rope_attn_factor": attn}
    import torch

    tensors = {"rope_factors_short.weight": torch.tensor(short, dtype=torch.float32),
               "rope_factors_long.weight": torch.tensor(long, dtype=torch.float32)}
    return fields, tensors


def hf_rope_tensors(f, cfg) -> dict[str, torch.Tensor]:
    """LongRoPE divisors of the model cfg (a config.ModelConfig) read from its config.json (f: a
    config_fields.Fields of it): GGUF name -> (rotary_dim/2,) fp32; {} without LongRoPE. config.json was
    validated when cfg was read (hf_fields)."""
    if cfg.rope_original_context is None:
        return {}
    return hf_longrope(f, cfg.rotary_dim or cfg.head_dim, cfg.context_length)[1]


def hf_fields(arch: str, f, n_layers: int, head_dim: int, context: int) -> dict[str, Any]:
    """The phi3 / smollm3 ModelConfig fields from config.json (f: a config_fields.Fields of it)."""
    cfg = f.values
    if arch == "smollm3":
        return _smollm3_fields(f, cfg, n_layers)
    if arch != "phi3":
        return {}
    out: dict[str, Any] = {}
    rot = hf_rotary_dim(f, cfg, head_dim)
    if rot != head_dim:
        out["rotary_dim"] = rot
    window = f.int("sliding_window", 1, 2**31 - 1, 0) if cfg.get("sliding_window") is not None else 0
    # transformers' Phi3Model: a sliding-window mask in every layer when set; one of at least the
    # context (Phi-3.5, Phi-4-mini: 262144) never binds. llama.cpp ignores Phi-3's window for now
    # (llama_model_phi3: "Phi SWA is currently disabled"); we follow transformers.
    if 0 < window < context:
        out |= {"sliding_window": window, "sliding_layers": (True,) * n_layers}
    fields, _ = hf_longrope(f, rot, context)
    return out | fields


def _smollm3_fields(f, cfg: dict, n_layers: int) -> dict[str, Any]:
    """no_rope_layers (1 = rope) or every no_rope_layer_interval-th layer NoPE; sliding layers (NoPE
    ones, when use_sliding_window) as transformers' SmolLM3Config builds its layer_types."""
    listed = cfg.get("no_rope_layers")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != n_layers or any(x not in (0, 1) for x in listed):
            raise f.bad("no_rope_layers", listed, f"a list of {n_layers} values 0 or 1")
        rope = tuple(bool(x) for x in listed)
    else:
        rope = nope_every(n_layers, f.int("no_rope_layer_interval", 1, 2**31 - 1, SMOLLM3_NOPE_STEP))
    out: dict[str, Any] = {"rope_layers": rope} if not all(rope) else {}
    if f.bool("use_sliding_window", False) and cfg.get("sliding_window") is not None:
        types = cfg.get("layer_types")
        if types is None:
            sliding = tuple(not r for r in rope)
        elif isinstance(types, list) and len(types) == n_layers and all(
                t in ("full_attention", "sliding_attention") for t in types):
            sliding = tuple(t == "sliding_attention" for t in types)
        else:
            raise f.bad("layer_types", types, f"a list of {n_layers} 'full_attention' / 'sliding_attention'")
        if any(sliding):
            out |= {"sliding_window": f.int("sliding_window", 1, 2**31 - 1), "sliding_layers": sliding}
    return out
