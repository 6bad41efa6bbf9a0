"""Slots (localllm/slots.py): many sequences in one cache, each at its own position, decoded in one
batched step. Oracle: the plain Runtime.forward of each sequence alone on a batch-1 cache.

- decode_slots over changing subsets of slots at different lengths: every row's logits are bit-equal to
  the same slot decoded alone (batch invariance), within fp32 tolerance of the reference forward, with
  the same argmax; on the portable backend (dense torch weights) and the CPU backend (C++ products on
  Q8_0 blocks), for the Llama layer, Gemma 2 / 3 (windows, soft caps, two rope sets), a mixture of
  experts and Gemma 4 (per-layer caches, KV sharing, per-layer embeddings);
- prefill_slot writes its slot's rows only; copy_prefix + prefill_slot from a start reuse a prefix;
  rolling back a length and decoding again gives the same logits; greedy streams equal generate()'s.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

import tiny_gemma4 as g4
from tiny_spec import Q
from localllm.config import ModelConfig
from localllm.errors import LocalLLMError
from localllm.generate import generate
from localllm.load import build_model, load_model
from localllm.runtime import Runtime
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings
from localllm.synthetic import quantize_embedding, synthetic_state

BASE = ModelConfig(arch="llama", n_layers=3, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=32,
                   vocab_size=256, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
CONFIGS = {
    "llama": BASE,
    "gemma2": replace(BASE, arch="gemma2", embed_scale=8.0, activation="gelu_tanh", post_norms=True,
                      attn_scale=32**-0.5, attn_softcap=4.0, final_softcap=3.0, sliding_window=4,
                      sliding_layers=(True, False, True)),
    "gemma3": replace(BASE, arch="gemma3", embed_scale=8.0, activation="gelu_tanh", post_norms=True, qk_norm=True,
                      sliding_window=4, sliding_layers=(True, True, False), rope_theta=1e6, rope_theta_local=1e4),
    "moe": replace(BASE, arch="qwen3moe", qk_norm=True, n_experts=8, n_experts_used=2, expert_ffn_dim=64),
}
PROMPTS = [5, 9, 1, 3]  # prompt length of each slot
# rows of each step: subsets in changing orders, slots joining and leaving
SCHEDULE = [[0, 1, 2, 3], [2, 0], [3], [1, 3, 0], [0, 1, 2, 3], [2], [3, 2, 1, 0], [0, 2], [1]]
TOL = 1e-4  # largest logit error / largest logit, against the reference forward


@functools.cache
def synthetic(cfg: ModelConfig, backend):
    """Q8_0 random weights: the CPU backend keeps the blocks (C++ products), the portable one decodes
    them to dense fp32 (torch products). Built once per (config, backend) for the module's tests (they
    only read the weights)."""
    state = quantize_embedding(synthetic_state(cfg, "Q8_0", "cpu", seed=7)[0], "Q8_0")
    if backend is Runtime:
        return build_model(cfg, state, "cpu", torch.float32, keep_quantized=False, backend=Runtime)
    return build_model(cfg, state, "cpu", torch.float32)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """The E2B-style tiny Gemma 4 (PLE, KV-shared layers: per-layer caches) as a Q8_0 GGUF."""
    root = tmp_path_factory.mktemp("slots_gemma4")
    spec = replace(g4.CASES["e2b"], ple_dim=32, tied=False)
    return g4.write_gguf(spec, g4.write_hf_folder(spec, root / "hf"), root / "e2b.gguf", Q.Q8_0)


def sequences(rt: Runtime, seed: int = 1) -> list[list[int]]:
    n = len(SCHEDULE) + max(PROMPTS) + 1
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rt.cfg.vocab_size, (n,), generator=g).tolist() for _ in PROMPTS]


def reference(rt: Runtime, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of every position of ids: one forward on a batch-1 cache."""
    cache = rt.new_cache(len(ids))
    return rt.forward(torch.tensor([ids]), cache, 0)[0]


def run_schedule(rt: Runtime, seqs: list[list[int]], schedule) -> dict:
    """Prefill each slot with its prompt, then the steps of `schedule` (teacher-forced ids) ->
    {(slot, position): logits (V,)}."""
    slots = rt.new_slots(len(PROMPTS), 24)
    out = {}
    for s, p in enumerate(PROMPTS):
        out[s, p - 1] = rt.prefill_slot(slots, s, seqs[s][:p], 0)
        assert slots.lengths[s] == p
    for which in schedule:
        pos = [slots.lengths[s] for s in which]
        logits = rt.decode_slots(slots, which, torch.tensor([seqs[s][q] for s, q in zip(which, pos)]))
        assert logits.shape == (len(which), rt.cfg.vocab_size) and logits.dtype == torch.float32
        for row, (s, q) in enumerate(zip(which, pos)):
            out[s, q] = logits[row].clone()
            assert slots.lengths[s] == q + 1
    return out


def alone(schedule) -> list[list[int]]:
    """The same steps, each slot on its own (one row a step)."""
    return [[s] for which in schedule for s in which]


def check_runtime(rt: Runtime, tol: float = TOL) -> None:
    seqs = sequences(rt)
    batched, single = run_schedule(rt, seqs, SCHEDULE), run_schedule(rt, seqs, alone(SCHEDULE))
    assert batched.keys() == single.keys()
    for key, got in batched.items():
        assert torch.equal(got, single[key]), f"slot {key[0]} position {key[1]}: rows interfere"
    for s in range(len(PROMPTS)):
        n = max(q for t, q in batched if t == s) + 1
        ref = reference(rt, seqs[s][:n])
        for q in range(PROMPTS[s] - 1, n):
            got, want = batched[s, q], ref[q]
            assert (got - want).abs().max() <= tol * want.abs().max(), f"slot {s} position {q}"
            assert got.argmax() == want.argmax(), f"slot {s} position {q}"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["portable", "cpu"])
def test_decode_slots_rows_equal_each_slot_alone(name, backend):
    if backend == "portable" and name == "moe":
        pytest.skip("torch GEMMs over expert groups round with the group's size: invariance needs the CPU's "
                    "row-independent products (slots.py)")
    check_runtime(synthetic(CONFIGS[name], Runtime if backend == "portable" else None))


def check_cpp_rows(rt: Runtime) -> None:
    """The CPU backend's rows step (one C++ call for all rows) gives each row the bits of the C++
    decoder's one-token step on a batch-1 cache (Runtime.decode)."""
    assert rt.cpp_decoder(rt.new_slots(2, 4).cache, batch1=False) is not None
    seqs = sequences(rt)
    batched = run_schedule(rt, seqs, SCHEDULE)
    for s, p in enumerate(PROMPTS):
        cache = rt.new_cache(24)
        assert rt.cpp_decoder(cache) is not None
        rt.prefill(cache, [seqs[s][:p]])
        n = max(q for t, q in batched if t == s) + 1
        for q in range(p, n):
            assert torch.equal(rt.decode(cache, torch.tensor([seqs[s][q]]))[0], batched[s, q]), f"slot {s} position {q}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpp_rows_equal_one_token_steps(name):
    check_cpp_rows(synthetic(CONFIGS[name], None))


def test_gemma4_layered_cache(gemma4):
    """Per-layer caches of their own shapes, KV-shared layers reading an earlier layer's rows, PLE."""
    rt = load_model(str(gemma4), "cpu").runtime
    assert isinstance(rt.new_cache(4).k, list)
    check_runtime(rt, tol=2e-3)
    check_cpp_rows(rt)


@pytest.fixture(scope="module")
def llama():
    return synthetic(BASE, None)


def test_prefill_slot_writes_its_rows_only(llama):
    rt = llama
    slots = rt.new_slots(3, 16)
    for t in (slots.cache.k, slots.cache.v):
        t.normal_()
    before = slots.cache.k.clone(), slots.cache.v.clone()
    rt.prefill_slot(slots, 1, [3, 4, 5], 0)
    for old, new in zip(before, (slots.cache.k, slots.cache.v)):
        changed = (old != new).nonzero()[:, [1, 3]].unique(dim=0).tolist()  # (slot, position) pairs
        assert changed == [[1, 0], [1, 1], [1, 2]]
    assert slots.lengths == [0, 3, 0]


def test_prefix_reuse_and_rollback(llama):
    rt = llama
    ids = list(range(10, 22))
    ref = reference(rt, ids)
    slots = rt.new_slots(2, 16)
    rt.prefill_slot(slots, 0, ids[:8], 0)
    rt.copy_prefix(slots, 0, 1, 6)  # slot 1: the first 6 rows of slot 0, then its own rest
    assert slots.lengths == [8, 6]
    last = rt.prefill_slot(slots, 1, ids[6:10], 6)
    assert (last - ref[9]).abs().max() <= TOL * ref[9].abs().max()
    step = rt.decode_slots(slots, [1, 0], torch.tensor([ids[10], ids[8]]))
    assert slots.lengths == [9, 11]
    slots.lengths[1] = 10  # roll back one position, decode it again
    again = rt.decode_slots(slots, [1], torch.tensor([ids[10]]))
    assert torch.equal(again[0], step[0])
    assert (step[1] - ref[8]).abs().max() <= TOL * ref[8].abs().max()
    # a prefill from a start reuses the slot's own rows [0, start) too
    rt.prefill_slot(slots, 0, ids[4:8], 4)
    out = rt.prefill_slot(slots, 0, ids[8:12], 8)
    assert (out - ref[11]).abs().max() <= TOL * ref[11].abs().max()


def test_greedy_streams_equal_generate(llama):
    """Slots joining at different steps, greedy: each stream's ids are generate()'s for its prompt."""
    rt = llama
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    want = []
    for p in prompts:
        cache = rt.new_cache(len(p) + 12)
        want.append(list(generate(rt, cache, p, Sampler(SamplingSettings(temperature=0)), 10)))
    slots = rt.new_slots(3, 32)
    got: list[list[int]] = [[], [], []]
    active: list[int] = []
    for step in range(14):
        if step < 3:  # slot `step` joins now
            got[step].append(int(rt.prefill_slot(slots, step, prompts[step], 0).argmax()))
            active.append(step)
        active = [s for s in active if len(got[s]) < 10]
        if not active:
            break
        logits = rt.decode_slots(slots, active, torch.tensor([got[s][-1] for s in active]))
        for row, s in enumerate(active):
            got[s].append(int(logits[row].argmax()))
    assert [g[:10] for g in got] == want
    assert len({t for g in got for t in g}) > 3


def test_bad_calls_are_clear_errors(llama):
    rt = llama
    slots = rt.new_slots(2, 4)
    with pytest.raises(LocalLLMError, match="longer than the context"):
        rt.prefill_slot(slots, 0, [1] * 5, 0)
    with pytest.raises(LocalLLMError, match="does not exist"):
        rt.prefill_slot(slots, 2, [1], 0)
    rt.prefill_slot(slots, 0, [1] * 4, 0)
    with pytest.raises(LocalLLMError, match="full"):
        rt.decode_slots(slots, [0], torch.tensor([1]))
    with pytest.raises(LocalLLMError, match="distinct"):
        rt.decode_slots(slots, [1, 1], torch.tensor([1, 2]))


# ---- prefill_slots: several slots' prompts in one forward


def noisy_slots(rt: Runtime, prefix: list[int]):
    """4 slots of 24 rows filled with noise (rows a step must not write keep it), slot 2 holding
    `prefix` (prefill_slot), the same bits on every call."""
    slots = rt.new_slots(4, 24)
    g = torch.Generator().manual_seed(11)
    buffers = [*slots.cache.k, *slots.cache.v] if isinstance(slots.cache.k, list) else [slots.cache.k, slots.cache.v]
    for t in {id(t): t for t in buffers}.values():  # a KV-shared layer's buffer once
        t.normal_(generator=g)
    rt.prefill_slot(slots, 2, prefix, 0)
    return slots, buffers


def check_prefill_slots(rt: Runtime, exact: bool, tol: float = TOL) -> None:
    """Ragged prompts into slots in any order, one after a prefix already in its slot (and windows
    shorter than the prompts for Gemma): logits and every cache row equal prefill_slot's of each prompt
    alone, bit for bit (exact: the CPU's row-independent C++ products) or within tol (torch's GEMMs)."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, rt.cfg.vocab_size, (12,), generator=g).tolist() for _ in range(4)]
    which, prompts, starts = [3, 0, 2], [ids[3][:9], ids[0][:1], ids[2][5:12]], [0, 0, 5]
    together, got_cache = noisy_slots(rt, ids[2][:5])
    got = rt.prefill_slots(together, which, prompts, starts)
    alone, want_cache = noisy_slots(rt, ids[2][:5])
    want = torch.stack([rt.prefill_slot(alone, s, p, st) for s, p, st in zip(which, prompts, starts)])
    assert together.lengths == alone.lengths == [1, 0, 12, 9]
    assert got.shape == want.shape == (3, rt.cfg.vocab_size) and got.dtype == torch.float32
    for a, b in [(got, want), *zip(got_cache, want_cache)]:
        if exact:
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max() <= tol * b.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["portable", "cpu"])
def test_prefill_slots_equal_each_prompt_alone(name, backend):
    rt = synthetic(CONFIGS[name], Runtime if backend == "portable" else None)
    # the MoE router's F32 weight takes the C++ dense product, whose rounding depends on how many rows
    # share a pass (measured: 2e-7 on these logits); the quantized products are row-independent
    check_prefill_slots(rt, exact=backend == "cpu" and name != "moe")


def test_gemma4_prefill_slots(gemma4):
    """Per-layer caches, KV-shared layers (reading rows this step wrote), per-layer embeddings."""
    check_prefill_slots(load_model(str(gemma4), "cpu").runtime, exact=True)


def test_prefill_slots_bad_calls(llama):
    slots = llama.new_slots(2, 4)
    with pytest.raises(LocalLLMError, match="distinct"):
        llama.prefill_slots(slots, [1, 1], [[1], [2]], [0, 0])
    with pytest.raises(LocalLLMError, match="one prompt and start per slot"):
        llama.prefill_slots(slots, [0, 1], [[1]], [0, 0])
    with pytest.raises(LocalLLMError, match="longer than the context"):
        llama.prefill_slots(slots, [0, 1], [[1], [1] * 5], [0, 0])
    assert slots.lengths == [0, 0]
