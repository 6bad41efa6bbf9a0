"""CudaRuntime.prefill_slot replaying backends/cuda_prompt.py's graphs (one per padded length) against
the eager one-prompt pass it replaces (Runtime.prefill_slot: the forward with CUDA_OPS): for prompts of
several lengths, slots and starts (a prefix already in the slot), replayed through the same bucket's
graph, the logits and the prompt's cache rows within bf16 rounding of the eager pass's and its greedy
id equal; each bucket captured once; rows of other slots untouched. tests/test_cuda_prompt.py checks the
padded forward itself against the reference on the CPU."""

from __future__ import annotations

import pytest
import torch

from localllm.config import ModelConfig

CFG = ModelConfig(arch="llama", n_layers=3, dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=32,
                  vocab_size=512, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
N_SLOTS, CAP = 4, 96
# (slot, start, ids): buckets 1, 3, 16 (twice, another slot and start), 32, 64; a start past what the
# bucket leaves room for runs eagerly (the last)
CASES = [(0, 0, 1), (1, 5, 3), (2, 0, 9), (3, 7, 16), (1, 20, 30), (0, 10, 64), (2, 50, 40)]
TOL = 3e-2  # largest error / largest value (bf16 activations; products of other row counts)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K_M", "bf16"])
def runtime(request):
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    state, _ = synthetic_state(CFG, request.param, "cpu", seed=3)
    rt = build_model(CFG, dict(state), "cuda", torch.bfloat16)
    assert isinstance(rt, CudaRuntime)
    return rt


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() <= TOL * b.float().abs().max())


def test_prompt_graphs_equal_the_eager_pass(runtime):
    from localllm.backends.cuda_prompt import prompt_graphs
    from localllm.runtime import Runtime

    rt = runtime
    g = torch.Generator().manual_seed(1)
    graphed, eager = rt.new_slots(N_SLOTS, CAP), rt.new_slots(N_SLOTS, CAP)
    graphs = prompt_graphs(rt.model, graphed)
    for slot, start, n in CASES:
        prefix = torch.randint(0, CFG.vocab_size, (start,), generator=g).tolist()
        ids = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        for slots in (graphed, eager):
            slots.lengths[slot] = 0
            if start:
                Runtime.prefill_slot(rt, slots, slot, prefix, 0)
        others = graphed.cache.k.clone()
        got = rt.prefill_slot(graphed, slot, ids, start)
        want = Runtime.prefill_slot(rt, eager, slot, ids, start)
        torch.cuda.synchronize()
        assert graphed.lengths[slot] == eager.lengths[slot] == start + n
        assert close(got, want) and got.argmax() == want.argmax(), (slot, start, n)
        end = start + n
        for a, b in ((graphed.cache.k, eager.cache.k), (graphed.cache.v, eager.cache.v)):
            assert close(a[:, slot, :, :end], b[:, slot, :, :end]), (slot, start, n)
        rest = [s for s in range(N_SLOTS) if s != slot]
        assert torch.equal(graphed.cache.k[:, rest], others[:, rest])
    # the last case ran eagerly; 16 captured once
    assert sorted(graphs.graphs) == [(1, 1), (1, 3), (1, 16), (1, 32), (1, 64)]


def test_several_prompts_replay_a_graph_of_several(runtime):
    """CudaRuntime.prefill_slots: 3 prompts (one after a prefix) through the graph of 3 prompts of 32
    rows, then 5 through the graph of 6 (the last repeated), each twice (other slots the second time),
    against the eager pass (Runtime.prefill_slots)."""
    from localllm.backends.cuda_prompt import prompt_graphs
    from localllm.runtime import Runtime

    rt = runtime
    g = torch.Generator().manual_seed(2)
    graphed, eager = rt.new_slots(8, CAP), rt.new_slots(8, CAP)
    for which, starts, lens in (([2, 0, 3], [6, 0, 0], [20, 32, 17]), ([1, 3, 0], [0, 0, 0], [30, 18, 25]),
                                ([4, 2, 0, 5, 1], [0, 3, 0, 0, 0], [20, 25, 32, 17, 30]),
                                ([0, 5, 1, 3, 6], [0, 0, 0, 2, 0], [30, 18, 25, 20, 32])):
        for s, st in zip(which, starts):
            prefix = torch.randint(0, CFG.vocab_size, (st,), generator=g).tolist()
            for slots in (graphed, eager):
                slots.lengths[s] = 0
                if st:
                    Runtime.prefill_slot(rt, slots, s, prefix, 0)
        prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lens]
        got = rt.prefill_slots(graphed, which, prompts, starts)
        want = Runtime.prefill_slots(rt, eager, which, prompts, starts)
        torch.cuda.synchronize()
        assert got.shape == want.shape == (len(which), CFG.vocab_size)
        assert close(got, want) and torch.equal(got.argmax(-1), want.argmax(-1)), (which, lens)
        for s, st, n in zip(which, starts, lens):
            assert graphed.lengths[s] == eager.lengths[s] == st + n
            for a, b in ((graphed.cache.k, eager.cache.k), (graphed.cache.v, eager.cache.v)):
                assert close(a[:, s, :, :st + n], b[:, s, :, :st + n]), (s, st, n)
    assert {(3, 32), (6, 32)} <= set(prompt_graphs(rt.model, graphed).graphs)
