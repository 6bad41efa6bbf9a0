"""The CPU path (quantized weights kept as the file's blocks, C++ kernels, int16-rounded activations)
against the dense fp32 reference (weights decoded by quantize.dequantize_torch, torch ops), on the
default model teacher-forced through 256 tokens of bench/data/eval.txt: one decode step at a time and
as one prompt (was bench/cpu_error.py).

Bounds: measured 2.6e-4 largest logit error over the logit range, KL 8.6e-8 mean / 2.2e-6 largest,
the same top token at every position (docs/PERFORMANCE.md, CPU error); the only source of error is
the activations' int16 rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

EVAL = Path(__file__).resolve().parents[1] / "bench" / "data" / "eval.txt"
N = 256


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per position: max |logit error| / logit range, KL(want || got); and the share of equal top ids."""
    err = (got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))
    lw, lg = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lw.exp() * (lw - lg)).sum(-1)
    return err, kl, (got.argmax(-1) == want.argmax(-1)).float().mean().item()


@torch.inference_mode()
def test_cpu_path_error_against_fp32_reference(default_path, default_lm):
    from localllm.load import load_model

    cpu = load_model(str(default_path), "cpu")
    ref = default_lm.runtime  # conftest's fp32 load, weights decoded to dense float32 (shared)
    ids = cpu.tokenizer.encode(EVAL.read_text(), add_bos=cpu.tokenizer.add_bos)[:N]
    assert len(ids) == N
    tokens = torch.tensor([ids])
    rt = cpu.runtime
    want = ref.forward(tokens, ref.new_cache(N), 0)[0]
    cache = rt.new_cache(N)
    decode = torch.stack([rt.decode(cache, torch.tensor([t]))[0] for t in ids])
    prompt = rt.forward(tokens, rt.new_cache(N), 0)[0]
    for name, got in (("decode", decode), ("prompt", prompt)):
        err, kl, same = errors(got.float(), want)
        assert err.max() < 1e-3, f"{name}: logit error / range {err.max():.2e}"
        assert kl.mean() < 1e-6 and kl.max() < 2e-5, f"{name}: KL mean {kl.mean():.2e}, max {kl.max():.2e}"
        assert same == 1.0, f"{name}: same top token at {same:.2%} of positions"
