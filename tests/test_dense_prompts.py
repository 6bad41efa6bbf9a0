"""Prompt products reading decoded copies kept once (backends/cuda.keep_dense_prompt_weights, QWeight.dense,
kernels/linear.dequant_product), on the CPU under Triton's interpreter with the CUDA backend's ops and
fused weights. Oracle: the same forward decoding every weight on every prompt, as before the copies: the
logits must be equal bit for bit (the copies are those decodes' values); every prompt product but the
one-row head must then read a copy (no decode left); the budget and GPU memory share decide all or none."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (tests/conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_triton_kernels import TINY  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from localllm.backends import cuda  # noqa: E402
from localllm.cache import make_cache  # noqa: E402
from localllm.kernels import linear  # noqa: E402
from localllm.load import build_model  # noqa: E402


def runtime(wtype: str) -> cuda.CudaRuntime:
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=1)
    return build_model(TINY, dict(state), "cpu", torch.float32, keep_quantized=True, backend=cuda.CudaRuntime)


def prompt_logits(rt: cuda.CudaRuntime) -> torch.Tensor:
    tokens = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        return rt.model(tokens, make_cache(TINY, 16), 0, last_only=True)


@pytest.mark.parametrize("wtype", ["Q4_K", "Q8_0", "Q6_K"])
def test_kept_copies_give_the_same_logits_and_replace_every_decode(wtype, monkeypatch):
    rt = runtime(wtype)
    want = prompt_logits(rt)
    ws = cuda.prompt_qweights(rt.model)
    # q|k|v and gate/up fused, o and down: four products a layer
    assert len(ws) == 4 * TINY.n_layers and all(w.dense is None for w in ws)
    need = sum(w.shape[0] * w.shape[1] for w in ws) * 4
    assert cuda.keep_dense_prompt_weights(rt.model, torch.float32, need - 1) == 0  # all or none
    assert all(w.dense is None for w in ws)
    assert cuda.keep_dense_prompt_weights(rt.model, torch.float32, need) == need
    decoded = []
    real = linear.dequantize_qweight
    monkeypatch.setattr(linear, "dequantize_qweight", lambda w, dtype=torch.float32: decoded.append(w) or real(w, dtype))
    got = prompt_logits(rt)
    assert torch.equal(got, want)
    # on the CPU the one-row head product decodes too (on CUDA it is the integer-dot kernel): nothing else
    assert decoded and all(w is rt.model.output.w for w in decoded)


def test_the_runtime_keeps_copies_in_a_share_of_free_memory_once(monkeypatch):
    rt = runtime("Q8_0")
    need = sum(w.shape[0] * w.shape[1] for w in cuda.prompt_qweights(rt.model)) * 4
    free = {"bytes": 2 * need - 8}  # half of it is less than the copies need
    monkeypatch.setattr(cuda.torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    rt.keep_dense_prompts()
    assert rt.dense_prompt_bytes == 0 and all(w.dense is None for w in cuda.prompt_qweights(rt.model))
    free["bytes"] = 2 * need
    rt.keep_dense_prompts()  # decided at the first prompt: not again
    assert rt.dense_prompt_bytes == 0
    fresh = runtime("Q8_0")
    fresh.keep_dense_prompts()
    assert fresh.dense_prompt_bytes == need and all(w.dense is not None for w in cuda.prompt_qweights(fresh.model))
    never = runtime("Q8_0")
    never.dense_prompt_share = 0.0
    never.keep_dense_prompts()
    assert never.dense_prompt_bytes == 0


def test_slot_caches_keep_the_heads_copy_where_it_fits(monkeypatch):
    """With head=True (the runtime's first pass is a slot cache's: serve's dense decode steps) the
    quantized head is decoded too, if it fits beside the layers' copies; else the layers' alone."""
    rt = runtime("Q8_0")
    ws, out = cuda.prompt_qweights(rt.model), rt.model.output.w
    need = sum(w.shape[0] * w.shape[1] for w in ws) * 4
    with_head = need + out.shape[0] * out.shape[1] * 4
    assert cuda.keep_dense_prompt_weights(rt.model, torch.float32, with_head - 1, head=True) == need
    assert out.dense is None and all(w.dense is not None for w in ws)
    rt = runtime("Q8_0")
    out = rt.model.output.w
    assert cuda.keep_dense_prompt_weights(rt.model, torch.float32, with_head, head=True) == with_head
    assert torch.equal(out.dense, linear.dequantize_qweight(out, torch.float32))
    monkeypatch.setattr(cuda.torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    # the head's copy for slot caches whose steps reach dense_decode_rows slots (17 slots: bucket 32)
    for rows, n, kept in ((32, 17, with_head), (32, 16, need), (0, 64, need), (32, None, need)):
        rt = runtime("Q8_0")
        rt.dense_decode_rows = rows
        rt.keep_dense_prompts(rt.new_slots(n, 4) if n else None)
        assert rt.dense_prompt_bytes == kept, (rows, n)
