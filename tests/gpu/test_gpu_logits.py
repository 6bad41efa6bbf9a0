"""Logits of synthetic models on CUDA (bf16 activations, quantized weights kept quantized, prefill and
decode through CUDA graphs) against the same weights on the CPU in fp32 (was bench/cuda_check.py's
logits and greedy sections):

- a 14-token prefill, then 6 decode steps: relative error of each row, and the greedy id;
- prefilling the same ids again (capture, then replay of the prefill graph) gives the same logits;
- greedy_step (the next id chosen inside the decode graph, fed back without a host copy) gives the ids
  of decode + torch's argmax, step for step, and generate() at temperature 0 yields those ids.

Bounds: the largest errors measured on H100 and H200 were 1.5e-2 (prefill) and 2.4e-2 (decode), and
top-1 agreed on 71 of 72 steps (docs/PERFORMANCE.md, CUDA correctness); the bounds leave room for
another card's rounding, not for a wrong kernel (a wrong layer gives errors near 1).
"""

from __future__ import annotations

import pytest
import torch
from .gpu_helpers import decode_errors, random_ids, rel, take_dense_values

CASES = [("smollm2-135m", None), ("qwen2.5-0.5b", None), ("llama-3.2-1b", 8)]  # (preset, layers kept)
TYPES = ["BF16", "Q8_0", "Q4_K_M", "Q4_0"]
PROMPT, STEPS = 14, 6


def open_pair(path):
    """(CUDA runtime, CPU fp32 reference runtime holding the GPU's dense values) of one file."""
    from localllm.load import load_model

    gpu = load_model(str(path), "cuda", torch.bfloat16).runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    assert take_dense_values(ref.model, gpu.model) > 0
    return gpu, ref


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@torch.inference_mode()
def test_cuda_logits_match_cpu_fp32(synthetic_files, case, wtype):
    preset, layers = case
    gpu, ref = open_pair(synthetic_files.gguf(preset, wtype, layers))
    ids = random_ids(gpu.cfg.vocab_size, PROMPT + STEPS, seed=1)
    cg, cc = gpu.new_cache(32), ref.new_cache(32)
    lg = gpu.prefill(cg, [ids[:PROMPT]], 0)[0]
    lc = ref.prefill(cc, [ids[:PROMPT]], 0)[0]
    assert rel(lg.float(), lc) < 3e-2
    for _ in range(3):  # the second call captures the prefill graph, the third replays it
        assert torch.equal(gpu.prefill(cg, [ids[:PROMPT]], 0)[0], lg)
    errs, disagree = decode_errors(gpu, ref, cg, cc, ids[PROMPT:])
    assert max(errs) < 5e-2, errs
    assert disagree <= 1, f"greedy ids differ on {disagree} of {STEPS} steps"


@pytest.mark.parametrize("wtype", ["BF16", "Q4_0", "Q4_K_M"])
@torch.inference_mode()
def test_greedy_step_equals_decode_argmax(synthetic_files, wtype, steps=24):
    from localllm.generate import generate
    from localllm.load import load_model
    from localllm.sampling import Sampler
    from localllm.settings import SamplingSettings

    rt = load_model(str(synthetic_files.gguf("llama-3.2-1b", wtype, 8)), "cuda", torch.bfloat16).runtime
    prompt = random_ids(rt.cfg.vocab_size, 64, seed=5)
    caches = [rt.new_cache(64 + steps) for _ in range(2)]
    first = [rt.prefill(c, [prompt], 0).argmax(-1) for c in caches]
    ids, want = first[0], first[1]
    plain_ids = [int(want)]
    for i in range(steps):
        ids = rt.greedy_step(caches[0], ids)
        want = rt.decode(caches[1], want).argmax(-1)
        plain_ids.append(int(want))
        assert torch.equal(ids, want), f"step {i}"
    cache = rt.new_cache(64 + steps + 1)
    sampler = Sampler(SamplingSettings(temperature=0), rt.device)
    assert list(generate(rt, cache, prompt, sampler, steps + 1)) == plain_ids
