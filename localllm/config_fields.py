"""Typed, range-checked reads of one config source (GGUF metadata or config.json), and the checks every
config reader shares (config_gguf.py, config_hf.py, gemma4.py): the architecture's fields, the head
dimension, the relations between fields.
"""

from __future__ import annotations

import math
from typing import Any

from .config import ARCHITECTURES, ModelConfig
from .errors import LocalLLMError
from .settings import LoaderLimits

MISSING = object()  # "no default": Fields.raw raises when the key is absent


def arch_fields(arch: Any, key: str) -> dict[str, bool]:
    """The ModelConfig fields that distinguish arch (ARCHITECTURES); key: where arch was read, for the error."""
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


def read_head_dim(f: Fields, key: str, dim: int, n_heads: int, heads_key: str, limits: LoaderLimits) -> int:
    """The explicit head dimension, else dim / n_heads, which must then divide evenly."""
    if f.raw(key, None) is not None:
        return f.int(key, 2, limits.max_dim)
    if dim % n_heads:
        raise LocalLLMError(
            f"{f.source}: {f.label + heads_key} = {n_heads} does not divide the embedding width {dim}"
            f" (and {f.label + key!r} is not given)"
        )
    return dim // n_heads
