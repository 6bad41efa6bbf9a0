"""Slots on CUDA (localllm/slots.py, the portable decode_slots step on CUDA tensors): every row's logits
bit-equal to the same slot decoded alone (batch invariance: the step always computes all n rows, so
every kernel sees the same shapes), and close to the CPU fp32 forward of each sequence alone (the
oracle; bf16 activations on the GPU), for the Llama layer and Gemma 2 (windows, soft caps)."""

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
PROMPTS = [5, 9, 1, 3]
SCHEDULE = [[0, 1, 2, 3], [2, 0], [3], [1, 3, 0], [0, 1, 2, 3], [2], [3, 2, 1, 0], [0, 2], [1]]


def models(name: str):
    """(the bf16 CUDA model, the CPU fp32 oracle) of CONFIGS[name] with the same Q8_0 weights."""
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    cfg = CONFIGS[name]
    state, _ = synthetic_state(cfg, "Q8_0", "cpu", seed=3)
    gpu = build_model(cfg, dict(state), "cuda", torch.bfloat16)
    return gpu, build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)


def run(rt, seqs, schedule) -> dict:
    slots = rt.new_slots(len(PROMPTS), 24)
    out = {}
    for s, p in enumerate(PROMPTS):
        rt.prefill_slot(slots, s, seqs[s][:p], 0)
    for which in schedule:
        pos = [slots.lengths[s] for s in which]
        tokens = torch.tensor([seqs[s][q] for s, q in zip(which, pos)], device=rt.device)
        logits = rt.decode_slots(slots, which, tokens)
        for row, (s, q) in enumerate(zip(which, pos)):
            out[s, q] = logits[row].float().cpu()
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_slots_on_cuda(name):
    cfg = CONFIGS[name]
    gpu, ref = models(name)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist() for _ in PROMPTS]
    batched = run(gpu, seqs, SCHEDULE)
    alone = run(gpu, seqs, [[s] for which in SCHEDULE for s in which])
    for key, got in batched.items():
        assert torch.equal(got, alone[key]), f"slot {key[0]} position {key[1]}: rows interfere"
    for s in range(len(PROMPTS)):
        n = max(q for t, q in batched if t == s) + 1
        want = ref.forward(torch.tensor([seqs[s][:n]]), ref.new_cache(n), 0)[0]
        for q in range(PROMPTS[s], n):
            err = (batched[s, q] - want[q]).abs().max() / want[q].abs().max()
            assert err < 5e-2, f"slot {s} position {q}: {err}"
