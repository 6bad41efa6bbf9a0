"""Library entry points the CLI calls (and tests call directly): open a model, complete a prompt."""

from __future__ import annotations

import time
from typing import Iterator

from .device import pick_device, pick_dtype, rank_device
from .draft import open_drafter
from .generate import Stats, check_generation, generate, stream_text
from .load import LoadedModel, load_model
from .sampling import Sampler
from .settings import DEFAULT_DRAFT, DEFAULT_GENERATION, DEFAULT_SAMPLING, DraftSettings, GenerationSettings, SamplingSettings
from .speculative import Drafter, SpecStats, describe_speculative, generate_speculative


def open_model(spec: str | None, device: str = "auto", dtype: str | None = None, tp=None) -> LoadedModel:
    """tp: this rank's parallel.TensorParallel (load only its shard), None: the whole model."""
    dev = rank_device(pick_device(device), tp)
    return load_model(spec, dev, pick_dtype(dev, dtype), tp=tp)


def context_size(lm: LoadedModel, requested: int) -> int:
    """The KV cache's size: --ctx (at least 2: generate.check_generation), capped at the model's."""
    return min(requested, lm.config.context_length)


def context_notice(lm: LoadedModel, requested: int | None) -> str | None:
    """A notice when an explicit --ctx is capped at the model's trained context."""
    if requested is None or requested <= lm.config.context_length:
        return None
    return f"--ctx {requested} is more than the model's context: using {lm.config.context_length}"


def stop_notice(stats: Stats) -> str | None:
    """Why generation ended, when the user may not expect it: the context was full."""
    if not stats.context_full:
        return None
    return f"generation stopped: the context ({stats.context_full} tokens) is full (raise --ctx for more)"


def encode_prompt(lm: LoadedModel, prompt: str) -> list[int]:
    """Tokens for a raw completion prompt: BOS as the model's metadata says, special tokens parsed."""
    return lm.tokenizer.encode(prompt, add_bos=lm.tokenizer.add_bos, parse_special=True)


def complete(
    lm: LoadedModel,
    prompt: str,
    gen: GenerationSettings = DEFAULT_GENERATION,
    sampling: SamplingSettings = DEFAULT_SAMPLING,
    stats: Stats | None = None,
    drafter: Drafter | None = None,
    draft: DraftSettings = DEFAULT_DRAFT,
    plain_steps: int = 0,
) -> Iterator[str]:
    """Stream the continuation of `prompt` as text pieces; with a drafter (draft.open_drafter), by
    speculative decoding (stats: a SpecStats; draft: how many to draft; plain_steps: see
    generate_speculative)."""
    check_generation(gen.max_tokens, gen.ctx)
    ids = encode_prompt(lm, prompt)
    cache = lm.runtime.new_cache(context_size(lm, gen.ctx))
    sampler = Sampler(sampling, lm.runtime.device)
    if drafter is not None:
        tokens = generate_speculative(lm.runtime, cache, ids, sampler, drafter, gen.max_tokens, lm.tokenizer.stop_ids,
                                      stats, settings=draft, plain_steps=plain_steps)
    else:
        tokens = generate(lm.runtime, cache, ids, sampler, gen.max_tokens, lm.tokenizer.stop_ids, stats)
    return stream_text(lm.tokenizer, tokens, gen.stop)


def timed_open(spec: str | None, device: str, dtype: str | None, tp=None) -> tuple[LoadedModel, float]:
    t0 = time.perf_counter()
    lm = open_model(spec, device, dtype, tp)
    return lm, time.perf_counter() - t0


def timed_drafter(lm: LoadedModel, ds: DraftSettings, sampling: SamplingSettings) -> tuple[Drafter | None, float]:
    t0 = time.perf_counter()
    drafter = open_drafter(lm.runtime, lm.tokenizer, ds, sampling)
    return drafter, time.perf_counter() - t0


def describe_stats(stats: Stats, load_seconds: float | None) -> str:
    """One run's speeds; load_seconds None leaves the load out (chat says it once, not every reply)."""
    line = (
        (f"load {load_seconds:.2f} s | " if load_seconds is not None else "")
        + f"prompt {stats.prompt_tokens} tokens, {stats.prompt_tps():.1f} tokens/s"
        f" | generated {stats.generated_tokens} tokens, {stats.generate_tps():.1f} tokens/s"
    )
    return line + "\n" + describe_speculative(stats) if isinstance(stats, SpecStats) else line

