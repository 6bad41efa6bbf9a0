"""`localllm info`: what a model file holds, read from metadata and tensor headers (no weights decoded)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .config import ModelConfig, config_from_gguf, config_from_hf
from .errors import LocalLLMError
from .gguf_file import open_gguf
from .load import file_size
from .registry import resolve_model
from .tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from .weights import safetensors_files


def _gguf_info(path: Path) -> tuple[ModelConfig, int, Counter, Tokenizer]:
    f = open_gguf(path)
    cfg = config_from_gguf(f.metadata, set(f.tensors))
    params = sum(int(t.n_elements) for t in f.tensors.values())
    types = Counter(t.tensor_type.name for t in f.tensors.values())
    return cfg, params, types, load_gguf_tokenizer(f.metadata)


def _hf_info(folder: Path) -> tuple[ModelConfig, int, Counter, Tokenizer]:
    from safetensors import safe_open

    if not (folder / "config.json").exists():
        raise LocalLLMError(f"not a model folder: {folder} has no config.json")
    try:
        cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    except (json.JSONDecodeError, KeyError) as e:  # as load.read_hf_folder: one line, no traceback
        raise LocalLLMError(f"bad config.json in {folder}: {e}") from None
    params, types = 0, Counter()
    for p in safetensors_files(folder):
        with safe_open(str(p), framework="np") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                params += n
                types[sl.get_dtype()] += 1
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
