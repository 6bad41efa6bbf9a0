"""The mixture-of-experts MLP of a prompt on CUDA (CUDA_OPS.moe): routing on the device and one
grouped product a projection (kernels/triton_moe_gemm.py), a fixed number of launches a layer and no
host sync, so CudaRuntime's PrefillGraph captures MoE prompts as it does dense ones.

For the prompt's T token rows (S = T k slots), per MoE layer (reference: localllm/moe.py MoE.forward):
  logits = MoE.router_logits(h), fp32 (T, E)              (the router's product in fp32, as MoE.route)
  weights, ids = triton_moe.route_rows(logits)            (moe.route's choice, each row's experts ascending)
  gate|up = W_gate|up[ids] @ h (+ biases), act dtype      (gate's columns [0, F), up's [F, 2F); one launch
                                                           when MoE.fused_gate_up stacks them)
  a      = model.glu(cfg, gate, up)                       (the reference op itself)
  down   = W_down[ids] @ a (+ bias), act dtype            (one input row per slot)
  out    = round(sum_j weights[j] down[j]) in expert order (triton_moe_gemm.combine_rows)
The products, by the number of slots:
  many (> GEMV_SLOTS_PER_EXPERT E): the slots grouped by expert on the device (align_slots), the
      layer's expert stack decoded to the activation dtype once (kernels.linear.dequantize_qweight:
      Triton decoders; a dense stack as it is), then triton_moe_gemm.grouped_products (tensor cores);
  few (a short prompt: a chat turn's first tokens): triton_moe.expert_products, the decode step's
      kernels reading only the chosen experts' quantized rows (fp32 outputs; x quantized to int8 for
      the integer-dot types, as the decode step does), then rounded to the activation dtype.
Each product is rounded once to the activation dtype, as the eager per-expert F.linear rounds it.
"""

from __future__ import annotations

import torch

from localllm.kernels.linear import dequantize_qweight
from localllm.kernels.qweight import QWeight
from localllm.kernels.triton_moe import expert_products, route_rows
from localllm.kernels.triton_moe_gemm import align_slots, block_m, combine_rows, grouped_products
from localllm.kernels.triton_quant_act import quantize_act

from .cuda_moe import expert_weight, int_dot

# At most this many slots an expert take the decode kernels (each slot reads its expert's quantized
# rows); more decode the whole stack once and run the grouped GEMM (which reads all E experts).
GEMV_SLOTS_PER_EXPERT = 4


def dense_stack(w: QWeight | torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An expert stack (stacks E N, K) QWeight or dense (stacks E, N, K) -> dense (stacks E, N, K) of dtype."""
    if isinstance(w, QWeight):
        w = dequantize_qweight(w, dtype)
    return w.to(dtype).reshape(-1, n, w.shape[-1]).contiguous()


def grouped(x: torch.Tensor, w, bias, n: int, groups: tuple, k: int, per_slot: bool, stacks: int) -> torch.Tensor:
    """(S, stacks n) products of the slots grouped by align_slots (groups: (slots, block_expert, BM))."""
    slots, block_expert, bm = groups
    out = torch.empty((_rows(x, k, per_slot), stacks * n), dtype=x.dtype, device=x.device)
    return grouped_products(x, dense_stack(w, n, x.dtype), slots, block_expert, out, k, bm, bias=bias,
                            per_slot=per_slot, stacks=stacks)


def _rows(x: torch.Tensor, k: int, per_slot: bool) -> int:
    return x.shape[0] if per_slot else x.shape[0] * k


def gathered(x: torch.Tensor, w, bias, n: int, ids: torch.Tensor, k: int, per_slot: bool, stacks: int) -> torch.Tensor:
    """(S, stacks n) products by the decode step's kernels (fp32 outputs, rounded to x's dtype)."""
    out = torch.empty((_rows(x, k, per_slot), stacks * n), dtype=torch.float32, device=x.device)
    expert_products(quantize_act(x) if int_dot(w) else x, w, ids, out, k, bias=bias, per_slot=per_slot,
                    stacks=stacks)
    return out.to(x.dtype)


def few_slots(moe, slots: int) -> bool:
    """The prompt's `slots` take the decode kernels (module doc): few, and every stack has a kernel."""
    ws = [expert_weight(m) for m in (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)]
    return (slots <= GEMV_SLOTS_PER_EXPERT * moe.cfg.n_experts
            and all(not isinstance(w, QWeight) or w.has_kernel for w in ws))


def moe_prefill(moe, h: torch.Tensor) -> torch.Tensor:
    """h (B, T, C) normed -> the MoE MLP (B, T, C) in h's dtype (module doc): model.moe_mlp's math."""
    cfg = moe.cfg
    shape = h.shape
    x = h.reshape(-1, shape[-1]).contiguous()
    k, e, f = cfg.n_experts_used, cfg.n_experts, cfg.expert_ffn_dim
    slots = x.shape[0] * k
    weights, experts = route_rows(moe.router_logits(x).contiguous(), k, cfg.moe_gating, cfg.moe_norm_topk)
    ids = experts.view(-1)
    mods = (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps)
    ws = [expert_weight(m) for m in mods]
    if few_slots(moe, slots):
        def products(xin, w, bias, n, per_slot, stacks=1):
            return gathered(xin, w, bias, n, ids, k, per_slot, stacks)
    else:
        bm = block_m(slots, e)
        groups = (*align_slots(ids, e, bm), bm)

        def products(xin, w, bias, n, per_slot, stacks=1):
            return grouped(xin, w, bias, n, groups, k, per_slot, stacks)

    def bias_of(m):
        return m.bias.detach() if m.bias is not None else None

    if moe.fused_gate_up is not None:  # gate's stack then up's: one product
        w, bias = moe.fused_gate_up
        gu = products(x, w, bias, f, False, stacks=2)
        gate, up = gu[:, :f], gu[:, f:]
    else:
        gate = products(x, ws[0], bias_of(mods[0]), f, False)
        up = products(x, ws[1], bias_of(mods[1]), f, False)
    a = moe.glu(cfg, gate, up).contiguous()
    down = products(a, ws[2], bias_of(mods[2]), cfg.dim, True)
    return combine_rows(down, weights, h.dtype).view(shape)
