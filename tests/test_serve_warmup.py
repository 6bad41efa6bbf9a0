"""`serve`'s start-up warm-up (Runtime.warm_up_slots, commands/serve.warm_up): build_served calls it once
on the engine's slots before the engine starts; on the CPU (the portable method) it runs nothing: no
step, no line printed, every slot still empty. (On CUDA, that a 16-request burst after it captures no
graph: tests/gpu/test_gpu_serve_warmup.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from localllm.commands.serve import build_served, warm_up
from localllm.config import ModelConfig
from localllm.engine import Engine
from localllm.load import build_model
from localllm.runtime import Runtime
from localllm.synthetic import synthetic_state

TINY = ModelConfig(arch="llama", n_layers=2, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=300, context_length=128, norm_eps=1e-5, rope_theta=10000.0)


def test_build_served_warms_up_once_before_the_engine_starts(default_lm, monkeypatch):
    rt = default_lm.runtime
    calls = []
    original = type(rt).warm_up_slots

    def spy(self, slots, prefill_tokens):
        calls.append((slots, prefill_tokens, len(engines)))  # engines started so far
        return original(self, slots, prefill_tokens)

    engines = []
    real_start = Engine.start
    monkeypatch.setattr(type(rt), "warm_up_slots", spy)
    monkeypatch.setattr(Engine, "start", lambda self: (engines.append(self), real_start(self))[1])
    lines = []
    served = build_served(default_lm, None, 3, 64, notify=lines.append)
    try:
        assert calls == [(served.engine.slots, served.engine.prefill_tokens, 0)] and engines == [served.engine]  # before it started
        assert lines == []  # the CPU backend prepares nothing: no "warming up" line
        assert served.engine.slots.lengths == [0, 0, 0] and served.engine.stats.steps == 0
    finally:
        served.engine.stop()
        served.engine.join(10)


def test_portable_warm_up_runs_nothing(monkeypatch):
    state, _ = synthetic_state(TINY, "f32", "cpu", seed=1)
    rt = build_model(TINY, state, "cpu", torch.float32, backend=Runtime)
    engine = Engine(rt, frozenset(), 4, 32)
    monkeypatch.setattr(rt.model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a forward ran")))
    assert warm_up(engine, print) == 0
    assert engine.slots.lengths == [0] * 4


def test_warm_up_says_what_it_does_where_the_runtime_prepares():
    seen = []
    fake = SimpleNamespace(warms_up=True, warm_up_slots=lambda slots, most: seen.append((slots, most)) or 7)
    engine = SimpleNamespace(runtime=fake, parallel=16, slots="the slots", prefill_tokens=99, speculation=None)
    lines = []
    assert warm_up(engine, lines.append) == 7 and seen == [("the slots", 99)]
    assert lines[0] == "warming up 16 slots ..." and lines[1].startswith("warmed up in ") and "7 decode graphs" in lines[1]


def test_warm_up_warms_a_draft_models_slots_too():
    seen = []
    target = SimpleNamespace(warms_up=True, warm_up_slots=lambda slots, most: seen.append((slots, most)) or 7)
    draft = SimpleNamespace(warm_up_slots=lambda slots, most: seen.append((slots, most)) or 5)
    spec = SimpleNamespace(rt=draft, slots="the draft's slots")
    engine = SimpleNamespace(runtime=target, parallel=4, slots="the slots", prefill_tokens=64, speculation=spec)
    assert warm_up(engine, lambda line: None) == 12
    assert seen == [("the slots", 64), ("the draft's slots", 64)]
    lookup = SimpleNamespace(rt=None, slots=None)  # --lookup: no draft runtime
    seen.clear()
    assert warm_up(SimpleNamespace(**{**vars(engine), "speculation": lookup}), lambda line: None) == 7
    assert seen == [("the slots", 64)]
