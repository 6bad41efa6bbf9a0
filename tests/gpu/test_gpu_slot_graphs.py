"""CudaRuntime.decode_slots with CUDA graphs (backends/cuda_slots.py: one graph per bucket of slot counts,
replayed for any slots and positions): steps of B = 1, 5 and 16 slots at different positions give each
slot's logits bit for bit as that slot decoded alone (batch invariance: issue 22's "16 concurrent greedy
streams each equal the request served alone") and as the plain batch-1 decode step (GraphDecoder) of
that sequence; each bucket's graph is captured once however many steps replay it. (Closeness to the CPU
fp32 forward: tests/gpu/test_gpu_slots.py, which runs this same path.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from localllm.config import ModelConfig

CFG = ModelConfig(arch="llama", n_layers=3, dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=32,
                  vocab_size=512, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
N_SLOTS, CAP, STEPS = 16, 48, 3
# (config, weight type): the Llama layer in three weight kinds (integer-dot Q8_0; Q4_K_M's Q4_K / Q6_K
# mix, its attn_v a separate product; dense bf16: triton_dense's tiles), and the families' kernels that
# read positions: Qwen3's q/k norms (norm_rope_store), Gemma 2's rope_store_family, windows and
# soft-caps, a mixture of experts (cuda_moe.py's per-row expert products).
MODELS = {
    "llama-Q8_0": (CFG, "Q8_0"),
    "llama-Q4_K_M": (CFG, "Q4_K_M"),
    "llama-bf16": (CFG, "bf16"),
    "qwen3-Q8_0": (replace(CFG, arch="qwen3", qk_norm=True), "Q8_0"),
    "gemma2-Q8_0": (replace(CFG, arch="gemma2", embed_scale=16.0, activation="gelu_tanh", post_norms=True,
                            attn_scale=32**-0.5, attn_softcap=4.0, final_softcap=3.0, sliding_window=6,
                            sliding_layers=(True, False, True)), "Q8_0"),
    "mixtral-Q8_0": (replace(CFG, n_experts=8, n_experts_used=2, expert_ffn_dim=256), "Q8_0"),
}


def copy_slots(slots):
    from localllm.cache import KVCache
    from localllm.slots import Slots

    return Slots(KVCache(slots.cache.k.clone(), slots.cache.v.clone(), 0), list(slots.lengths))


@pytest.fixture(scope="module", params=list(MODELS))
def runtime(request):
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    cfg, wtype = MODELS[request.param]
    state, _ = synthetic_state(cfg, wtype, "cpu", seed=3)
    rt = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    assert isinstance(rt, CudaRuntime)
    return rt


@pytest.mark.parametrize("B", [1, 5, 16])
def test_slot_steps_equal_each_slot_alone_and_capture_once(runtime, B):
    from localllm.backends.cuda_slots import bucket

    rt = runtime
    g = torch.Generator().manual_seed(B)
    seqs = [torch.randint(0, rt.cfg.vocab_size, (CAP,), generator=g).tolist() for _ in range(N_SLOTS)]
    prompts = [1 + (7 * s) % 17 for s in range(N_SLOTS)]  # every slot at another position
    slots = rt.new_slots(N_SLOTS, CAP)
    for s, p in enumerate(prompts):
        rt.prefill_slot(slots, s, seqs[s][:p], 0)
    start = copy_slots(slots)
    which = torch.randperm(N_SLOTS, generator=g)[:B].tolist()  # any slots, any order
    batched = {}
    for _ in range(STEPS):
        pos = [slots.lengths[s] for s in which]
        tokens = torch.tensor([seqs[s][q] for s, q in zip(which, pos)], device=rt.device)
        logits = rt.decode_slots(slots, which, tokens)
        assert logits.shape == (B, rt.cfg.vocab_size)
        for row, (s, q) in enumerate(zip(which, pos)):
            batched[s, q] = logits[row].cpu().clone()
    found = slots.tables[("cuda", True)]
    assert set(found) == {bucket(B)} and found[bucket(B)].captures == 1  # replayed, not recaptured

    alone = copy_slots(start)
    for s in which:  # each slot alone: bucket 1's graph
        for _ in range(STEPS):
            q = alone.lengths[s]
            got = rt.decode_slots(alone, [s], torch.tensor([seqs[s][q]], device=rt.device))[0].cpu()
            assert torch.equal(got, batched[s, q]), f"slot {s} position {q}: rows interfere"
    assert alone.tables[("cuda", True)][1].captures == 1
    for s in which:  # and the cache rows written are the same
        assert torch.equal(alone.cache.k[:, s], slots.cache.k[:, s]) and torch.equal(alone.cache.v[:, s],
                                                                                    slots.cache.v[:, s])
    others = [s for s in range(N_SLOTS) if s not in which]  # slots outside the steps are untouched
    assert torch.equal(slots.cache.k[:, others], start.cache.k[:, others])

    s = which[0]  # the plain decode step (GraphDecoder, batch 1) of slot s's sequence
    cache = rt.new_cache(CAP)
    cache.k[:, 0], cache.v[:, 0], cache.length = start.cache.k[:, s], start.cache.v[:, s], prompts[s]
    for _ in range(STEPS):
        q = cache.length
        got = rt.decode(cache, torch.tensor([seqs[s][q]], device=rt.device))[0].cpu()
        assert torch.equal(got, batched[s, q]), f"position {q}: not the plain decode step's bits"


def test_buckets_share_one_slots_cache(runtime):
    """Steps of 3, 1, 12, 3 slots: buckets 4, 1, 16 each captured once; a slot's next step in another
    bucket reads what the last one wrote (its logits equal the slot decoded alone)."""
    rt = runtime
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, rt.cfg.vocab_size, (CAP,), generator=g).tolist() for _ in range(N_SLOTS)]
    slots = rt.new_slots(N_SLOTS, CAP)
    for s in range(N_SLOTS):
        rt.prefill_slot(slots, s, seqs[s][:2 + s], 0)
    alone = copy_slots(slots)
    for which in ([0, 5, 9], [5], list(range(12)), [9, 0, 5]):
        pos = [slots.lengths[s] for s in which]
        logits = rt.decode_slots(slots, which, torch.tensor([seqs[s][q] for s, q in zip(which, pos)], device=rt.device))
        for row, (s, q) in enumerate(zip(which, pos)):
            one = rt.decode_slots(alone, [s], torch.tensor([seqs[s][q]], device=rt.device))[0]
            assert torch.equal(one, logits[row]), (which, s)
    found = slots.tables[("cuda", True)]
    assert {b: d.captures for b, d in found.items()} == {4: 1, 1: 1, 16: 1}


def test_dense_steps_of_many_slots(runtime, request):
    """A step of 40 slots (bucket 64 >= dense_decode_rows: a dense step where every layer weight has
    dense values, the quantized ones' decoded copies; one graph, replayed) against the CPU fp32
    forward of each sequence (the oracle of tests/gpu/test_gpu_slots.py, same tolerance); a model that
    cannot (the mixture of experts) keeps the kernels: each row the bits of that slot alone."""
    from localllm.backends.cuda_slots import dense_ready
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    rt, n = runtime, 40
    cfg, wtype = MODELS[request.node.callspec.params["runtime"]]
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.vocab_size, (CAP,), generator=g).tolist() for _ in range(n)]
    slots = rt.new_slots(n, CAP)
    for s in range(n):
        rt.prefill_slot(slots, s, seqs[s][:1 + (5 * s) % 13], 0)
    start = copy_slots(slots)
    which = list(range(n))
    batched = {}
    for _ in range(STEPS):
        pos = [slots.lengths[s] for s in which]
        logits = rt.decode_slots(slots, which, torch.tensor([seqs[s][q] for s, q in zip(which, pos)], device=rt.device))
        for row, (s, q) in enumerate(zip(which, pos)):
            batched[s, q] = logits[row].float().cpu()
    dec = slots.tables[("cuda", True)][64]
    assert dec.captures == 1 and dec.dense == dense_ready(rt.model) == (not cfg.n_experts)
    if not dec.dense:
        alone = copy_slots(start)
        for s in which[::7]:
            for _ in range(STEPS):
                q = alone.lengths[s]
                got = rt.decode_slots(alone, [s], torch.tensor([seqs[s][q]], device=rt.device))[0].cpu()
                assert torch.equal(got, batched[s, q]), (s, q)
        return
    state, _ = synthetic_state(cfg, wtype, "cpu", seed=3)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    for s in which:
        m = slots.lengths[s]
        want = ref.forward(torch.tensor([seqs[s][:m]]), ref.new_cache(m), 0)[0]
        for q in range(start.lengths[s], m):
            err = (batched[s, q] - want[q]).abs().max() / want[q].abs().max()
            assert err < 5e-2, f"slot {s} position {q}: {err}"
