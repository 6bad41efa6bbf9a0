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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from localllm.kernels.cpu import BlockQWeight, embed
from localllm.kernels.linear import linear
from localllm.kernels.qweight import QWeight

from .attention import RowKeys, SegmentKeys, SlotMaskKeys, attend, attention_mask
from .cache import KVCache
from .config import ModelConfig
from .moe import MoE
from .gemma4_moe import add_moe, moe_ffn
from .rope import layer_ropes, llama3_rope_factors, rope_factors, rope_rotate, rope_table, rotary_dims
from .parallel import TensorParallel
from .tp_model import embed_rows, gather_logits, reduce_sum
from .tp_shard import vocab_part

__all__ = ["Linear", "QEmbedding", "Ops", "TORCH_OPS", "RMSNorm", "Attention", "Block", "Transformer",
           "rmsnorm", "project_qkv", "glu_input", "glu", "moe_mlp", "rope_rotate", "llama3_rope_factors"]


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
    this step's rows written. cos/sin (T, R/2) of the layer's rope set; None: a NoPE layer.
    D and Hkv are the layer's (attn.head_dim, attn.n_kv_heads: Gemma 4's layers differ)."""
    cfg, (B, T, _) = attn.cfg, x.shape
    D, Hkv = attn.head_dim, attn.n_kv_heads
    q = attn.attn_q(x).view(B, T, cfg.n_heads, D).transpose(1, 2)
    if attn.attn_k is None:  # a KV-shared layer (Gemma 4): an earlier layer's cache rows, this step's included
        if cfg.qk_norm:
            q = attn.attn_q_norm(q)
        if cos is not None:
            q = rope_rotate(q, cos, sin)
        return (q, *cache.rows(layer, start + T))
    k = attn.attn_k(x).view(B, T, Hkv, D).transpose(1, 2)
    # attn_v None (Gemma 4 attention_k_eq_v): the values are the key projection, before k's norm and rope
    v = k if attn.attn_v is None else attn.attn_v(x).view(B, T, Hkv, D).transpose(1, 2)
    if cfg.qk_norm:
        q, k = attn.attn_q_norm(q), attn.attn_k_norm(k)
    if cfg.attn_v_norm:
        v = unit_rmsnorm(v, cfg.norm_eps)
    if cos is not None:
        q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
    return (q, *cache.update(layer, start, k, v))


def unit_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32, back in x's dtype (Gemma4RMSNorm(with_scale=False))."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def glu(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated unit of cfg.activation: silu(gate) * up (Llama), gelu_tanh(gate) * up (Gemma's
    gelu_pytorch_tanh), or gpt-oss's clamped form (transformers GptOssExperts: alpha 1.702, gate
    clamped above and up both sides at swiglu_limit, (up + 1) * gate * sigmoid(alpha * gate))."""
    if cfg.activation == "silu":
        return F.silu(gate) * up
    if cfg.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    limit = cfg.swiglu_limit
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


def glu_input(blk: "Block", h: torch.Tensor) -> torch.Tensor:
    """h (B, T, C) -> glu(gate(h), up(h)) (B, T, F): the down projection's input."""
    return glu(blk.cfg, blk.ffn_gate(h), blk.ffn_up(h))


def moe_mlp(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    """h (B, T, C) normed -> the mixture of experts' MLP (B, T, C): MoE.forward."""
    return moe(h)


@dataclass(frozen=True)
class Ops:
    """The ops a backend may replace in the layer, each computing the same math as the reference:
    rmsnorm(x, weight, eps) as `rmsnorm`; qkv(attn, x, layer, cache, start, cos, sin) as
    `project_qkv` (and the same cache writes); mlp_in(blk, h) as `glu_input`; moe(moe, h) as
    `moe_mlp` (a Block's MoE)."""

    rmsnorm: Callable
    qkv: Callable
    mlp_in: Callable
    moe: Callable = moe_mlp


TORCH_OPS = Ops(rmsnorm=rmsnorm, qkv=project_qkv, mlp_in=glu_input, moe=moe_mlp)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops = TORCH_OPS):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps)


class Vector(nn.Module):
    """A learned per-head vector held as `weight` (the GGUF name ends in .weight): gpt-oss's sinks."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS, layer: int = 0):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        # this layer's shape (Gemma 4: full layers have their own head dim and kv heads)
        self.head_dim, self.n_kv_heads = D, Hkv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        self.q_dim = cfg.n_heads * D
        own_kv = cfg.kv_source(layer) == layer  # False: a KV-shared layer, no k/v of its own
        v_is_k = cfg.attn_k_eq_v and not cfg.sliding(layer)
        self.attn_q = Linear(cfg.dim, self.q_dim, bias=cfg.qkv_bias)
        self.attn_k = Linear(cfg.dim, Hkv * D, bias=cfg.qkv_bias) if own_kv else None
        self.attn_v = Linear(cfg.dim, Hkv * D, bias=cfg.qkv_bias) if own_kv and not v_is_k else None
        self.attn_output = Linear(self.q_dim, cfg.dim, bias=cfg.attn_out_bias)
        if cfg.qk_norm:
            self.attn_q_norm = RMSNorm(D, cfg.norm_eps, ops)
            self.attn_k_norm = RMSNorm(D, cfg.norm_eps, ops) if own_kv else None
        self.attn_sinks = Vector(cfg.n_heads) if cfg.attn_sinks else None
        # (q|k|v weight, bias) as one product whose rows attn_q/k/v view, for backends that fuse them
        # at load (backends/cuda.py's fuse); None: three products
        self.fused_qkv: tuple | None = None

    def forward(self, x, layer: int, cache: KVCache, start: int, cos, sin, mask):
        # x: (B, T, C) -> (B, T, C); writes this step's k/v into cache rows [start, start + T).
        cfg, (B, T, _) = self.cfg, x.shape
        sinks = self.attn_sinks.weight if self.attn_sinks is not None else None
        if isinstance(mask, (RowKeys, SegmentKeys, SlotMaskKeys)):  # decode_slots / prefill_slots (slots.py),
            # backends/cuda_prompt.py: rows of slots at their own positions; the reference op (a backend's
            # may write one start for all rows); cache: slots.RowCache / slots.SegmentCache
            q, keys, values = project_qkv(self, x, layer, cache, start, cos, sin)
            y = mask.attend(cfg, q, keys, values, sinks)
        else:
            q, keys, values = self.ops.qkv(self, x, layer, cache, start, cos, sin)
            # keys/values: (B, Hkv, start + T, D); mask: attention.attention_mask's
            y = attend(cfg, q, keys, values, mask, sinks)
        return self.attn_output(y.transpose(1, 2).reshape(B, T, self.q_dim))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS, layer: int = 0, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tp = tp  # a shard of the layer (cfg its local config): attention and MLP outputs are partial sums
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn = Attention(cfg, ops, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        # Gemma: norms of the attention and MLP outputs, before each residual add
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops) if cfg.post_norms else None
        self.post_ffw_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops) if cfg.post_norms else None
        # the MLP: a mixture of experts (localllm/moe.py; its router a Linear, its experts' activation glu)
        # or one GLU (Gemma 4's experts run beside its dense MLP instead: moe_with_mlp)
        self.moe = MoE(cfg, Linear, glu) if cfg.n_experts and not cfg.moe_with_mlp else None
        if self.moe is None:
            ffn = cfg.layer_ffn_dim(layer)  # Gemma 4's double-wide MLP on KV-shared layers
            self.ffn_gate = Linear(cfg.dim, ffn, bias=False)
            self.ffn_up = Linear(cfg.dim, ffn, bias=False)
            self.ffn_down = Linear(ffn, cfg.dim, bias=False)
        # Gemma 4 per-layer embeddings: gate (C -> P), projection (P -> C), norm of its output
        if cfg.per_layer_dim:
            self.inp_gate = Linear(cfg.dim, cfg.per_layer_dim, bias=False)
            self.proj = Linear(cfg.per_layer_dim, cfg.dim, bias=False)
            self.post_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.layer_output_scale = Vector(1) if cfg.layer_out_scale else None
        if cfg.moe_with_mlp:  # Gemma 4's experts beside the dense MLP
            add_moe(self, cfg, Linear, RMSNorm, ops)
        # gate/up rows interleaved in one weight, for backends that fuse them at load; None: two products
        self.fused_gate_up = None

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, C) normed -> (B, T, C): the MLP."""
        if self.moe is not None and not self.cfg.moe_with_mlp:  # (Gemma 4's experts: moe_ffn, beside)
            return self.ops.moe(self.moe, h)
        return self.ffn_down(self.ops.mlp_in(self, h))

    def forward(self, x, layer, cache, start, cos, sin, mask, per_layer=None):
        """per_layer (B, T, P): this layer's per-layer input (Gemma 4 PLE), else None."""
        h = self.attn(self.attn_norm(x), layer, cache, start, cos, sin, mask)
        if self.tp is not None:
            h = reduce_sum(self.tp, h)
        if self.post_attention_norm is not None:
            h = self.post_attention_norm(h)
        x = x + h
        h = self.ffn(self.ffn_norm(x))
        if self.tp is not None:
            h = reduce_sum(self.tp, h)
        if self.cfg.moe_with_mlp:
            h = moe_ffn(self, x, h)
        if self.post_ffw_norm is not None:
            h = self.post_ffw_norm(h)
        x = x + h
        if per_layer is not None:  # Gemma4TextDecoderLayer: gelu_tanh(gate(x)) * input, projected, normed, added
            g = F.gelu(self.inp_gate(x.to(per_layer.dtype)), approximate="tanh") * per_layer
            x = x + self.post_norm(self.proj(g))
        if self.layer_output_scale is not None:
            x = x * self.layer_output_scale.weight.float()
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS, tp: TensorParallel | None = None):
        """tp: this module is rank tp.rank's shard (cfg: tp_shard.local_config's; vocab_size the full V, of
        which token_embd and output hold tp_shard.vocab_part's rows); None: the whole model."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        start, stop, _ = vocab_part(cfg.vocab_size, tp) if tp is not None else (0, cfg.vocab_size, 0)
        rows = stop - start  # the embedding's and the head's vocabulary rows
        # _weight: no random init (on the meta device that init alone imports torch._dynamo: ~2 s of load)
        self.token_embd = nn.Embedding(rows, cfg.dim, _weight=torch.empty(rows, cfg.dim))
        self.blk = nn.ModuleList(Block(cfg, ops, i, tp) for i in range(cfg.n_layers))
        if cfg.per_layer_dim:  # Gemma 4 PLE: per token, P values per layer, and their projection from x
            width = cfg.n_layers * cfg.per_layer_dim
            self.per_layer_token_embd = nn.Embedding(cfg.vocab_size, width, _weight=torch.empty(cfg.vocab_size, width))
            self.per_layer_model_proj = Linear(cfg.dim, width, bias=False)
            self.per_layer_proj_norm = RMSNorm(cfg.per_layer_dim, cfg.norm_eps, ops)
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        if not cfg.tied_output:
            self.output = Linear(cfg.dim, rows, bias=False)
        # (R/2,) divisors of the global rope set's frequencies: ones, llama3 / linear / LongRoPE / YaRN
        # factors, or a GGUF rope_freqs tensor (rope.py).
        self.register_buffer("rope_freqs", rope_factors(cfg), persistent=True)
        if cfg.rope_original_context is not None:  # LongRoPE's two divisor sets (config_phi3.py), from the file
            for name in ("rope_factors_short", "rope_factors_long"):
                self.register_buffer(name, torch.ones(rotary_dims(cfg) // 2, device="cpu"), persistent=True)

    def output_weight(self) -> torch.Tensor | QWeight:
        return self.token_embd.weight if self.cfg.tied_output else self.output.w

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, R/2) fp32 of the global rope set (the Llama layer's only one)."""
        cfg = self.cfg
        return rope_table(positions, cfg.rope_theta, rotary_dims(cfg), self.rope_freqs, cfg.rope_attn_factor)

    def rope_divisors(self, capacity: int) -> torch.Tensor:
        """(R/2,) divisors of the global rope set for a KV cache of this capacity: with LongRoPE,
        rope_freqs times the long factors when the capacity exceeds the original context, else the short
        ones (llama.cpp's rule, llama_model::get_rope_factors: by the context in use, for all positions)."""
        if self.cfg.rope_original_context is None:
            return self.rope_freqs
        long = capacity > self.cfg.rope_original_context
        return self.rope_freqs * (self.rope_factors_long if long else self.rope_factors_short)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> the fp32 residual stream (B, T, C). Gemma scales by sqrt(C) in the
        embedding's dtype first, as transformers does (its normalizer is a tensor of that dtype)."""
        tp = self.tp
        x = self.token_embd(tokens) if tp is None else embed_rows(self.token_embd, tokens, tp, self.cfg.vocab_size)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x.float() if tp is None else tp.all_reduce(x.float())

    def layer_inputs(self, start: int, T: int, device, capacity: int | None = None) -> list[tuple]:
        """Per layer (cos, sin, mask) for T tokens at positions [start, start + T): its rope set
        (cos/sin None for a NoPE layer) and its attention mask (attention.attention_mask). capacity:
        the KV cache's (picks LongRoPE's set: rope_divisors); None: start + T."""
        cfg = self.cfg
        positions = torch.arange(start, start + T, device=device)
        if cfg.llama_layer:
            cos, sin = self.rope_tables(positions)
            return [(cos, sin, attention_mask(positions, start + T, None))] * cfg.n_layers
        ropes = layer_ropes(cfg, positions, self.rope_divisors(capacity or start + T))
        full = attention_mask(positions, start + T, None)
        window = attention_mask(positions, start + T, cfg.sliding_window) if cfg.sliding_layers else None
        return [(*(rope or (None, None)), window if cfg.sliding(i) else full) for i, rope in enumerate(ropes)]

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4 PLE (Gemma4TextModel.get_per_layer_inputs + project_per_layer_inputs): tokens (B, T),
        the scaled embeddings x (B, T, C) -> (B, T, L, P) in the weights' dtype; None without PLE."""
        cfg = self.cfg
        if not cfg.per_layer_dim:
            return None
        B, T = tokens.shape
        dtype = self.output_norm.weight.dtype
        tok = self.per_layer_token_embd(tokens)
        tok = (tok * torch.tensor(cfg.per_layer_dim ** 0.5, dtype=tok.dtype)).view(B, T, cfg.n_layers, -1)
        proj = self.per_layer_model_proj(x.to(dtype)) * cfg.dim ** -0.5
        proj = self.per_layer_proj_norm(proj.view(B, T, cfg.n_layers, -1))
        return ((proj + tok.to(proj.dtype)) * 2 ** -0.5).to(dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last residual (B, T, C) -> logits (B, T, V) fp32 (Gemma: soft-capped)."""
        logits = linear(self.output_norm(x), self.output_weight()).float()
        if self.tp is not None:
            logits = gather_logits(logits, self.tp, self.cfg.vocab_size)
        c = self.cfg.final_softcap
        return logits if c is None else torch.tanh(logits / c) * c

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """tokens: (B, T) at positions [start, start + T) -> logits (B, T, V) in fp32 ((B, 1, V) with last_only)."""
        T = tokens.shape[1]
        # The residual stream stays fp32 whatever the weights' dtype (fp16 would overflow on some models).
        x = self.embed(tokens)
        ple = self.per_layer_inputs(tokens, x)
        inputs = self.layer_inputs(start, T, tokens.device, cache.capacity)
        for i, (blk, (cos, sin, mask)) in enumerate(zip(self.blk, inputs)):
            if ple is None:
                x = blk(x, i, cache, start, cos, sin, mask)
            else:
                x = blk(x, i, cache, start, cos, sin, mask, ple[:, :, i])
        if last_only:
            x = x[:, -1:]
        cache.length = start + T
        return self.head(x)
