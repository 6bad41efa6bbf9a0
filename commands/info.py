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
from localllm.validate import check_gguf, check_hf_folder
from localllm.weights import hf_tensor_headers


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
    return cfg, params, types, load_hf_tokenizer(folder)


def model_info(spec: str | None) -> dict[str, Any]:
    path = resolve_model(spec)
    cfg, params, types, tok = _hf_info(path) if path.is_dir() else _gguf_info(path)
    return {
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
        "chat_template": tok.chat_template is not None,
    }
