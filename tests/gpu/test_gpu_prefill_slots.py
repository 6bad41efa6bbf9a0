"""prefill_slots on CUDA (localllm/slots.py's portable pass on CUDA tensors; the CUDA backend has no
override): ragged prompts into slots in any order, one after a prefix already in its slot, in one
forward. Oracle: the CPU fp32 forward of each sequence alone (bf16 activations on the GPU); the rows the
pass wrote are checked by one decode_slots step after it, against the same oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from localllm.config import ModelConfig

BASE = ModelConfig(arch="llama", n_layers=3, dim=128, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=32,
                   vocab_size=256, context_length=256, norm_eps=1e-6, rope_theta=10000.0)
CONFIGS = {
    "llama": BASE,
    "gemma2": replace(BASE, arch="gemma2", embed_scale=8.0, activation="gelu_tanh", post_norms=True,
                      attn_scale=32**-0.5, attn_softcap=4.0, final_softcap=3.0, sliding_window=4,
                      sliding_layers=(True, False, True)),
}
TOL = 5e-2  # largest logit error / largest logit (bf16 activations against the fp32 reference)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_slots_on_cuda(name):
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    cfg = CONFIGS[name]
    state, _ = synthetic_state(cfg, "Q8_0", "cpu", seed=3)
    gpu = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (14,), generator=g).tolist() for _ in range(4)]
    slots = gpu.new_slots(4, 24)
    gpu.prefill_slot(slots, 2, seqs[2][:5], 0)  # a prefix already in slot 2
    which, ends, starts = [3, 0, 2], [9, 1, 12], [0, 0, 5]
    got = gpu.prefill_slots(slots, which, [seqs[s][st:e] for s, st, e in zip(which, starts, ends)], starts)
    assert slots.lengths == [1, 0, 12, 9]
    step = gpu.decode_slots(slots, which, torch.tensor([seqs[s][e] for s, e in zip(which, ends)], device="cuda"))
    for row, (s, e) in enumerate(zip(which, ends)):
        want = ref.forward(torch.tensor([seqs[s][:e + 1]]), ref.new_cache(e + 1), 0)[0]
        for have, pos in ((got[row], e - 1), (step[row], e)):
            err = (have.float().cpu() - want[pos]).abs().max() / want[pos].abs().max()
            assert err < TOL, f"slot {s} position {pos}: {err}"
