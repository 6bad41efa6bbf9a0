"""Range checks of option values, one message shape for every command: "--top-p must be between 0 and 1,
got 2". The settings' check functions (sampling.check_settings, generate.check_generation,
draft.check_draft, ...) call these before any model loads; NaN and infinities fail every range."""

from __future__ import annotations

import math

from .errors import LocalLLMError

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 64 bits


def shown(value: int | float) -> str:
    """2.0 -> "2", 1e23 -> "1e+23", nan -> "nan"; ints as they are."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise LocalLLMError(f"{name} must be a finite number, got {shown(value)}")


def at_least(name: str, value: int | float, low: int | float, meaning: str = "") -> None:
    """value >= low (and finite); meaning: what the bound stands for, e.g. "(0: greedy)"."""
    if isinstance(value, float):
        finite(name, value)
    if not value >= low:
        raise LocalLLMError(f"{name} must be at least {shown(low)}{' ' + meaning if meaning else ''}, got {shown(value)}")


def above(name: str, value: float, low: float) -> None:
    finite(name, value)
    if not value > low:
        raise LocalLLMError(f"{name} must be above {shown(low)}, got {shown(value)}")


def between(name: str, value: int | float, low: int | float, high: int | float) -> None:
    """low <= value <= high (NaN fails: every comparison with it is false)."""
    if not low <= value <= high:
        raise LocalLLMError(f"{name} must be between {shown(low)} and {shown(high)}, got {shown(value)}")


def seed(value: int | None) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise LocalLLMError(f"--seed must be between 0 and 2^64-1 ({SEED_LIMIT - 1}), got {value}")


def counts(name: str, text: str, low: int) -> list[int]:
    """A comma-separated list of whole numbers, each at least low ("512,1024" -> [512, 1024])."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise LocalLLMError(f"{name} takes comma-separated whole numbers of at least {low}, got {text!r}")
    return values
