"""One frozen dataclass describes every architecture we run, built from GGUF metadata or config.json.

Llama, Mistral, Qwen2 and Qwen3 differ only by fields here (qkv bias, q/k norm, rope scaling, tied
output), never by subclasses: the model module reads these fields and nothing else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from . import gemma, moe_config
from .errors import LocalLLMError
from .settings import DEFAULT_LIMITS, LoaderLimits

MISSING = object()  # "no default": Fields.raw raises when the key is absent

# GGUF `general.architecture` / HF `model_type` -> the fields that distinguish it.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
    "gemma2": dict(qkv_bias=False, qk_norm=False),
    "gemma3": dict(qkv_bias=False, qk_norm=True),
    "phi3": dict(qkv_bias=False, qk_norm=False),  # Phi-3, 3.5, 4 (config_phi3.py)
    "smollm3": dict(qkv_bias=False, qk_norm=False),
    # mixture of experts (moe_config.py); Mixtral's GGUF says `llama`
    "mixtral": dict(qkv_bias=False, qk_norm=False),
    "qwen3moe": dict(qkv_bias=False, qk_norm=True),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True),
    "gpt-oss": dict(qkv_bias=True, qk_norm=False),
    "gpt_oss": dict(qkv_bias=True, qk_norm=False),
    "gemma4": dict(qkv_bias=False, qk_norm=True),  # read by gemma4.py (validate.py picks it), not here
}


# Architectures whose configs have a reader of their own (it imports this module): arch -> file.
OWN_READERS = {"gemma4": "gemma4.py"}


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling; factor 1 means none. kind "llama3": Llama 3.x's banded divisors
    (low/high_freq_factor); kind "linear": every frequency divided by factor (HF "linear", GGUF
    rope.scaling.type "linear": positions / factor); kind "yarn": beta_fast/slow, and truncate (the
    correction range rounded outwards to whole dims: transformers' default and llama.cpp's rule;
    gpt-oss says false). localllm/rope.py turns it into divisors."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_output: bool = False
    rope_scaling: RopeScaling | None = None
    # --- families beyond Llama (issue 19): every default is Llama's, so a Llama config sets none ---
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(dim))
    activation: str = "silu"  # the GLU's gate function: "silu", "gelu_tanh" (Gemma), "swiglu_oai" (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss clamps gate and up to this before its GLU
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add (Gemma 2/3/4)
    attn_scale: float | None = None  # scores times this; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2/3/4)
    attn_out_bias: bool = False  # attn_output has a bias (gpt-oss)
    attn_sinks: bool = False  # one learned logit per head joins each softmax, then is dropped (gpt-oss)
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    # per layer, True where attention slides (a window); () = no sliding layers
    sliding_layers: tuple[bool, ...] = ()
    rope_theta_local: float | None = None  # rope base of sliding layers (Gemma 3); None: rope_theta
    # per layer, False where the layer has no rope (SmolLM3's NoPE layers); () = rope everywhere
    rope_layers: tuple[bool, ...] = ()
    rotary_dim: int | None = None  # dims of a head that rope rotates (Phi-4-mini: 3/4); None: head_dim
    rope_attn_factor: float = 1.0  # cos and sin of the global rope set times this (YaRN, LongRoPE)
    # LongRoPE (config_phi3.py): the model holds rope_factors_short / rope_factors_long divisors and uses
    # the long ones when the context in use (the KV cache's capacity) exceeds this; None: no LongRoPE
    rope_original_context: int | None = None
    # mixture of experts (Mixtral, Qwen3-MoE, gpt-oss); n_experts 0 = a dense MLP in every layer
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    moe_norm_topk: bool = True  # the chosen experts' softmax weights renormalised to sum to 1
    moe_bias: bool = False  # router and expert products have biases (gpt-oss)
    # "softmax": top-k of softmax(router logits) (Mixtral, Qwen3-MoE); "topk_softmax": top-k of the
    # logits, softmax over those k (gpt-oss) (localllm/moe.py route)
    moe_gating: str = "softmax"
    # --- Gemma 4 (gemma4.py reads them from config.json / GGUF): layers of two shapes, shared caches, PLE
    head_dim_global: int | None = None  # head dim of the non-sliding layers (global_head_dim); None: head_dim
    n_kv_heads_global: int | None = None  # kv heads of the non-sliding layers; None: n_kv_heads
    attn_k_eq_v: bool = False  # non-sliding layers have no attn_v: values are the key projection
    attn_v_norm: bool = False  # values RMS-normalised (no weight) before the cache
    # fraction of the global rope set's frequencies that rotate ("proportional" rope: the others are 0,
    # the exponent still over the whole head; GGUF's rope_freqs carries it as divisors 1e30)
    rope_partial_global: float = 1.0
    n_kv_shared_layers: int = 0  # the last N layers read the cache of the last earlier layer of their kind
    double_wide_mlp: bool = False  # KV-shared layers have an MLP of 2 * ffn_dim
    per_layer_dim: int = 0  # per-layer embeddings (PLE): width of each layer's input; 0 = none
    layer_out_scale: bool = False  # each layer's output (residual included) times a learned scalar
    moe_with_mlp: bool = False  # experts beside the dense MLP, with their own norms (Gemma 4: gemma4_moe.py)

    def sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def has_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def layer_head_dim(self, layer: int) -> int:
        """Head dim of this layer (Gemma 4: global_head_dim on non-sliding layers)."""
        return self.head_dim_global if self.head_dim_global and not self.sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.n_kv_heads_global if self.n_kv_heads_global and not self.sliding(layer) else self.n_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose cache rows this layer attends to: itself, or for one of the last
        n_kv_shared_layers the last earlier layer of its kind (sliding or not), as transformers'
        Gemma4TextConfig.kv_sharing_modes and llama.cpp's n_layer_kv_from_start pick it."""
        first = self.n_layers - self.n_kv_shared_layers
        if layer < first:
            return layer
        return max(j for j in range(first) if self.sliding(j) == self.sliding(layer))

    def layer_ffn_dim(self, layer: int) -> int:
        return 2 * self.ffn_dim if self.double_wide_mlp and self.kv_source(layer) != layer else self.ffn_dim

    @property
    def uniform_kv(self) -> bool:
        """Every layer has its own cache of one shape (one (L, B, Hkv, S, D) buffer serves)."""
        return not self.n_kv_shared_layers and self.head_dim_global in (None, self.head_dim) and \
            self.n_kv_heads_global in (None, self.n_kv_heads)

    @property
    def llama_layer(self) -> bool:
        """True when every layer is the Llama layer the fast decoders (C++, CUDA graphs) implement:
        none of the fields above set. Backends run other configs on the portable torch forward."""
        return self == replace(self, **{f.name: f.default for f in fields(ModelConfig) if f.name in FAMILY_FIELDS})

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


# The fields of issue 19's families (ModelConfig.llama_layer: all at their defaults).
FAMILY_FIELDS = frozenset({
    "embed_scale", "activation", "swiglu_limit", "post_norms", "attn_scale", "attn_softcap", "final_softcap",
    "attn_out_bias", "attn_sinks", "sliding_window", "sliding_layers", "rope_theta_local", "rope_layers",
    "rotary_dim", "rope_attn_factor", "n_experts", "n_experts_used", "expert_ffn_dim", "moe_norm_topk", "moe_bias",
    "rope_original_context", "moe_gating",
    "head_dim_global", "n_kv_heads_global", "attn_k_eq_v", "attn_v_norm", "rope_partial_global",
    "n_kv_shared_layers", "double_wide_mlp", "per_layer_dim", "layer_out_scale", "moe_with_mlp",
})


# model_types whose transformers config ties the output to the embedding unless config.json says not
TIED_BY_DEFAULT = frozenset({"smollm3"})


def _arch_fields(arch: Any, key: str) -> dict[str, bool]:
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise LocalLLMError(f"unknown architecture {arch!r} in {key} (supported: {known})")
    return ARCHITECTURES[arch]


class Fields:
    """Typed, range-checked reads of one config source (GGUF metadata or config.json): a wrong type or
    an out-of-range value is one LocalLLMError naming the key, its value and what was expected."""

    def __init__(self, values: dict[str, Any], source: str, prefix: str = "", label: str | None = None):
        self.values = values
        self.source = source  # "GGUF metadata" or "config.json"
        self.prefix = prefix  # "llama." for GGUF keys, "" for config.json
        self.label = prefix if label is None else label  # shown before a key: "rope_scaling." for a nested object

    def raw(self, key: str, default: Any = MISSING) -> Any:
        value = self.values.get(self.prefix + key)
        if value is None:  # absent, or JSON null (HF writes null for "use the default")
            if default is MISSING:
                raise LocalLLMError(f"{self.source} is missing {self.label + key!r}")
            return default
        return value

    def bad(self, key: str, value: Any, expected: str) -> LocalLLMError:
        shown = repr(value) if not isinstance(value, (list, dict)) else f"a {type(value).__name__}"
        return LocalLLMError(f"{self.source} {self.label + key!r} is {shown}, expected {expected}")

    def int(self, key: str, lo: int, hi: int, default: Any = MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.bad(key, value, f"an integer from {lo} to {hi}")
        return value

    def float(self, key: str, default: Any = MISSING) -> float:
        """A finite, positive number (epsilons, rope bases and factors)."""
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.bad(key, value, "a finite number above 0")
        return float(value)

    def bool(self, key: str, default: Any = MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value


def check_shape_fields(cfg: ModelConfig, names: dict[str, str], source: str, limits: LoaderLimits) -> None:
    """The relations between fields; names: field -> the key that set it, for the message."""
    def fail(what: str) -> LocalLLMError:
        return LocalLLMError(f"{source}: {what}")

    if cfg.n_heads % cfg.n_kv_heads:
        raise fail(f"{names['n_heads']} = {cfg.n_heads} is not a multiple of {names['n_kv_heads']} = {cfg.n_kv_heads}")
    if cfg.head_dim % 2:
        raise fail(f"head dimension {cfg.head_dim} ({names['head_dim']}) is odd: rope rotates pairs")
    if cfg.q_dim > limits.max_dim:
        raise fail(f"{cfg.n_heads} heads of {cfg.head_dim} make {cfg.q_dim} query values, at most {limits.max_dim}")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn" and cfg.rope_theta <= 1:
        raise fail(f"rope base {cfg.rope_theta} with YaRN scaling: its correction range (rope.yarn_rope_factors)"
                   " divides by log(base), which needs a base above 1")


def _head_dim(f: Fields, key: str, dim: int, n_heads: int, heads_key: str, limits: LoaderLimits) -> int:
    """The explicit head dimension, else dim / n_heads, which must then divide evenly."""
    if f.raw(key, None) is not None:
        return f.int(key, 2, limits.max_dim)
    if dim % n_heads:
        raise LocalLLMError(
            f"{f.source}: {f.label + heads_key} = {n_heads} does not divide the embedding width {dim}"
            f" (and {f.label + key!r} is not given)"
        )
    return dim // n_heads


def config_from_gguf(
    meta: dict[str, Any], tensor_names: set[str], limits: LoaderLimits = DEFAULT_LIMITS
) -> ModelConfig:
    """GGUF metadata (keys `{arch}.*`) -> ModelConfig; tied output when no `output.weight` tensor.
    Every field is type- and range-checked (Fields) before any arithmetic on it."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise LocalLLMError("GGUF metadata is missing 'general.architecture'")
    if isinstance(arch, str) and arch in OWN_READERS:
        raise LocalLLMError(f"{arch} metadata is read by localllm/{OWN_READERS[arch]} (validate.check_gguf)")
    fields = _arch_fields(arch, "general.architecture")
    f = Fields(meta, "GGUF metadata", f"{arch}.")
    n_heads = f.int("attention.head_count", 1, limits.max_heads)
    dim = f.int("embedding_length", 1, limits.max_dim)
    head_dim = _head_dim(f, "attention.key_length", dim, n_heads, "attention.head_count", limits)
    if f.raw("attention.value_length", head_dim) != head_dim:
        raise f.bad("attention.value_length", meta[f"{arch}.attention.value_length"], f"{head_dim} (the key length)")
    tokens = meta.get("tokenizer.ggml.tokens", [])
    vocab = f.int("vocab_size", 1, limits.max_vocab, len(tokens) if isinstance(tokens, list) and tokens else MISSING)
    # llama3 rope scaling travels in GGUF as the `rope_freqs.weight` tensor (per-frequency divisors),
    # which the loader reads; linear scaling as rope.scaling.type / rope.scaling.factor.
    cfg = ModelConfig(
        arch=arch,
        n_layers=f.int("block_count", 1, limits.max_layers),
        dim=dim,
        ffn_dim=f.int("feed_forward_length", 1, limits.max_ffn_dim),
        n_heads=n_heads,
        n_kv_heads=f.int("attention.head_count_kv", 1, n_heads, n_heads),
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=f.int("context_length", 1, limits.max_context, 2048),
        norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=f.float("rope.freq_base", 10000.0),
        tied_output="output.weight" not in tensor_names,
        rope_scaling=_gguf_rope_scaling(f),
        **fields,
    )
    if arch in gemma.GEMMA_ARCHS:
        cfg = replace(cfg, **gemma.gguf_fields(f, arch, cfg.n_layers, dim, n_heads, head_dim, limits.max_context))
    from .config_phi3 import gguf_fields  # here: config_phi3 is called with this module's Fields

    cfg = replace(cfg, **gguf_fields(arch, f, tensor_names, cfg.n_layers, head_dim, cfg.context_length))
    cfg = replace(cfg, **moe_config.gguf_fields(f, cfg, limits, RopeScaling))
    names = dict(n_heads=f"{arch}.attention.head_count", n_kv_heads=f"{arch}.attention.head_count_kv",
                 head_dim=f"{arch}.attention.key_length")
    check_shape_fields(cfg, names, "GGUF metadata", limits)
    return cfg


def _gguf_rope_scaling(f: Fields) -> RopeScaling | None:
    """rope.scaling.type "linear" with rope.scaling.factor (TextModel.set_gguf_parameters writes them
    for HF rope_type "linear"); other types are read where their families are."""
    if f.raw("rope.scaling.type", None) != "linear":
        return None
    factor = f.float("rope.scaling.factor", 1.0)
    return None if factor == 1.0 else RopeScaling(factor=factor, kind="linear")


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
    fields = _arch_fields(arch, "config.json 'model_type'")
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
        head_dim=_head_dim(f, "head_dim", dim, n_heads, "num_attention_heads", limits),
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
    from .config_phi3 import hf_fields  # here: config_phi3 is called with this module's Fields

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
