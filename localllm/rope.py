"""Rotary position embedding: the tables each layer rotates q and k by, and the rotation.

A rope set is (base, rotated dims R, per-frequency divisors, attention factor). Every scaling a
checkpoint names reduces to divisors and a factor: llama3 (computed here, or GGUF's rope_freqs tensor),
linear (all divisors = factor), LongRoPE (the checkpoint's short/long factors), YaRN (interpolation
blend); the factor multiplies cos and sin (YaRN's and LongRoPE's attention scaling). A layer uses the
global set, the local one (sliding layers of Gemma 3: their own base, no scaling), or none (NoPE).
Must match transformers' rotary embeddings (fp32 outer product of positions and inverse frequencies).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .rope_dims import local_rotary_dims, rotary_dims  # noqa: F401 (moved there, re-exported)


# A divisor that makes a frequency 0 (llama.cpp's converter writes it into rope_freqs for Gemma 4's
# unrotated pairs; finite, so the loader's non-finite check passes).
NO_ROTATION = 1e30


def llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """(R/2,) divisors of the global set's frequencies from cfg.rope_scaling (ones for none); llama3's
    must match transformers' _compute_llama3_parameters."""
    rs, d = cfg.rope_scaling, rotary_dims(cfg)
    # On the CPU even when built under torch.device("meta"): meta arange imports torch._dynamo (~2 s).
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if rs is None:
        # Gemma 4 "proportional" rope (transformers _compute_proportional_rope_parameters): the first
        # int(fraction * d / 2) frequencies rotate, the others are 0
        rotated = int(cfg.rope_partial_global * d // 2)
        return torch.tensor([1.0] * rotated + [NO_ROTATION] * (d // 2 - rotated), device="cpu")
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rs.original_context / rs.low_freq_factor
    high_wavelen = rs.original_context / rs.high_freq_factor
    smooth = (rs.original_context / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / rs.factor + smooth)
    factors = torch.where(wavelen > low_wavelen, torch.full_like(wavelen, rs.factor), medium)
    factors = torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), factors)
    return factors.float()


def rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """(R/2,) divisors of the global set from cfg.rope_scaling, by its kind: "linear" divides every
    frequency by the factor (transformers' _compute_linear_scaling_rope_parameters: inv_freq / factor;
    llama.cpp: freq_scale = 1 / rope.scaling.factor), "yarn" as yarn_rope_factors, "llama3" as
    llama3_rope_factors."""
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        return torch.full((rotary_dims(cfg) // 2,), float(rs.factor), device="cpu")
    if rs is not None and rs.kind == "yarn":
        return yarn_rope_factors(cfg)
    return llama3_rope_factors(cfg)


def yarn_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """(R/2,) YaRN divisors: transformers' _compute_yarn_parameters blends inv_freq / factor and inv_freq
    with the extrapolation weight m = 1 - ramp over the correction range [low, high] of dims (rounded
    outwards when truncate), so the divisor is 1 / ((1 - m) / factor + m). The attention factor is
    cfg.rope_attn_factor (config.py)."""
    rs, d = cfg.rope_scaling, rotary_dims(cfg)

    def correction_dim(rotations: float) -> float:
        return d * math.log(rs.original_context / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    m = 1 - ramp
    return 1.0 / ((1 - m) / rs.factor + m)


def rope_table(positions: torch.Tensor, base: float, dims: int, divisors: torch.Tensor | None = None,
               factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (T,) -> cos, sin (T, dims/2) fp32: angles pos * inv_freq / divisors, times factor."""
    exponent = torch.arange(0, dims, 2, dtype=torch.int64, device=positions.device).float() / dims
    inv_freq = 1.0 / (base**exponent)
    if divisors is not None:
        inv_freq = inv_freq / divisors.float()
    angles = positions.float()[:, None] * inv_freq[None, :]
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def layer_ropes(cfg: ModelConfig, positions: torch.Tensor, divisors: torch.Tensor) -> list:
    """Per layer: (cos, sin) of its rope set, or None for a NoPE layer; sets shared between layers."""
    dims = rotary_dims(cfg)
    glob = rope_table(positions, cfg.rope_theta, dims, divisors, cfg.rope_attn_factor)
    local_dims = local_rotary_dims(cfg)
    local = glob if cfg.rope_theta_local is None and local_dims == dims else \
        rope_table(positions, cfg.rope_theta_local or cfg.rope_theta, local_dims)
    return [None if not cfg.has_rope(i) else local if cfg.sliding(i) else glob for i in range(cfg.n_layers)]


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (T, R/2): rotate the pairs (i, i + R/2) of the first R dims (R = D
    unless partial rotary), in fp32, rounded back to x's dtype; dims past R pass through."""
    r = 2 * cos.shape[-1]
    x1, x2 = (x if r == x.shape[-1] else x[..., :r]).float().chunk(2, dim=-1)  # (a full slice is aten.alias)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)
