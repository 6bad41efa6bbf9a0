"""`localllm serve`: open the model, start the engine, serve the OpenAI-compatible API until Ctrl-C."""

from __future__ import annotations

import time
from pathlib import Path

from uvicorn.config import LOG_LEVELS

from localllm.chat_template import resolve_template
from localllm.draft import open_drafter
from localllm.engine import Engine
from localllm.engine_spec import Speculation
from localllm.errors import LocalLLMError
from localllm.load import LoadedModel
from localllm.registry import default_model_name
from localllm.runner import context_size
from localllm.server.app import Served
from localllm.settings import DEFAULT_DRAFT, DEFAULT_SAMPLING, DEFAULT_SERVE, DraftSettings, SamplingSettings, ServeSettings


def model_names(spec: str | None, path: Path) -> tuple[str, ...]:
    """The model's id in /v1/models (the name it was opened by), then other names requests may use."""
    first = spec or default_model_name()
    return tuple(dict.fromkeys((first, path.name, path.stem, str(path))))


def check_serve_options(parallel: int, port: int, api_key: str | None, log_level: str = "info") -> None:
    """Before the model loads."""
    if log_level not in LOG_LEVELS:  # uvicorn's names (its Config raises KeyError on another)
        raise LocalLLMError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if parallel < 1:
        raise LocalLLMError(f"--parallel must be at least 1, got {parallel}")
    if not 0 <= port <= 65535:
        raise LocalLLMError(f"--port must be 0 to 65535, got {port}")
    if api_key is not None and not api_key.strip():
        raise LocalLLMError("--api-key is empty")


def in_own_thread(fn):
    """fn() in a thread of its own, which then ends -> fn's result (its exception raised here). The CPU
    kernels' OpenMP thread pools belong to the thread that opens a parallel region and live as long as
    it: the load's pool left in the main thread, beside the engine thread's, makes more OpenMP threads
    than cores, and libgomp then stops spinning at its barriers (dozens a decode step): serve's steps
    ran 3-4x slower than the same steps in one thread (2-core Xeon: 14.5 against 3.9 ms;
    docs/PERFORMANCE.md). Loaded in a thread that ends, the engine thread's pool is the only one. A
    daemon thread, not an executor: Ctrl-C during the load ends the process at once, where an
    executor's shutdown would wait for the load to finish."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller as it is
            out["error"] = e

    t = threading.Thread(target=run, name="localllm-load", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def warm_up(engine: Engine, notify) -> int:
    """Before listening: the runtime prepares what the slots' first steps and prompts would (CUDA: each
    batch bucket's decode graph, every prompt kernel variant), and so does a draft model's runtime for its
    own slots, so the first requests do not wait for it -> graphs captured."""
    rt = engine.runtime
    if rt.warms_up:
        notify(f"warming up {engine.parallel} slots ...")
    t0 = time.perf_counter()
    captured = rt.warm_up_slots(engine.slots, engine.prefill_tokens)
    spec = engine.speculation
    if spec is not None and spec.rt is not None:  # --draft: its decode, verify and catch-up passes
        captured += spec.rt.warm_up_slots(spec.slots, engine.prefill_tokens)
    if rt.warms_up:
        notify(f"warmed up in {time.perf_counter() - t0:.1f} s ({captured} decode graphs)")
    return captured


def build_served(lm: LoadedModel, spec: str | None, parallel: int, ctx: int, api_key: str | None = None,
                 chat_template: str | None = None, limits: ServeSettings = DEFAULT_SERVE,
                 defaults: SamplingSettings = DEFAULT_SAMPLING, notify=lambda text: None,
                 draft: DraftSettings = DEFAULT_DRAFT, warm: bool = True) -> Served:
    """The engine (started) and what the app needs: ctx is each slot's context, capped at the model's;
    draft: speculative decoding (--draft / --lookup; a draft model of another vocabulary fails here);
    warm: everything warmed up before (warm_up), else each kernel compiled and graph captured at its
    first use (a request's wait, as `complete`'s first tokens)."""
    capacity = context_size(lm, ctx)
    drafter = open_drafter(lm.runtime, lm.tokenizer, draft, defaults)  # a bad draft model: its error first
    template, notice = resolve_template(chat_template, lm.tokenizer.chat_template)
    if notice:
        notify(notice)
    per_step = limits.prefill_tokens_compute_bound if lm.runtime.prompts_compute_bound else limits.prefill_tokens
    speculation = None if drafter is None else Speculation(drafter, draft, limits.speculate_max_slots, parallel,
                                                           capacity)
    engine = Engine(lm.runtime, lm.tokenizer.stop_ids, parallel, capacity, limits.max_queue,
                    per_step, limits.prefill_share_min, speculation=speculation)
    if warm:
        warm_up(engine, notify)
    engine.start()
    return Served(engine, lm.tokenizer, template, model_names(spec, lm.path), api_key, limits, defaults)
