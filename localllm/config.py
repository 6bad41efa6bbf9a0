"""One frozen dataclass describes every architecture we run, built from GGUF metadata or config.json.

Llama, Mistral, Qwen2 and Qwen3 differ only by fields here (qkv bias, q/k norm, rope scaling, tied
output), never by subclasses: the model module reads these fields and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import LocalLLMError

# GGUF `general.architecture` / HF `model_type` -> the fields that distinguish it.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x "llama3" frequency scaling (the only kind we apply); factor 1 means none."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _arch_fields(arch: str) -> dict[str, bool]:
    if arch not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise LocalLLMError(f"unknown architecture {arch!r} (supported: {known})")
    return ARCHITECTURES[arch]


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise LocalLLMError(f"GGUF metadata is missing {key!r}")
    return meta[key]


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """GGUF metadata (keys `{arch}.*`) -> ModelConfig; tied output when no `output.weight` tensor."""
    arch = _require(meta, "general.architecture")
    fields = _arch_fields(arch)
    get = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(_require(meta, f"{arch}.attention.head_count"))
    dim = int(_require(meta, f"{arch}.embedding_length"))
    head_dim = int(get("attention.key_length", dim // n_heads))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    # llama3 rope scaling travels in GGUF as the `rope_freqs.weight` tensor (per-frequency divisors),
    # which the loader reads; nothing to take from the metadata here.
    return ModelConfig(
        arch=arch,
        n_layers=int(_require(meta, f"{arch}.block_count")),
        dim=dim,
        ffn_dim=int(_require(meta, f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        context_length=int(get("context_length", 2048)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tied_output="output.weight" not in tensor_names,
        **fields,
    )


def _hf_rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise LocalLLMError(f"unsupported rope scaling type {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_context=int(rs.get("original_max_position_embeddings", 8192)),
    )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A Hugging Face config.json dict -> ModelConfig."""
    arch = cfg.get("model_type")
    fields = _arch_fields(arch)
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        arch=arch,
        n_layers=int(cfg["num_hidden_layers"]),
        dim=dim,
        ffn_dim=int(cfg["intermediate_size"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        tied_output=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=_hf_rope_scaling(cfg),
        **{**fields, "qkv_bias": bool(cfg.get("attention_bias", fields["qkv_bias"]))},
    )
