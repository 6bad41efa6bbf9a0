"""`localllm info`: what a model file holds, read from metadata and tensor headers (no weights decoded)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from localllm.config import ModelConfig
from localllm.gguf_file import open_gguf
from localllm.load import file_size
from localllm.registry import resolve_model
from localllm.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from localllm.moe_mxfp4 import is_mxfp4_how
from localllm.validate import check_gguf, check_hf_folder
from localllm.weights import hf_moe_headers, hf_tensor_headers


def _gguf_info(path: Path) -> tuple[ModelConfig, int, Counter, Tokenizer]:
    f = open_gguf(path)
    cfg = check_gguf(f)
    params = sum(int(t.n_elements) for t in f.tensors.values())
    types = Counter(t.tensor_type.name for t in f.tensors.values())
    return cfg, params, types, load_gguf_tokenizer(f.metadata)


def _hf_info(folder: Path) -> tuple[ModelConfig, int, Counter, Tokenizer]:
    cfg, _ = check_hf_folder(folder)  # the config and every tensor header, as loading checks them
    params, types = 0, Counter()
    for _, _, _, shape, dtype in hf_tensor_headers(folder, cfg):
        params += math.prod(shape)
        types[dtype] += 1
    for part in {p.key: p for p in hf_moe_headers(folder)}.values():  # expert tensors, each key once
        if is_mxfp4_how(part.how):  # a released gpt-oss's experts: 2 values a byte of blocks, scales aside
            if not part.how.startswith("mxfp4_scales"):
                params += 2 * math.prod(part.shape)
                types["MXFP4"] += 1
            continue
        params += math.prod(part.shape)
        types[part.dtype] += 1
    return cfg, params, types, load_hf_tokenizer(folder)


def model_info(spec: str | None) -> dict[str, Any]:
    path = resolve_model(spec)
    cfg, params, types, tok = _hf_info(path) if path.is_dir() else _gguf_info(path)
    out = {
        "path": str(path),
        "architecture": cfg.arch,
        "parameters": params,
        "file_size": file_size(path),
        "tensor_types": dict(types.most_common()),
        "context_length": cfg.context_length,
        "layers": cfg.n_layers,
        "dim": cfg.dim,
        "heads": f"{cfg.n_heads} (kv {cfg.n_kv_heads}, head dim {cfg.head_dim})",
        "vocab_size": cfg.vocab_size,
        "tokenizer": tok.kind + (f" (pre-tokenizer {tok.pre})" if getattr(tok, "pre", None) else ""),
        "chat_template": describe_template(tok.chat_template),
    }
    return out | family_facts(cfg)


def describe_template(source: str | None, width: int = 60) -> str:
    """The model's chat template in a few words: a built-in name when it is one of them, else "from the
    file" with its first non-blank line (cut at `width` characters); none: what `chat` uses instead."""
    from localllm.chat_template import BUILTIN_TEMPLATES

    if source is None:
        return "none (chat uses chatml)"
    for name, builtin in BUILTIN_TEMPLATES.items():
        if source.strip() == builtin.strip():
            return name
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    shown = first if len(first) <= width else first[: width - 3] + "..."
    return f"from the file: {shown}" if shown else "from the file"


def family_facts(cfg) -> dict[str, str]:
    """What distinguishes a family beyond the Llama layer, in `info`'s words (only what cfg sets)."""
    out = {}
    if cfg.n_experts:
        out["experts"] = f"{cfg.n_experts} ({cfg.n_experts_used} used, expert ffn {cfg.expert_ffn_dim})"
    if cfg.sliding_layers and any(cfg.sliding_layers):
        out["sliding_window"] = (f"{cfg.sliding_window} tokens on {sum(cfg.sliding_layers)} of {cfg.n_layers}"
                                 " layers")
    caps = {"attention": cfg.attn_softcap, "logits": cfg.final_softcap}
    if any(v is not None for v in caps.values()):
        out["soft_caps"] = ", ".join(f"{k} {v:g}" for k, v in caps.items() if v is not None)
    if cfg.rope_layers and not all(cfg.rope_layers):
        out["no_rope_layers"] = f"{cfg.rope_layers.count(False)} of {cfg.n_layers}"
    if cfg.rotary_dim:
        out["rotary_dims"] = f"{cfg.rotary_dim} of {cfg.head_dim}"
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = f"{cfg.rope_scaling.kind}, factor {cfg.rope_scaling.factor:g}"
    if cfg.rope_original_context is not None:
        out["rope_scaling"] = f"longrope, original context {cfg.rope_original_context}"
    if cfg.attn_sinks:
        out["attention_sinks"] = "yes"
    if cfg.per_layer_dim:
        out["per_layer_embeddings"] = f"{cfg.per_layer_dim} per layer"
    return out
