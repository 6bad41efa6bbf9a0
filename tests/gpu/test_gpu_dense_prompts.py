"""CudaRuntime's kept prompt copies on the GPU (backends/cuda.keep_dense_prompt_weights): a prompt's logits
through CudaRuntime.prefill (eager, then its captured graph) equal bit for bit those of a runtime that
decodes every weight on every prompt (dense_prompt_share 0), for the quantized types the copies replace;
the copies are kept at the first prompt, with a share of the free memory; bf16 weights have none.
tests/test_dense_prompts.py checks the same on the CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from localllm.config import ModelConfig

CFG = ModelConfig(arch="llama", n_layers=3, dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=32,
                  vocab_size=512, context_length=256, norm_eps=1e-6, rope_theta=10000.0)


def runtime(wtype: str, share: float):
    from localllm.backends.cuda import CudaRuntime
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    state, _ = synthetic_state(CFG, wtype, "cpu", seed=3)
    rt = build_model(CFG, dict(state), "cuda", torch.bfloat16)
    assert isinstance(rt, CudaRuntime)
    rt.dense_prompt_share = share
    return rt


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_K_M", "bf16"])
def test_kept_copies_give_the_same_prompt_logits(wtype):
    from localllm.backends.cuda import prompt_qweights

    kept, decoding = runtime(wtype, 0.5), runtime(wtype, 0.0)
    ids = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for rt in (kept, decoding):
        cache = rt.new_cache(64)
        # the same prompt three times: eager, eager (then captured), replayed
        logits[id(rt)] = [rt.prefill(cache, [ids])[0].clone() for _ in range(3)]
    for got, want in zip(logits[id(kept)], logits[id(decoding)]):
        assert torch.equal(got, want)
    ws = prompt_qweights(kept.model)
    if wtype == "bf16":
        assert not ws and kept.dense_prompt_bytes == 0
    else:
        assert ws and all(w.dense is not None and w.dense.dtype == torch.bfloat16 for w in ws)
        assert kept.dense_prompt_bytes == sum(w.dense.numel() * 2 for w in ws)
        assert decoding.dense_prompt_bytes == 0 and all(w.dense is None for w in prompt_qweights(decoding.model))
