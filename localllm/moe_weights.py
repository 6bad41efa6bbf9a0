"""Mixture-of-experts tensors of Hugging Face checkpoints -> our (GGUF-named) stacked expert tensors.

Real checkpoints and transformers 5's save_pretrained store (checked against 5.24, which merges them
only in memory):
  Mixtral    model.layers.N.block_sparse_moe.gate.weight (E, C);
             ...block_sparse_moe.experts.e.w1 / w3 / w2 .weight: expert e's gate (F, C) / up / down (C, F)
  Qwen3-MoE  model.layers.N.mlp.gate.weight (E, C); ...mlp.experts.e.gate_proj / up_proj / down_proj .weight
  gpt-oss    model.layers.N.mlp.router.weight (E, C) / .bias (E,); stacked and transposed (x @ W):
             mlp.experts.gate_up_proj (E, C, 2F), its gate and up columns interleaved (gate 0::2, up
             1::2, transformers' GptOssExperts), gate_up_proj_bias (E, 2F); down_proj (E, F, C), down_proj_bias (E, C)
GGUF (llama.cpp's converter) stacks them as ffn_gate_exps / ffn_up_exps (E, F, C), ffn_down_exps
(E, C, F), splitting gpt-oss's interleaved gate/up the same way; the names below are those gguf's
TensorNameMap gives (tests/test_moe.py checks). A part is one checkpoint key's share of a tensor:
`expert` (row e of the stack), `t` (transposed), `even_t` / `odd_t` (interleaved columns, transposed),
`even` / `odd` (interleaved bias columns), `` (as stored); `mxfp4*`: a released gpt-oss file's MXFP4
blocks or scales (localllm/moe_mxfp4.py pairs them: a source of two parts, read as GGUF MXFP4 rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LocalLLMError
from .moe_mxfp4 import assemble_mxfp4, is_mxfp4, is_mxfp4_how
from .tensor_names import legacy_expert, merge_legacy_shapes  # noqa: F401 (moved there, re-exported)

# checkpoint key pattern ({i} layer, {e} expert) -> [(GGUF name, how)]
HF_MOE_NAMES: dict[str, list[tuple[str, str]]] = {
    "model.layers.{i}.block_sparse_moe.gate.weight": [("blk.{i}.ffn_gate_inp.weight", "")],
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": [("blk.{i}.ffn_gate_exps.weight", "expert")],
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": [("blk.{i}.ffn_up_exps.weight", "expert")],
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": [("blk.{i}.ffn_down_exps.weight", "expert")],
    "model.layers.{i}.mlp.gate.weight": [("blk.{i}.ffn_gate_inp.weight", "")],
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": [("blk.{i}.ffn_gate_exps.weight", "expert")],
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": [("blk.{i}.ffn_up_exps.weight", "expert")],
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": [("blk.{i}.ffn_down_exps.weight", "expert")],
    "model.layers.{i}.mlp.router.weight": [("blk.{i}.ffn_gate_inp.weight", "")],
    "model.layers.{i}.mlp.router.bias": [("blk.{i}.ffn_gate_inp.bias", "")],
    "model.layers.{i}.mlp.experts.gate_up_proj": [("blk.{i}.ffn_gate_exps.weight", "even_t"),
                                                  ("blk.{i}.ffn_up_exps.weight", "odd_t")],
    "model.layers.{i}.mlp.experts.gate_up_proj_bias": [("blk.{i}.ffn_gate_exps.bias", "even"),
                                                       ("blk.{i}.ffn_up_exps.bias", "odd")],
    "model.layers.{i}.mlp.experts.down_proj": [("blk.{i}.ffn_down_exps.weight", "t")],
    "model.layers.{i}.mlp.experts.down_proj_bias": [("blk.{i}.ffn_down_exps.bias", "")],
    # the released gpt-oss files: MXFP4 experts, (E, rows, C/32, 16) codes and (E, rows, C/32) scales,
    # rows interleaved gate/up as above (localllm/moe_mxfp4.py)
    "model.layers.{i}.mlp.experts.gate_up_proj_blocks": [("blk.{i}.ffn_gate_exps.weight", "mxfp4_even"),
                                                         ("blk.{i}.ffn_up_exps.weight", "mxfp4_odd")],
    "model.layers.{i}.mlp.experts.gate_up_proj_scales": [("blk.{i}.ffn_gate_exps.weight", "mxfp4_scales_even"),
                                                         ("blk.{i}.ffn_up_exps.weight", "mxfp4_scales_odd")],
    "model.layers.{i}.mlp.experts.down_proj_blocks": [("blk.{i}.ffn_down_exps.weight", "mxfp4")],
    "model.layers.{i}.mlp.experts.down_proj_scales": [("blk.{i}.ffn_down_exps.weight", "mxfp4_scales")],
    # gpt-oss's attention extras (weights.HF_NAMES has the rest of its layer)
    "model.layers.{i}.self_attn.sinks": [("blk.{i}.attn_sinks.weight", "")],
    "model.layers.{i}.self_attn.o_proj.bias": [("blk.{i}.attn_output.bias", "")],
}
_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$"),
              v) for k, v in HF_MOE_NAMES.items()]


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's share of one of our tensors."""

    name: str  # GGUF name
    how: str  # see the module docstring
    expert: int  # for `expert`; else -1
    path: Path
    key: str
    shape: tuple[int, ...]  # as stored
    dtype: str  # safetensors' name


@dataclass(frozen=True)
class MoESource:
    """Where one of our expert tensors comes from: its parts (experts in order, or one part)."""

    parts: tuple[Part, ...]


def _part_shape(how: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Our tensor's shape from a part's stored shape (an expert's: the stack's row), None if it cannot be."""
    if how in ("", "expert"):
        return shape
    if how == "t":
        return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else None
    if shape[-1] % 2:
        return None
    half = (*shape[:-1], shape[-1] // 2)
    if how in ("even", "odd"):
        return half
    return (*half[:-2], half[-1], half[-2]) if len(half) >= 2 else None  # even_t / odd_t


def hf_moe_parts(path: Path, key: str, shape: tuple[int, ...], dtype: str = "") -> list[Part] | None:
    """A checkpoint key's parts, None when it is no MoE tensor."""
    for pattern, targets in _PATTERNS:
        m = pattern.match(key)
        if m:
            e = int(m.group("e")) if "e" in pattern.groupindex else -1
            return [Part(name.replace("{i}", m.group("i")), how, e, path, key, shape, dtype) for name, how in targets]
    return None


def assemble(parts: list[Part], folder_name: str) -> dict[str, tuple[MoESource, tuple[int, ...]]]:
    """All MoE parts of a folder -> GGUF name -> (source, our shape), checked: each expert once, the
    experts numbered 0..E-1, of one shape; an interleaved or transposed tensor of a shape that splits."""
    by_name: dict[str, list[Part]] = {}
    for p in parts:
        by_name.setdefault(p.name, []).append(p)
    out = {}
    for name, ps in by_name.items():
        if is_mxfp4_how(ps[0].how):  # a blocks part and its scales
            pair, shape = assemble_mxfp4(ps, folder_name)
            out[name] = (MoESource(pair), shape)
            continue
        if ps[0].how != "expert":
            if len(ps) > 1:
                raise LocalLLMError(f"tensor {ps[1].key!r} appears twice in {folder_name}")
            shape = _part_shape(ps[0].how, ps[0].shape)
            if shape is None:
                raise LocalLLMError(f"tensor {ps[0].key!r} in {folder_name} has shape {ps[0].shape}, which"
                                    " does not split into interleaved gate and up columns")
            out[name] = (MoESource(tuple(ps)), shape)
            continue
        ps = sorted(ps, key=lambda p: p.expert)
        for e, p in enumerate(ps):
            if p.expert != e:
                what = "appears twice" if p.expert < e else f"follows expert {e - 1}: expert {e} is missing"
                raise LocalLLMError(f"tensor {p.key!r} in {folder_name} {what}")
            if p.shape != ps[0].shape:
                raise LocalLLMError(f"tensor {p.key!r} in {folder_name} has shape {p.shape}, expert 0's {ps[0].shape}")
        out[name] = (MoESource(tuple(ps)), (len(ps), *ps[0].shape))
    return out


def read_part(f, p: Part) -> torch.Tensor:
    """One part's values (f: the safetensors file of p.path, open), as our tensor (or its expert row)."""
    t = f.get_tensor(p.key)
    if p.how in ("even", "even_t"):
        t = t[..., 0::2]
    elif p.how in ("odd", "odd_t"):
        t = t[..., 1::2]
    if p.how in ("t", "even_t", "odd_t"):
        t = t.transpose(-1, -2)
    return t.contiguous().clone()


def read_moe(source: MoESource) -> torch.Tensor:
    """Our tensor from its parts (experts stacked in order); not for MXFP4 sources (moe_mxfp4.read_mxfp4)."""
    if is_mxfp4(source.parts):
        raise ValueError("an MXFP4 source is read by moe_mxfp4.read_mxfp4")
    from safetensors import SafetensorError, safe_open

    values: dict[int, torch.Tensor] = {}
    for path in dict.fromkeys(p.path for p in source.parts):  # each shard opened once (128 experts x 3)
        try:
            with safe_open(str(path), framework="pt") as f:
                values |= {i: read_part(f, p) for i, p in enumerate(source.parts) if p.path == path}
        except (SafetensorError, OSError) as e:
            raise LocalLLMError(f"cannot read tensor {source.parts[0].key!r} and its experts from {path}: {e}") from None
    if source.parts[0].how != "expert":
        return values[0]
    return torch.stack([values[i] for i in range(len(source.parts))])


# ---- GGUF: the old one-tensor-per-expert layout (early Mixtral files: blk.N.ffn_gate.E.weight, ...)

# legacy_expert, merge_legacy_shapes: localllm/tensor_names.py (torch-free, for check_gguf)
