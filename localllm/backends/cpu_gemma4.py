"""Gemma 4's dense layer in the CPU backend's one-call decoder (kernels/cpu_decode.cpp): what cpu.py
hands over beyond the other families' tensors (cpu_bind.cpp Decoder.gemma4).

Per layer its shape (head dim and kv heads of its kind, MLP width: double-wide on KV-shared layers,
rotated dims of its rope set), the per-layer-embedding gate / projection / norm and the layer output
scale; for the model the value norm flag and the PLE tables (per_layer_token_embd, per_layer_model_proj,
per_layer_proj_norm). KV-shared layers (no attn_k) and attention_k_eq_v layers (no attn_v) reach the
decoder as empty matrices (cpu.py model_tensors). The experts of 26B-A4B (moe_with_mlp) are not here:
such configs keep the torch forward.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import QEmbedding, Transformer
from ..rope import local_rotary_dims, rotary_dims

# The Gemma 4 fields the C++ decoder implements (cpu.py CPP_FIELDS takes them in).
GEMMA4_FIELDS = frozenset({
    "head_dim_global", "n_kv_heads_global", "attn_k_eq_v", "attn_v_norm", "rope_partial_global",
    "n_kv_shared_layers", "double_wide_mlp", "per_layer_dim", "layer_out_scale",
})
EMPTY_MAT = (torch.empty(0, 0, dtype=torch.uint8), 0, 0, 0, False)  # an absent matrix (N = 0)
EMPTY = torch.empty(0)


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int, int, int]]:
    """Per layer (head dim, kv heads, MLP width, rotated dims of its rope set) as model.py builds it
    (rope.layer_ropes: the local set on sliding layers, the global one elsewhere)."""
    return [(cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.layer_ffn_dim(i),
             local_rotary_dims(cfg) if cfg.sliding(i) else rotary_dims(cfg)) for i in range(cfg.n_layers)]


def shapes_fit(cfg: ModelConfig) -> bool:
    """Every layer's head dim a multiple of 8 (the C++ dot products), rotated dims even and within it."""
    return all(D % 8 == 0 and R % 2 == 0 and R <= D for D, _, _, R in layer_shapes(cfg))


def param_names(cfg: ModelConfig) -> set[str]:
    """The parameters gemma4_args hands over (cpu.py: a parameter nobody reads keeps the torch forward)."""
    names = {f"blk.{i}.layer_output_scale.weight" for i in range(cfg.n_layers)} if cfg.layer_out_scale else set()
    if cfg.per_layer_dim:
        names |= {f"blk.{i}.{n}.weight" for i in range(cfg.n_layers) for n in ("inp_gate", "proj", "post_norm")}
        names |= {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"}
    return names


def gemma4_args(model: Transformer, as_matrix, fp32_vector) -> tuple | None:
    """The arguments of the native Decoder.gemma4 (cpu.py's as_matrix / fp32_vector convert weights),
    or None where a weight does not fit the C++ products."""
    cfg = model.cfg
    shapes = [n for s in layer_shapes(cfg) for n in s]
    mats, vecs = [], []
    for blk in model.blk:
        ple = cfg.per_layer_dim > 0
        mats += [as_matrix(blk.inp_gate.w), as_matrix(blk.proj.w)] if ple else [EMPTY_MAT, EMPTY_MAT]
        vecs += [fp32_vector(blk.post_norm.weight if ple else None),
                 fp32_vector(blk.layer_output_scale.weight if blk.layer_output_scale is not None else None)]
    if cfg.per_layer_dim:
        if not isinstance(model.per_layer_token_embd, QEmbedding):
            return None
        mats += [as_matrix(model.per_layer_token_embd.weight), as_matrix(model.per_layer_model_proj.w)]
        vecs.append(fp32_vector(model.per_layer_proj_norm.weight))
    else:
        mats += [EMPTY_MAT, EMPTY_MAT]
        vecs.append(EMPTY)
    if any(m is None for m in mats) or any(v is None for v in vecs):
        return None
    return (shapes, *([m[i] for m in mats] for i in range(5)), vecs, cfg.attn_v_norm, cfg.per_layer_dim)
