"""`localllm pull`, `list` and `rm`: models fetched from the Hugging Face Hub (localllm/hub.py) and the
named models of models.toml."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localllm import hub
from localllm.errors import LocalLLMError
from localllm.registry import packaged_models

REF_HELP = "owner/repo[:QUANT] (e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M), or a safetensors repo"


@dataclass(frozen=True)
class ListedModel:
    name: str
    size: int | None  # bytes; None: not installed
    kind: str  # gguf, safetensors
    path: Path | None
    source: str  # "models.toml" or "hub"


def hub_ref(spec: str) -> hub.RepoRef:
    ref = hub.parse_ref(spec)
    if ref is None:
        raise LocalLLMError(f"not a Hugging Face repo reference: {spec!r} (expected {REF_HELP})")
    return ref


def pull_model(spec: str) -> hub.CachedModel:
    return hub.pull(hub_ref(spec))


def list_models() -> list[ListedModel]:
    """models.toml's names first, then what the hub cache holds."""
    out = []
    for name, path in packaged_models():
        size = path.stat().st_size if path is not None and path.is_file() else None
        out.append(ListedModel(name, size, "gguf", path if size is not None else None, "models.toml"))
    out += [ListedModel(m.name, m.size, m.kind, m.path, "hub") for m in hub.cached_models()]
    return out


def remove_model(spec: str) -> list[Path]:
    if spec in {name for name, _ in packaged_models()}:
        raise LocalLLMError(f"{spec} is a packaged model of models.toml: uninstall its package with pip instead")
    return hub.remove(hub_ref(spec))
