"""Every default of generation lives here; the CLI and the library read these and nothing else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0 disables
    repeat_penalty: float = 1.0  # 1.0 disables (llama.cpp semantics: divide positive logits)
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None  # None: a fresh random seed


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 256
    ctx: int = 4096  # KV cache capacity; capped at the model's trained context
    stop: tuple[str, ...] = ()  # stop strings (end-of-turn tokens always stop)


DEFAULT_SAMPLING = SamplingSettings()
DEFAULT_GENERATION = GenerationSettings()
