"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks n_experts_used of
n_experts GLU experts per token; the token's MLP output is their weighted sum.

Shapes: N tokens (B * T), C model dim, E experts, k experts used, F an expert's hidden width.
Parameters as llama.cpp's GGUF stores them (our names are the GGUF names, under `blk.N.moe.`):
  ffn_gate_inp   router (E, C) [+ bias (E,), gpt-oss]
  ffn_gate_exps  (E, F, C), ffn_up_exps (E, F, C), ffn_down_exps (E, C, F) [+ biases (E, F) / (E, C)]
A quantized expert tensor is held as its (E * F, row bytes) rows (BlockQWeight on the CPU, QWeight on
CUDA: load.place_quantized); an expert's product reads only its own rows (kernels.linear.linear_rows),
so a decode step touches k experts' weights, never all E.

Routing must choose the experts transformers chooses on the same weights (tests/test_moe.py):
  "softmax" (Mixtral, Qwen3-MoE): p = softmax(logits in fp32), top-k of p (top_k: torch.topk's values,
     equal values by lower index), renormalised to sum 1 when moe_norm_topk (Mixtral always, Qwen3-MoE norm_topk_prob);
  "topk_softmax" (gpt-oss): top-k of the logits (router bias included), softmax over those k.
Each chosen expert's output is scaled by its weight and summed over experts in ascending expert
order (transformers' index_add_ loop order).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from localllm.kernels.linear import linear, linear_rows
from localllm.kernels.qweight import QWeight

from .config import ModelConfig

class ExpertLinear(nn.Module):
    """E linear maps of one shape stacked: `weight` (E, out, in) dense, or after set_quantized a
    quantized (E * out, in) `qweight` whose rows e * out .. (e + 1) * out are expert e's; bias (E, out)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.n_experts, self.out_features = n_experts, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n_experts, out_features)) if bias else None
        self.qweight: QWeight | None = None

    def set_quantized(self, qw: QWeight) -> None:
        """Replace the dense weight by a quantized (E * out, in) one (the file's rows, in expert order)."""
        e, n, k = self.weight.shape
        if tuple(qw.shape) != (e * n, k):
            raise ValueError(f"quantized weight {qw.shape} for {e} experts of ({n}, {k})")
        self.weight = None
        self.qweight = qw

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x (N, in) -> (N, out): expert `expert`'s map."""
        b = self.bias[expert] if self.bias is not None else None
        if self.qweight is None:
            return linear(x, self.weight[expert], b)
        n = self.out_features
        return linear_rows(x, self.qweight, expert * n, (expert + 1) * n, b)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) with one order for ties: larger values first, equal values by lower
    index (torch.topk leaves the order of equal values unspecified: on the CPU, zeros of 8 give 6, 5).
    The fast paths' routing follows the same rule (kernels/cpu_moe.cpp)."""
    values, idx = torch.sort(x, stable=True, dim=-1, descending=True)
    return values[..., :k], idx[..., :k]


def route(cfg: ModelConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) fp32, experts (N, k) int64), as transformers routes."""
    k = cfg.n_experts_used
    if cfg.moe_gating == "topk_softmax":  # GptOssTopKRouter
        top, experts = top_k(logits.float(), k)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits.float(), dim=-1)  # MixtralTopKRouter / Qwen3MoeTopKRouter
    top, experts = top_k(probs, k)
    if cfg.moe_norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


class MoE(nn.Module):
    """The MoE MLP of one block: (B, T, C) normed -> (B, T, C). model.Block passes its Linear (the
    router's module) and glu(cfg, gate, up) (the experts' activation): this module sits below model.py."""

    def __init__(self, cfg: ModelConfig, linear_module: Callable[..., nn.Module], glu: Callable):
        super().__init__()
        self.cfg, self.glu = cfg, glu
        E, C, F = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
        self.ffn_gate_inp = linear_module(C, E, bias=cfg.moe_bias)
        self.ffn_gate_exps = ExpertLinear(E, C, F, bias=cfg.moe_bias)
        self.ffn_up_exps = ExpertLinear(E, C, F, bias=cfg.moe_bias)
        self.ffn_down_exps = ExpertLinear(E, F, C, bias=cfg.moe_bias)
        # (gate stack then up stack as one weight, their biases or None) whose rows the two ExpertLinears
        # view, for backends that fuse them at load (backends/cuda_moe.py); None: two products
        self.fused_gate_up: tuple | None = None

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (N, C) -> this block's router logits (N, E), the product in fp32 whatever the activation
        dtype (llama.cpp keeps the router in F32: a bf16 product's rounding can flip a near tie
        between experts)."""
        r = self.ffn_gate_inp
        w = r.w if isinstance(r.w, QWeight) else r.w.float()
        return linear(h.float(), w, None if r.bias is None else r.bias.float())

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, C) -> (weights (N, k), experts (N, k)): route() on this block's router_logits."""
        return route(self.cfg, self.router_logits(h))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (n, C) -> (n, C): expert e's GLU MLP."""
        return self.ffn_down_exps(self.glu(self.cfg, self.ffn_gate_exps(x, e), self.ffn_up_exps(x, e)), e)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # Only the experts some token chose run, each on its tokens (transformers' loop, same order).
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)
            y = self.expert(e, x[tokens]).float() * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out.to(h.dtype).reshape(shape)
