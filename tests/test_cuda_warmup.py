"""The prompt warm-up's shapes (backends/cuda_warmup.py, run by CudaRuntime.warm_up_slots before `serve`
listens) cover every kernel variant a request's prompt can reach, without a GPU.

Oracle: every shape a request can send, enumerated for small contexts, mapped to the variants it
compiles by the dispatch's own constants (kernels/linear.GEMV_MAX_ROWS, triton_epilogue.rows_per_program,
cuda_moe_prefill.GEMV_SLOTS_PER_EXPERT, triton_moe_gemm.block_m) and Triton's own specialization of int
arguments (1 / a multiple of 16 / other); the shapes warm_up_prompts actually runs (recorded by a runtime
that only checks and records the calls) must reach all of them. A changed threshold or a table entry
dropped fails here. (On the GPU, that requests then compile nothing: tests/gpu/test_gpu_warmup_compiles.py.)
"""

from __future__ import annotations

import os

# This module imports the kernels' modules, so triton: set the interpreter first, as the Triton test
# modules do (triton.language's own @triton.jit helpers are interpretable only if TRITON_INTERPRET=1 was
# set when triton was first imported; collected before them, this file would import it uninterpreted)
os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from localllm import slots as slot_steps
from localllm.backends.cuda_moe_prefill import GEMV_SLOTS_PER_EXPERT
from localllm.backends.cuda_warmup import warm_up_prompts
from localllm.cache import make_cache
from localllm.config import ModelConfig
from localllm.kernels.linear import GEMV_MAX_ROWS
from localllm.kernels.triton_epilogue import rows_per_program
from localllm.kernels.triton_moe_gemm import block_m
from localllm.load import build_model
from localllm.runtime import Runtime
from localllm.synthetic import synthetic_state

TINY = ModelConfig(arch="llama", n_layers=1, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=300, context_length=128, norm_eps=1e-5, rope_theta=10000.0)
FFNS = range(1, 33)  # ffn widths by their residue mod 16 and 2-adic order (silu_mul's T ffn elements)


def int_class(v: int):
    """Triton's specialization of an int argument (triton/runtime/jit.py's binder)."""
    return native_specialize_impl(BaseBackend, v, False, True, True)


def product(rows: int):
    """The variant of a prompt's product of `rows` x rows (kernels/linear.qlinear)."""
    if rows <= GEMV_MAX_ROWS:
        return "gemv", rows_per_program(rows), int_class(rows)
    return "matmul"


def silu(rows: int) -> set:
    return {("silu", f, int_class(rows * f)) for f in FFNS}


def one_prompt(start: int, t: int) -> set:
    """prefill_slot's variants (the head: one row)."""
    return {("rows", product(t)), ("rope", int_class(t), int_class(start))} | silu(t)


def several(rows: int, head: int) -> set:
    """prefill_slots' / verify_slots' variants (head: its rows)."""
    return {("rows", product(rows)), ("head", product(head))} | silu(rows)


class Recorder:
    """A runtime that checks each call as the real one does, moves the lengths, and records the shapes."""

    def __init__(self, cfg: ModelConfig):
        self.model = SimpleNamespace(cfg=cfg)
        self.one, self.many = [], []

    def prefill_slot(self, slots, slot, ids, start):
        slot_steps.check_prefill(slots, slot, ids, start)
        slots.lengths[slot] = start + len(ids)
        self.one.append((start, len(ids)))

    def prefill_slots(self, slots, which, prompts, starts):
        slot_steps.check_prefills(slots, which, prompts, starts)
        for s, p, st in zip(which, prompts, starts):
            slots.lengths[s] = st + len(p)
        self.many.append(([len(p) for p in prompts], len(prompts)))

    def verify_slots(self, slots, which, rows):
        slot_steps.check_verify(slots, which, rows)
        for s, r in zip(which, rows):
            slots.lengths[s] += len(r)
        self.many.append(([len(r) for r in rows], sum(len(r) for r in rows)))


def recorded(cfg: ModelConfig, n: int, capacity: int, most: int) -> Recorder:
    rec = Recorder(cfg)
    slots = slot_steps.new_slots(make_cache(cfg, capacity, batch=n))
    warm_up_prompts(rec, slots, most)
    assert slots.lengths == [0] * n  # every slot left empty
    return rec


@pytest.mark.parametrize("capacity", [8, 17, 18, 19, 40, 200])
def test_one_prompt_shapes_cover_every_variant(capacity):
    rec = recorded(TINY, 2, capacity, 2048)
    warmed = set().union(*(one_prompt(s, t) for s, t in rec.one))
    # a request's part: ids at [start, start + T) of a prompt shorter than the context
    reachable = set().union(*(one_prompt(s, t) for s in range(capacity - 1) for t in range(1, capacity - s)))
    assert reachable - warmed == set()
    assert max(t for _, t in rec.one) == capacity - 1  # the largest part


@pytest.mark.parametrize("n, capacity", [(1, 8), (1, 24), (2, 9), (4, 8), (4, 24), (3, 40)])
def test_several_prompt_shapes_cover_every_variant(n, capacity):
    most = 64
    rec = recorded(TINY, n, capacity, most)
    warmed = set().union(*(several(sum(lengths), head) for lengths, head in rec.many))
    total = min(most, n * (capacity - 1))
    # T rows of k prompts (k <= n slots): prefill_slots' head k rows, verify_slots' every row
    reachable = set().union(*(several(t, head) for t in range(1, total + 1)
                              for head in {t, *range(1, min(n, t) + 1)}))
    assert reachable - warmed == set()
    assert max(sum(lengths) for lengths, _ in rec.many) == total  # the largest pass


@pytest.mark.parametrize("experts, used", [(8, 2), (32, 4), (128, 8), (4, 1)])
def test_moe_shapes_reach_every_expert_path(experts, used):
    cfg = replace(TINY, n_experts=experts, n_experts_used=used, expert_ffn_dim=64)
    n, capacity, most = 4, 1024, 2048

    def path(rows):  # cuda_moe_prefill.moe_prefill's choice
        slots = rows * used
        return "few" if slots <= GEMV_SLOTS_PER_EXPERT * experts else block_m(slots, experts)

    rec = recorded(cfg, n, capacity, most)
    warmed = {path(t) for _, t in rec.one} | {path(sum(lengths)) for lengths, _ in rec.many}
    assert {path(t) for t in range(1, most + 1)} - warmed == set()


def test_warm_up_runs_on_a_model_and_leaves_the_slots_empty():
    state, _ = synthetic_state(TINY, "f32", "cpu", seed=1)
    rt = build_model(TINY, state, "cpu", torch.float32, backend=Runtime)
    slots = rt.new_slots(3, 40)
    warm_up_prompts(rt, slots, 64)
    assert slots.lengths == [0, 0, 0]
