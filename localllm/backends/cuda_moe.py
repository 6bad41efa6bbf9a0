"""The mixture-of-experts MLP inside the decode step's CUDA graph (backends/cuda_graph.GraphDecoder):
routing on the device and the chosen experts' products reading their ids from device memory
(kernels/triton_moe.py), so a step has no host sync and reads only the k chosen experts' rows.

For the step's R token rows (S = R k slots), per MoE layer (reference: localllm/moe.py MoE.forward):
  h      = RMSNorm(x) in fp32                            (rmsnorm_rows with the norm weight in fp32)
  logits = router(h) + bias, fp32 (R, E)                  (the router as "expert 0" of a (1, E, C)
                                                           weight, in fp32: a batch-invariant product, so a verify
                                                           pass routes each row as a one-token step; fp32
                                                           as llama.cpp keeps it)
  weights, ids = moe.route(cfg, logits), each row's slots sorted by expert id (MoE.forward sums
                                                           experts in ascending order): triton_moe.route_rows
  gate, up += W_gate|up[ids] @ h (+ biases)               (int64 fixed-point sums; int8 h for integer-dot types)
  a      = glu(cfg, gate, up) in the activation dtype     (triton_moe.expert_glu; quantized for int-dot down)
  down  += W_down[ids] @ a (+ bias)                       (one input row per slot)
  x     += round(sum_j weights[j] round(down[j]))         (triton_moe.combine)
The routing is one small kernel (no .item(), no host sync). Expert
tensors of a type without a Triton kernel gather their chosen rows and decode them with the torch
reference (slow, but inside the graph too).
"""

from __future__ import annotations

import torch

from localllm.kernels.qweight import INT_DOT_TYPES, QWeight
from localllm.kernels.triton_epilogue import to_fixed
from localllm.kernels.triton_moe import combine, expert_glu, expert_products, route_rows
from localllm.kernels.triton_prefill import rmsnorm_rows
from localllm.kernels.triton_quant_act import quantize_act
from localllm.quantize import dequantize_torch



def int_dot(w) -> bool:
    return isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES and w.blocks


def expert_weight(m) -> QWeight | torch.Tensor:
    """An ExpertLinear's stack: its QWeight (E N, K) or dense (E, N, K) weight."""
    return m.qweight if m.qweight is not None else m.weight.detach()


def gathered_products(x: torch.Tensor, w: QWeight, ids: torch.Tensor, out: torch.Tensor, n_used: int,
                      bias: torch.Tensor | None, per_slot: bool) -> None:
    """expert_products for a QWeight without a Triton kernel (raw rows): the chosen experts' rows
    gathered by index (device ids), decoded by the torch reference, one batched product."""
    n = out.shape[1]
    slots = ids.numel()
    rows = (ids.view(-1, 1) * n + torch.arange(n, device=ids.device)).view(-1)
    dense = dequantize_torch(w.parts["raw"].index_select(0, rows), w.qtype).view(slots, n, -1)
    xs = x.float() if per_slot else x.float().repeat_interleave(n_used, 0)
    y = torch.bmm(dense, xs.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        y = y + bias.float().index_select(0, ids.view(-1))
    out.add_(to_fixed(y))


def fuse_experts(moe) -> None:
    """Stack the gate and up expert stacks into one weight (gate's E N rows, then up's) and their biases,
    the two ExpertLinears holding row views of it (no second copy): MoE.fused_gate_up, one launch for
    both products. Left apart when their kinds or types differ."""
    g, u = moe.ffn_gate_exps, moe.ffn_up_exps
    wg, wu = expert_weight(g), expert_weight(u)
    e = g.n_experts
    if (isinstance(wg, QWeight) and isinstance(wu, QWeight) and wg.qtype == wu.qtype and wg.blocks == wu.blocks
            and wg.shape == wu.shape and wg.has_kernel):
        fused = QWeight.cat([wg, wu])
        rows = wg.shape[0]
        g.qweight, u.qweight = fused.rows(0, rows), fused.rows(rows, 2 * rows)
    elif isinstance(wg, torch.Tensor) and isinstance(wu, torch.Tensor) and wg.dtype == wu.dtype and wg.shape == wu.shape:
        fused = torch.cat([wg, wu])  # (2 E, N, K)
        g.weight = torch.nn.Parameter(fused[:e], requires_grad=False)
        u.weight = torch.nn.Parameter(fused[e:], requires_grad=False)
    else:
        return
    bias = None
    if g.bias is not None:
        bias = torch.cat([g.bias.detach(), u.bias.detach()])  # (2 E, N)
        g.bias = torch.nn.Parameter(bias[:e], requires_grad=False)
        u.bias = torch.nn.Parameter(bias[e:], requires_grad=False)
    moe.fused_gate_up = (fused, bias)


class MoEDecode:
    """The MoE layers' buffers and weights for a decoder of `rows` token rows."""

    def __init__(self, model, rows: int, act: torch.dtype):
        cfg = model.cfg
        self.cfg, self.rows, self.act = cfg, rows, act
        self.k = k = cfg.n_experts_used
        dev = model.token_embd.weight.device
        C, F, E = cfg.dim, cfg.expert_ffn_dim, cfg.n_experts
        # int64 fixed-point sums, each cleared by the kernel that reads it (expert_glu, combine)
        # gate | up sums: (S, 2F), gate's in columns [0, F), up's in [F, 2F)
        self.gate_up = torch.zeros(rows * k, 2 * F, dtype=torch.int64, device=dev)
        self.gate, self.up = self.gate_up[:, :F], self.gate_up[:, F:]
        self.down = torch.zeros(rows * k, C, dtype=torch.int64, device=dev)
        self.logits = torch.empty(rows, E, dtype=torch.float32, device=dev)
        self.zero_ids = torch.zeros(rows, dtype=torch.int32, device=dev)
        # id(moe) -> (router (1, E, C) as held (the kernel multiplies in fp32; a quantized one decoded to
        # fp32 once), bias (1, E) or None, the norm weight in fp32 (an fp32 h for the router))
        self.routers = {}
        for blk in model.blk:
            if blk.moe is not None:
                r = blk.moe.ffn_gate_inp
                w = r.w
                if isinstance(w, QWeight):
                    from localllm.kernels.linear import dequantize_qweight

                    w = dequantize_qweight(w, torch.float32)
                bias = r.bias.detach().view(1, E).contiguous() if r.bias is not None else None
                self.routers[id(blk.moe)] = (w.detach().view(1, E, C).contiguous(), bias,
                                             blk.ffn_norm.weight.detach().float().contiguous())

    def _products(self, x, xq, m, ids, out, per_slot: bool) -> None:
        w = expert_weight(m)
        bias = m.bias.detach() if m.bias is not None else None
        if isinstance(w, QWeight) and not w.has_kernel:
            gathered_products(x, w, ids, out, self.k, bias, per_slot)
        elif int_dot(w):
            expert_products(xq, w, ids, out, self.k, bias=bias, per_slot=per_slot)
        else:
            expert_products(x, w, ids, out, self.k, bias=bias, per_slot=per_slot)

    def ffn(self, x: torch.Tensor, blk) -> torch.Tensor:
        """x (R, C) int64 fixed-point residual += the layer's MoE MLP of RMSNorm(x) (module doc)."""
        cfg, moe = self.cfg, blk.moe
        router, router_bias, norm_w = self.routers[id(moe)]
        h = rmsnorm_rows(x, norm_w, cfg.norm_eps)  # (R, C) fp32
        logits = expert_products(h, router, self.zero_ids, self.logits, 1, bias=router_bias)
        # moe.route's experts, each row's slots in ascending expert order (MoE.forward's sum order)
        weights, experts = route_rows(logits, self.k, cfg.moe_gating, cfg.moe_norm_topk)
        ids = experts.view(-1)
        gw, uw, dw = (expert_weight(m) for m in (moe.ffn_gate_exps, moe.ffn_up_exps, moe.ffn_down_exps))
        hq = quantize_act(h) if int_dot(gw) or int_dot(uw) else None
        if moe.fused_gate_up is not None and not (isinstance(gw, QWeight) and not gw.has_kernel):
            w, bias = moe.fused_gate_up  # one launch: gate's rows, then up's
            expert_products(hq if int_dot(gw) else h, w, ids, self.gate_up, self.k, bias=bias, stacks=2)
        else:
            self._products(h, hq, moe.ffn_gate_exps, ids, self.gate, False)
            self._products(h, hq, moe.ffn_up_exps, ids, self.up, False)
        quant = int_dot(dw)
        a = expert_glu(self.gate, self.up, self.act, oai=cfg.activation == "swiglu_oai", limit=cfg.swiglu_limit,
                       quantize=quant)
        self._products(None if quant else a, a if quant else None, moe.ffn_down_exps, ids, self.down, True)
        return combine(self.down, weights, x, self.act)
