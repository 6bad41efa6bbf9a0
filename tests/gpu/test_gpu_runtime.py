"""The CUDA runtime's own state (backends/cuda.py): a repeated prompt shape replays a captured graph
that gives the eager forward's logits; decoders and the prefill graph live in the runtime, one per
kind for the cache last used, and nothing is attached to the model's modules."""

from __future__ import annotations

import torch

from .gpu_helpers import random_ids

PRESET, LAYERS = "llama-3.2-1b", 2


def module_fields(model: torch.nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(m)) for name, m in model.named_modules()}


@torch.inference_mode()
def test_runtime_state_stays_in_the_runtime(synthetic_files):
    from localllm.load import load_model

    rt = load_model(str(synthetic_files.gguf(PRESET, "Q8_0", LAYERS)), "cuda", torch.bfloat16).runtime
    before = module_fields(rt.model)
    prompt = random_ids(rt.cfg.vocab_size, 24, seed=7)
    cache = rt.new_cache(64)
    # eager, then captured and replayed, then replayed: the graph runs the eager forward's kernels
    runs = [rt.prefill(cache, [prompt], 0).clone() for _ in range(3)]
    assert rt.prefill_graph is not None and rt.prefill_graph.cache is cache and rt.prefill_graph.graph is not None
    for got in runs[1:]:
        assert torch.equal(got, runs[0])
    assert cache.length == len(prompt)
    rt.decode(cache, torch.tensor([prompt[0]], device=rt.device))
    rt.greedy_step(cache, torch.tensor([prompt[1]], device=rt.device))
    rt.warm_verify(cache)
    rt.verify(cache, prompt[:3])
    assert {key for key, dec in rt.decoders.items() if dec.cache is cache} == set(rt.decoders)
    assert rt.most_drafts(cache) is not None and rt.most_drafts(rt.new_cache(8, batch=2)) is None
    other = rt.new_cache(64)  # a new cache replaces the decoder of its kind
    rt.decode(other, torch.tensor([prompt[0]], device=rt.device))
    assert rt.decoders[(1, False)].cache is other
    assert module_fields(rt.model) == before
