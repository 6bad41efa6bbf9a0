"""Rope frequency divisors (the model's `rope_freqs` buffer, (head_dim / 2,) fp32) from RopeScaling.

The model divides its base frequencies theta^(-2i/D) by these. Kind "llama3" is model.
llama3_rope_factors (banded, Llama 3.x); kind "linear" divides every frequency by the factor, which
is transformers' _compute_linear_scaling_rope_parameters (inv_freq / factor) and llama.cpp's
freq_scale = 1 / factor. Gemma 3 scales its global layers only: its sliding layers rotate with
rope_theta_local and no divisor (transformers' "sliding_attention" rope is "default"; llama.cpp's
rope_freq_scale_train_swa is 1).
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def linear_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """(head_dim / 2,) fp32, every entry the linear factor (on the CPU, even under a meta device)."""
    return torch.full((cfg.head_dim // 2,), float(cfg.rope_scaling.factor), device="cpu")


def rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """The divisors cfg's rope scaling implies: ones without scaling."""
    from .model import llama3_rope_factors  # model.py builds the buffer from this module

    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        return linear_rope_factors(cfg)
    return llama3_rope_factors(cfg)
