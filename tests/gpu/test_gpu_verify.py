"""Speculative decoding's verify pass on CUDA (was bench/verify_rows.py): after a 512-id prompt, one
verify pass of K + 1 = 6 ids gives the logits of 6 plain decode steps from the same cache length, bit
for bit (the decode step's kernels do not depend on how many tokens a step takes or on run order), for
dense and quantized weights; and greedy speculative decoding yields plain greedy decoding's ids."""

from __future__ import annotations

import pytest
import torch
from .gpu_helpers import random_ids

PRESET, LAYERS, DEPTH, TOKENS = "llama-3.2-1b", 8, 512, 6


@pytest.mark.parametrize("wtype", ["BF16", "Q8_0", "Q4_0", "Q4_K_M"])
@torch.inference_mode()
def test_verify_rows_equal_plain_steps(synthetic_files, wtype):
    from localllm.load import load_model

    rt = load_model(str(synthetic_files.gguf(PRESET, wtype, LAYERS)), "cuda", torch.bfloat16).runtime
    cache = rt.new_cache(DEPTH + TOKENS + 1)
    rt.prefill(cache, [random_ids(rt.cfg.vocab_size, DEPTH, seed=0)], 0)
    ids = random_ids(rt.cfg.vocab_size, TOKENS, seed=1)
    cache.length = DEPTH
    rows = rt.verify(cache, ids).clone()
    for attempt in range(2):  # plain steps twice: the same rows both times, and the verify pass's
        cache.length = DEPTH
        plain = torch.stack([rt.decode(cache, torch.tensor([t], device=rt.device))[0].clone() for t in ids])
        assert rows.shape == plain.shape
        assert torch.equal(rows, plain), f"attempt {attempt}: max diff {(rows - plain).abs().max().item():.2e}"


@pytest.mark.parametrize("wtype", ["BF16", "Q4_0"])
@torch.inference_mode()
def test_greedy_speculative_equals_plain(synthetic_files, wtype, n=48):
    """Prompt lookup on a repetitive prompt (a block of 64 random ids four times) drafts 5 ids a round."""
    from localllm.draft import LookupDrafter
    from localllm.generate import generate
    from localllm.load import load_model
    from localllm.sampling import Sampler
    from localllm.settings import DraftSettings, SamplingSettings
    from localllm.speculative import generate_speculative

    rt = load_model(str(synthetic_files.gguf(PRESET, wtype, LAYERS)), "cuda", torch.bfloat16).runtime
    prompt = random_ids(rt.cfg.vocab_size, 64, seed=2) * 4
    greedy = SamplingSettings(temperature=0)
    plain = list(generate(rt, rt.new_cache(len(prompt) + n + 1), prompt, Sampler(greedy, rt.device), n))
    ds = DraftSettings(lookup=3, max_draft=5)
    spec = list(generate_speculative(rt, rt.new_cache(len(prompt) + n + 1), prompt, Sampler(greedy, rt.device),
                                     LookupDrafter(3, 0.0), n, settings=ds))
    assert len(plain) == n
    assert spec == plain
