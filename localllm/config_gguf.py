"""GGUF metadata (keys `{arch}.*`) -> ModelConfig (config.py), every field checked (config_fields.Fields)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from . import gemma, moe_config
from .config import OWN_READERS, ModelConfig, RopeScaling
from .config_fields import MISSING, Fields, arch_fields, check_shape_fields, read_head_dim
from .errors import LocalLLMError
from .settings import DEFAULT_LIMITS, LoaderLimits


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
    fields = arch_fields(arch, "general.architecture")
    f = Fields(meta, "GGUF metadata", f"{arch}.")
    n_heads = f.int("attention.head_count", 1, limits.max_heads)
    dim = f.int("embedding_length", 1, limits.max_dim)
    head_dim = read_head_dim(f, "attention.key_length", dim, n_heads, "attention.head_count", limits)
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
    from .config_phi3 import gguf_fields  # here: config_phi3 is called with config_fields.Fields

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
