"""Mixture-of-experts prompts on CUDA (backends/cuda_moe_prefill.py: device routing, grouped GEMMs or
the decode kernels for few slots) at real widths (test_gpu_moe_graph.py's Qwen3-30B-A3B, gpt-oss-20b
and Mixtral layer shapes, random weights): the prompt's logits against the CPU fp32 reference on both
paths; PrefillGraph captures a MoE prompt and its replay equals the eager forward bit for bit; the
prompt then greedy decoding gives the old eager path's (MoE.forward) ids."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from .gpu_helpers import decode_errors, random_ids, rel
from .test_gpu_moe_graph import runtimes


def paths(rt, tokens: int) -> set[bool]:
    """Which paths (True: the decode kernels) the model's MoE layers take for a prompt of `tokens`."""
    from localllm.backends.cuda_moe_prefill import few_slots

    return {few_slots(b.moe, tokens * rt.cfg.n_experts_used) for b in rt.model.blk}


# qwen3moe: 8 slots a token, 4 a expert take the decode kernels up to 64 tokens (128 experts)
# (test_gpu_moe_graph's shapes: qwen3moe 32 experts top 8, gpt-oss 8 top 4, Mixtral 8 top 2; Q4_K_M's
# Q5_0 stacks have no kernel: those prompts always take the grouped GEMM)
@pytest.mark.parametrize("name,wtype,prompt", [("qwen3moe", "Q4_K_M", 200), ("qwen3moe", "Q8_0", 12),
                                               ("qwen3moe", "bf16", 200), ("gptoss", "MXFP4", 120),
                                               ("gptoss", "MXFP4", 8), ("mixtral", "Q4_K_M", 100)])
@torch.inference_mode()
def test_moe_prompt_logits_match_cpu_fp32(name, wtype, prompt, steps=4):
    """The prompt's last logits and a few decode steps after it (rel < 5e-2): gpu_helpers.check_logits'
    bounds (prompts: 3e-2, or no more than 1.25x the error of the eager path this replaces: at 200
    tokens of the Qwen3 shape bf16 alone costs ~5e-2, on both paths), at prompt lengths that take the
    grouped GEMM (long) or the decode kernels (short)."""
    gpu, ref = runtimes(name, wtype)
    assert paths(gpu, prompt) == ({True} if prompt < 30 else {False})
    ids = random_ids(gpu.cfg.vocab_size, prompt + steps, seed=4)
    cg, cc = gpu.new_cache(prompt + steps), ref.new_cache(prompt + steps)
    lg, lc = gpu.prefill(cg, [ids[:prompt]], 0)[0], ref.prefill(cc, [ids[:prompt]], 0)[0]
    err, old_err = rel(lg.float(), lc), rel(prompt_logits(gpu, ids[:prompt], old=True).float().cpu(), lc)
    assert err < max(3e-2, 1.25 * old_err), (err, old_err)
    errs, disagree = decode_errors(gpu, ref, cg, cc, ids[prompt:])
    assert max(errs) < 5e-2 and disagree <= 1, errs


@pytest.mark.parametrize("name,wtype,prompt", [("qwen3moe", "Q4_K_M", 200), ("gptoss", "MXFP4", 120),
                                               ("gptoss", "MXFP4", 8)])
@torch.inference_mode()
def test_moe_prefill_graph_replays_the_eager_forward(name, wtype, prompt):
    """The second prompt of one shape is captured (no host sync inside: the capture would fail), the
    third replayed; both give the first (eager) prompt's logits and cache rows bit for bit."""
    gpu, _ = runtimes(name, wtype)
    ids = random_ids(gpu.cfg.vocab_size, prompt, seed=7)
    cache = gpu.new_cache(prompt + 8)  # one cache: PrefillGraph is kept per cache
    logits, rows = [], []
    for _ in range(3):
        logits.append(gpu.prefill(cache, [ids], 0).clone())
        rows.append(cache.k[:, :, :, :prompt].clone())
    assert gpu.prefill_graph.key is not None and gpu.prefill_graph.graph is not None
    for i in (1, 2):
        assert torch.equal(logits[i], logits[0]), i
        assert torch.equal(rows[i], rows[0]), i


@pytest.mark.parametrize("name,wtype,prompt", [("qwen3moe", "Q4_K_M", 200), ("gptoss", "MXFP4", 120),
                                               ("mixtral", "bf16", 100)])
@torch.inference_mode()
def test_moe_prefill_then_greedy_equals_the_eager_path(name, wtype, prompt, steps=32):
    """Prefill (grouped GEMMs) then 32 greedy steps give the ids of the old path (model.moe_mlp:
    MoE.forward's per-expert products, the same weights) then the same steps: the two prompts' logits
    differ by rounding only (bf16 products; the eager path's int8 x for an expert of <= 4 tokens:
    kernels.linear's gemv_q8), rel < 1e-2, here not enough to move an argmax (logits-close, then equal
    ids)."""
    gpu, _ = runtimes(name, wtype)
    ids = random_ids(gpu.cfg.vocab_size, prompt, seed=8)
    runs = []
    for old in (False, True):
        cache = gpu.new_cache(prompt + steps + 1)
        logits = prompt_logits(gpu, ids, old, cache)
        out, tok = [], logits.argmax(-1).view(1)
        for _ in range(steps):
            out.append(int(tok))
            tok = gpu.greedy_step(cache, tok)
        runs.append((logits, out))
    (new_logits, new_ids), (old_logits, old_ids) = runs
    assert rel(new_logits.float(), old_logits.float()) < 1e-2
    assert new_ids == old_ids


def prompt_logits(gpu, ids: list[int], old: bool, cache=None) -> torch.Tensor:
    """The prompt's last logits (V,) through the model's forward: the new MoE prompt path, or (old) the
    eager one, model.moe_mlp (MoE.forward's per-expert products, the same weights)."""
    from localllm.model import moe_mlp

    ops = {b: b.ops for b in gpu.model.blk}
    if old:
        for b in gpu.model.blk:
            b.ops = replace(b.ops, moe=moe_mlp)
    try:
        cache = cache if cache is not None else gpu.new_cache(len(ids))
        return gpu.model(torch.tensor([ids], device=gpu.device), cache, 0, last_only=True)[0, -1].clone()
    finally:
        for b, o in ops.items():
            b.ops = o
