"""Gemma 4's mixture-of-experts block (26B-A4B): experts beside the dense MLP, not instead of it.

Must match transformers' Gemma4TextDecoderLayer with enable_moe_block (Gemma4TextRouter,
Gemma4TextExperts) and llama.cpp's gemma4 graph. With x the residual after attention and h the dense
MLP's output (of ffn_norm(x)):
    router:  p = softmax(ffn_gate_inp(rmsnorm(x) * ffn_gate_inp.scale / sqrt(C))) (fp32), top k,
             renormalised to sum 1, times ffn_down_exps.scale[expert] (HF router.per_expert_scale);
    experts: gate, up = halves of ffn_gate_up_exps[e] @ pre_ffw_norm_2(x); y_e = ffn_down_exps[e] @
             (gelu_tanh(gate) * up);
    out = post_ffw_norm_1(h) + post_ffw_norm_2(sum_k w_k y_k)   (then the layer's post_ffw_norm).
Tensors (GGUF names, on the Block): ffn_gate_inp.{weight (E, C), scale (C,)}, ffn_gate_up_exps.weight
(E, 2F, C), ffn_down_exps.{weight (E, C, F), scale (E,)}, pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class Experts(nn.Module):
    """Stacked expert matrices `weight` (E, out, in), and optionally a per-expert `scale` (E,)."""

    def __init__(self, n: int, rows: int, cols: int, scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, rows, cols))
        self.scale = nn.Parameter(torch.empty(n)) if scale else None


def add_moe(blk: nn.Module, cfg: ModelConfig, linear_cls, norm_cls, ops) -> None:
    """The MoE tensors of a Gemma 4 layer, as modules of blk (their GGUF names)."""
    E, C, Fe = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
    # the router and the experts under `blk.N.moe.` (the module names weights.to_module_name gives
    # expert tensors), the norms on the block
    blk.moe = nn.Module()
    blk.moe.ffn_gate_inp = linear_cls(C, E, bias=False)
    blk.moe.ffn_gate_inp.scale = nn.Parameter(torch.empty(C))
    blk.moe.ffn_gate_up_exps = Experts(E, 2 * Fe, C)
    blk.moe.ffn_down_exps = Experts(E, C, Fe, scale=True)
    blk.pre_ffw_norm_2 = norm_cls(C, cfg.norm_eps, ops)
    blk.post_ffw_norm_1 = norm_cls(C, cfg.norm_eps, ops)
    blk.post_ffw_norm_2 = norm_cls(C, cfg.norm_eps, ops)


def route(blk: nn.Module, x: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, C) residual -> (weights (N, K) fp32, experts (N, K))."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    dtype = blk.moe.ffn_gate_inp.scale.dtype
    scores = blk.moe.ffn_gate_inp((normed.to(dtype) * blk.moe.ffn_gate_inp.scale * cfg.dim ** -0.5))
    probs = torch.softmax(scores.float(), dim=-1)
    weights, idx = torch.topk(probs, cfg.n_experts_used, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights * blk.moe.ffn_down_exps.scale.float()[idx], idx


def moe_ffn(blk: nn.Module, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x (B, T, C) the residual, h (B, T, C) the dense MLP's output -> the two branches' sum (B, T, C)."""
    cfg = blk.cfg
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx = route(blk, flat, cfg)
    inp = blk.pre_ffw_norm_2(flat)
    out = torch.zeros(flat.shape[0], shape[-1], dtype=torch.float32, device=x.device)
    gate_up, down = blk.moe.ffn_gate_up_exps.weight, blk.moe.ffn_down_exps.weight
    for e in idx.unique().tolist():  # the experts some token chose, each on its tokens
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gate, up = F.linear(inp[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    experts = blk.post_ffw_norm_2(out.to(inp.dtype).view(shape))
    return blk.post_ffw_norm_1(h) + experts
