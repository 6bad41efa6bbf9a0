"""One transformer module for every architecture in config.ARCHITECTURES.

Shapes: B batch, T new tokens, S cache capacity, H query heads, Hkv key/value heads, D head dim,
C model dim, V vocab. Parameter names are the GGUF tensor names (`token_embd`, `blk.N.attn_q`, ...)
so a GGUF file loads without renaming; `weights.py` maps Hugging Face names onto them.

RoPE is the "neox" / rotate-half form used by Hugging Face; llama.cpp's llama-arch GGUF files store
q/k rows permuted for its interleaved form, and the loader undoes that permutation.

This is the one description of the layer. A backend (localllm/backends/) replaces only the few ops
of `Ops` with its own kernels computing the same math; TORCH_OPS are the portable reference ops
(torch ops MPS runs: tests/test_portable_ops.py checks the list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from localllm.kernels.cpu import BlockQWeight, embed
from localllm.kernels.linear import linear
from localllm.kernels.qweight import QWeight

from .cache import KVCache
from .config import ModelConfig


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), through kernels.linear, which picks the kernel for the weight's kind.

    Holds either a dense `weight` parameter or, after set_quantized (the loader's placement), a
    QWeight / BlockQWeight `qweight` that stays quantized; `w` is whichever it holds.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qweight: QWeight | None = None

    def set_quantized(self, qw: QWeight) -> None:
        """Replace the dense weight by a quantized one of the same (out, in) shape."""
        if self.weight is not None and tuple(qw.shape) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {qw.shape} for a Linear of {tuple(self.weight.shape)}")
        self.weight = None  # drops the parameter: state dicts then hold only the dense tensors
        self.qweight = qw

    @property
    def w(self) -> torch.Tensor | QWeight:
        return self.qweight if self.qweight is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w, self.bias)


class QEmbedding(nn.Module):
    """token_embd kept as the file's blocks (CPU and MPS, load.place_quantized): a lookup decodes only
    the rows it needs (dequantize_torch's values); `weight` also serves the tied output product."""

    def __init__(self, weight: BlockQWeight):
        super().__init__()
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return embed(self.weight, tokens)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C) -> (..., C) in weight's dtype. Normalise in fp32 and scale after casting to the
    weights' dtype, as transformers' LlamaRMSNorm does; x may be the fp32 residual stream."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def project_qkv(attn: "Attention", x: torch.Tensor, layer: int, cache: KVCache, start: int, cos, sin):
    """x (B, T, C) -> q (B, H, T, D) rotated, and the cache's keys, values (B, Hkv, start + T, D) with
    this step's rows written."""
    cfg, (B, T, _) = attn.cfg, x.shape
    q = attn.attn_q(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    k = attn.attn_k(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    v = attn.attn_v(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    if cfg.qk_norm:
        q, k = attn.attn_q_norm(q), attn.attn_k_norm(k)
    q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
    return (q, *cache.update(layer, start, k, v))


def glu_input(blk: "Block", h: torch.Tensor) -> torch.Tensor:
    """h (B, T, C) -> silu(gate(h)) * up(h) (B, T, F): the down projection's input."""
    return F.silu(blk.ffn_gate(h)) * blk.ffn_up(h)


@dataclass(frozen=True)
class Ops:
    """The ops a backend may replace in the layer, each computing the same math as the reference:
    rmsnorm(x, weight, eps) as `rmsnorm`; qkv(attn, x, layer, cache, start, cos, sin) as
    `project_qkv` (and the same cache writes); mlp_in(blk, h) as `glu_input`."""

    rmsnorm: Callable
    qkv: Callable
    mlp_in: Callable


TORCH_OPS = Ops(rmsnorm=rmsnorm, qkv=project_qkv, mlp_in=glu_input)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops = TORCH_OPS):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (T, D/2). Rotate the pairs (i, i + D/2).
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """Per-frequency divisors for Llama 3.x rope scaling; must match transformers' _compute_llama3_parameters."""
    rs = cfg.rope_scaling
    d = cfg.head_dim
    # On the CPU even when built under torch.device("meta"): meta arange imports torch._dynamo (~2 s).
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if rs is None:
        return torch.ones(d // 2, device="cpu")
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rs.original_context / rs.low_freq_factor
    high_wavelen = rs.original_context / rs.high_freq_factor
    smooth = (rs.original_context / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / rs.factor + smooth)
    factors = torch.where(wavelen > low_wavelen, torch.full_like(wavelen, rs.factor), medium)
    factors = torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), factors)
    return factors.float()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.attn_q = Linear(cfg.dim, cfg.q_dim, bias=cfg.qkv_bias)
        self.attn_k = Linear(cfg.dim, cfg.kv_dim, bias=cfg.qkv_bias)
        self.attn_v = Linear(cfg.dim, cfg.kv_dim, bias=cfg.qkv_bias)
        self.attn_output = Linear(cfg.q_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.attn_q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
            self.attn_k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
        # (q|k|v weight, bias) as one product whose rows attn_q/k/v view, for backends that fuse them
        # at load (backends/cuda.py's fuse); None: three products
        self.fused_qkv: tuple | None = None

    def forward(self, x, layer: int, cache: KVCache, start: int, cos, sin, mask):
        # x: (B, T, C) -> (B, T, C); writes this step's k/v into cache rows [start, start + T).
        cfg, (B, T, _) = self.cfg, x.shape
        q, keys, values = self.ops.qkv(self, x, layer, cache, start, cos, sin)
        # keys/values: (B, Hkv, start + T, D); mask None means plain causal from position 0.
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=True
        )
        return self.attn_output(y.transpose(1, 2).reshape(B, T, cfg.q_dim))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn = Attention(cfg, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_gate = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.ffn_up = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.ffn_down = Linear(cfg.ffn_dim, cfg.dim, bias=False)
        # gate/up rows interleaved in one weight, for backends that fuse them at load; None: two products
        self.fused_gate_up = None

    def forward(self, x, layer, cache, start, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), layer, cache, start, cos, sin, mask)
        return x + self.ffn_down(self.ops.mlp_in(self, self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.cfg = cfg
        # _weight: no random init (on the meta device that init alone imports torch._dynamo: ~2 s of load)
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.blk = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        if not cfg.tied_output:
            self.output = Linear(cfg.dim, cfg.vocab_size, bias=False)
        # (D/2,) divisors of the rope frequencies: ones, llama3 factors, or a GGUF rope_freqs tensor.
        self.register_buffer("rope_freqs", llama3_rope_factors(cfg), persistent=True)

    def output_weight(self) -> torch.Tensor | QWeight:
        return self.token_embd.weight if self.cfg.tied_output else self.output.w

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) -> cos, sin: (T, D/2) in fp32, computed like transformers (fp32 outer product).
        d = self.cfg.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d
        inv_freq = 1.0 / (self.cfg.rope_theta**exponent) / self.rope_freqs.float()
        angles = positions.float()[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """tokens: (B, T) at positions [start, start + T) -> logits (B, T, V) in fp32 ((B, 1, V) with last_only)."""
        T = tokens.shape[1]
        positions = torch.arange(start, start + T, device=tokens.device)
        cos, sin = self.rope_tables(positions)
        mask = None
        if start > 0 and T > 1:
            # Query i (position start + i) sees keys 0 .. start + i.
            keys = torch.arange(start + T, device=tokens.device)
            mask = keys[None, :] <= positions[:, None]
        # The residual stream stays fp32 whatever the weights' dtype (fp16 would overflow on some models).
        x = self.token_embd(tokens).float()
        for i, blk in enumerate(self.blk):
            x = blk(x, i, cache, start, cos, sin, mask)
        if last_only:
            x = x[:, -1:]
        x = self.output_norm(x)
        cache.length = start + T
        return linear(x, self.output_weight()).float()
