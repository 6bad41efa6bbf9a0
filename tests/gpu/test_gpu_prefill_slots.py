"""prefill_slots on CUDA (localllm/slots.py's portable pass on CUDA tensors; the CUDA backend has no
override): ragged prompts into slots in any order, one after a prefix already in its slot, in one
forward. Oracle: the CPU fp32 forward of each sequence alone (bf16 activations on the GPU); the rows the
pass wrote are checked by one decode_slots step after it, against the same oracle."""

from __future__ import annotations

import pytest
import torch

from .test_gpu_slots import CONFIGS, models  # the same shapes and weights as the decode_slots test

TOL = 5e-2  # largest logit error / largest logit (bf16 activations against the fp32 reference)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_slots_on_cuda(name):
    cfg = CONFIGS[name]
    gpu, ref = models(name)
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
