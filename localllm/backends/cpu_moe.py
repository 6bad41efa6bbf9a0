"""The mixture-of-experts layers (localllm/moe.py: Mixtral, Qwen3-MoE, gpt-oss) handed to the C++
decoder (kernels/cpu_moe.{h,cpp}): per MoE layer its router, the stacked (E * F, C) / (E * C, F)
expert tensors as the products read them (one expert's product reads only its rows), their biases
and the routing ints, in the order cpu_bind.cpp's Decoder.add_moe takes them.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import Transformer

# The ModelConfig fields of the MoE families the C++ decoder runs (backends/cpu.py CPP_FIELDS).
MOE_FIELDS = frozenset({"n_experts", "n_experts_used", "expert_ffn_dim", "moe_norm_topk", "moe_bias", "moe_gating",
                        "swiglu_limit"})
GATINGS = {"softmax": 0, "topk_softmax": 1}  # ModelConfig.moe_gating -> lq::Gating
EXPERT_ACTS = {"silu": 0, "swiglu_oai": 1}  # ModelConfig.activation -> lq::ExpertAct
MAX_USED = 256  # experts a token uses (cpu_moe.cpp's fixed arrays)
PARTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# The dense MLP's slot of an MoE layer in the Decoder's per-layer matrices: never read.
NO_MATRIX = (torch.empty(0, 0, dtype=torch.uint8), 0, 0, 0, False)


def moe_covers(cfg: ModelConfig) -> bool:
    """The MoE fields of cfg are ones the C++ decoder runs (a dense model: trivially)."""
    if not cfg.n_experts:
        return True
    return (not cfg.moe_with_mlp and cfg.moe_gating in GATINGS and cfg.activation in EXPERT_ACTS
            and 0 < cfg.n_experts_used <= min(MAX_USED, cfg.n_experts))


def parameter_names(model: Transformer) -> set[str]:
    """The MoE parameters the decoder reads (routers and experts, their biases)."""
    names = set()
    for i, blk in enumerate(model.blk):
        if getattr(blk, "moe", None) is not None:
            names |= {f"blk.{i}.moe.{p}.{kind}" for p in PARTS for kind in ("weight", "bias")}
    return names


def expert_weight(lin) -> torch.Tensor | object:
    """A stacked expert map's weight as (E * out, in): its quantized rows, or the dense (E, out, in) flattened."""
    if lin.qweight is not None:
        return lin.qweight
    return lin.weight.detach().reshape(-1, lin.weight.shape[-1])


def fits_tiles(matrix: tuple, rows: int) -> bool:
    """An expert's rows start on an 8-row tile of a tiled weight (rows: one expert's row count)."""
    return not matrix[4] or rows % 8 == 0


def moe_layers(model: Transformer, as_matrix, fp32_vector) -> list[tuple] | None:
    """Per MoE layer (layer, mats, vecs, ints, limit) for Decoder.add_moe; None where a weight does not
    fit the C++ products. as_matrix / fp32_vector: backends/cpu.py's (a weight's C++ arguments)."""
    cfg, out = model.cfg, []
    for i, blk in enumerate(model.blk):
        moe = getattr(blk, "moe", None)
        if moe is None:
            continue
        router = moe.ffn_gate_inp
        mats = [as_matrix(router.w)] + [as_matrix(expert_weight(getattr(moe, p))) for p in PARTS[1:]]
        vecs = [fp32_vector(router.bias)] + [fp32_vector(getattr(moe, p).bias) for p in PARTS[1:]]
        if any(m is None for m in mats) or any(v is None for v in vecs):
            return None
        F = cfg.expert_ffn_dim
        if not (fits_tiles(mats[1], F) and fits_tiles(mats[2], F) and fits_tiles(mats[3], cfg.dim)) or F % 32:
            return None
        ints = [cfg.n_experts, cfg.n_experts_used, F, GATINGS[cfg.moe_gating], int(cfg.moe_norm_topk),
                EXPERT_ACTS[cfg.activation]]
        out.append((i, mats, vecs, ints, float(cfg.swiglu_limit or 0.0)))
    return out


def add_moe_layers(native, layers: list[tuple]) -> None:
    """Hands each MoE layer to the C++ Decoder `native`."""
    for i, mats, vecs, ints, limit in layers:
        native.add_moe(i, *([m[j] for m in mats] for j in range(5)), vecs, ints, limit)
