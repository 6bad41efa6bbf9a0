"""llama-quantize's presets (`--type Q4_K_M`, ...) and its per-tensor type rules, as data.

Reference: llama.cpp src/llama-quant.cpp. A preset is a `general.file_type` (LLAMA_FTYPE_*) with a
default tensor type (llama_ftype_get_default_type); llama_tensor_get_type then changes the type of
some tensors by name, layer and model shape. This module carries those rules for the presets below
and the architectures localllm runs (llama, mistral, qwen2, qwen3, and the mixture-of-experts Mixtral,
Qwen3-MoE, gpt-oss). Not carried, because no model we run reaches them: the Falcon branches and the IQ*
presets other than IQ4_NL and IQ4_XS. MXFP4_MOE (gpt-oss's file type) has its own rule: expert tensors MXFP4, all else Q8_0
(mxfp4_moe_type).

What the rules do, for our presets:
- 1-D tensors, norms and a few others are never quantized (`allows_quantization`): they keep their
  stored type (F32 for everything a converter writes).
- output.weight, or token_embd.weight when there is no output.weight (tied embeddings, quantized
  "as the output"): Q6_K, or Q8_0 when its rows do not split into blocks of the preset's default
  type; a Q8_0 preset keeps Q8_0. Float presets (F32/F16/BF16) apply no rule at all.
- attn_v (and fused attn_qkv): more bits in the first layers / every third layer (`more_bits`) for
  Q4_K_M and Q5_K_M, the first layers for Q4_K_S and Q3_K_M, by GQA for Q2_K; Q5_K for Q3_K/Q4_K
  choices in a Llama 70B (80 layers, GQA).
- ffn_down: `more_bits` layers get Q6_K in Q4_K_M/Q5_K_M; the first eighth Q5_K in Q4_K_S; Q3_K_M
  uses Q5_K / Q4_K; Q2_K uses Q3_K. With an imatrix, Q4_0/Q5_0 give the first eighth Q4_1/Q5_1.
- attn_output: Q3_K in Q2_K, Q4_K in Q3_K_M.
- IQ4_NL / IQ4_XS: attn_v (attn_qkv) Q5_K when GQA >= 4; without an imatrix the first eighth of
  ffn_down Q5_K.
- attn_q / attn_k: llama.cpp only changes them for IQ3 presets and 8-expert models (below).
- mixture of experts (ModelShape.n_expert): the router (ffn_gate_inp) and every bias are never quantized;
  3-D expert tensors (ffn_gate/up/down_exps) take the rules of their category, ffn_down's layer read from
  its name (llama.cpp's layer_info: experts are not one tensor a layer in every file). 8-expert models
  (Mixtral): attn_v and attn_k Q8_0 ("trades just ~128MB"), attn_output Q5_K in Q2_K, Q3_K_M, Q4_K_S
  and Q4_K_M (in place of the rules above).

Rows that do not split into blocks of the chosen type (llama.cpp's tensor_type_fallback) take the
type of FALLBACK, as current llama.cpp does: Q2_K/Q3_K -> Q4_0 (older llama.cpp used IQ4_NL),
Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; F16 when even that type's 32-value
blocks do not fit. (llama.cpp has no fallback for the 32-value types and aborts; we use F16 there too.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import gguf

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

FLOAT_TYPES = frozenset((Q.F32, Q.F16, Q.BF16))


@dataclass(frozen=True)
class Preset:
    name: str
    file_type: gguf.LlamaFileType  # written as general.file_type
    default: Q  # llama_ftype_get_default_type

    @property
    def quantized(self) -> bool:
        return self.default not in FLOAT_TYPES


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("F32", FT.ALL_F32, Q.F32),
    Preset("F16", FT.MOSTLY_F16, Q.F16),
    Preset("BF16", FT.MOSTLY_BF16, Q.BF16),
    Preset("Q8_0", FT.MOSTLY_Q8_0, Q.Q8_0),
    Preset("Q6_K", FT.MOSTLY_Q6_K, Q.Q6_K),
    Preset("Q5_K_M", FT.MOSTLY_Q5_K_M, Q.Q5_K),
    Preset("Q5_K_S", FT.MOSTLY_Q5_K_S, Q.Q5_K),
    Preset("Q5_1", FT.MOSTLY_Q5_1, Q.Q5_1),
    Preset("Q5_0", FT.MOSTLY_Q5_0, Q.Q5_0),
    Preset("Q4_K_M", FT.MOSTLY_Q4_K_M, Q.Q4_K),
    Preset("Q4_K_S", FT.MOSTLY_Q4_K_S, Q.Q4_K),
    Preset("Q4_1", FT.MOSTLY_Q4_1, Q.Q4_1),
    Preset("Q4_0", FT.MOSTLY_Q4_0, Q.Q4_0),
    Preset("Q3_K_M", FT.MOSTLY_Q3_K_M, Q.Q3_K),
    Preset("Q2_K", FT.MOSTLY_Q2_K, Q.Q2_K),
    Preset("IQ4_NL", FT.MOSTLY_IQ4_NL, Q.IQ4_NL),
    Preset("IQ4_XS", FT.MOSTLY_IQ4_XS, Q.IQ4_XS),
    Preset("MXFP4_MOE", FT.MOSTLY_MXFP4_MOE, Q.MXFP4),  # rule: mxfp4_moe_type
)}

# tensor_type_fallback: the type used when a row does not split into blocks of the chosen one.
FALLBACK: dict[Q, Q] = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
                        Q.IQ4_XS: Q.IQ4_NL}
LAST_RESORT = Q.F16


# Other names of a preset: MXFP4 is the only type MXFP4_MOE introduces.
ALIASES = {"MXFP4": "MXFP4_MOE"}


def find_preset(name: str) -> Preset | None:
    """Case-insensitive, as llama-quantize reads its type argument."""
    name = name.upper()
    return PRESETS.get(ALIASES.get(name, name))


# ---- tensor categories (tensor_get_category): broad roles found by name

OUTPUT, TOKEN_EMBD, ATTN_QKV, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = (
    "output", "token_embd", "attn_qkv", "attn_v", "attn_k", "attn_q", "attn_output")
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = "ffn_up", "ffn_gate", "ffn_down", "other"

# (category, substring of the name), tried in llama.cpp's order; exact names first.
_EXACT = {"output.weight": OUTPUT, "token_embd.weight": TOKEN_EMBD}
_SUBSTRINGS = (
    (ATTN_QKV, "attn_qkv.weight"), (ATTN_V, "attn_v.weight"), (ATTN_K, "attn_k.weight"),
    (ATTN_Q, "attn_q.weight"), (ATTN_OUTPUT, "attn_output.weight"),
    (FFN_UP, "ffn_up"), (FFN_GATE, "ffn_gate"), (FFN_DOWN, "ffn_down"),
)


def category(name: str) -> str:
    if name in _EXACT:
        return _EXACT[name]
    return next((cat for cat, part in _SUBSTRINGS if part in name), OTHER)


# tensor_allows_quantization: name parts that are never quantized (those our architectures can have).
NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight")


def allows_quantization(name: str, n_dims: int) -> bool:
    return n_dims >= 2 and name.endswith("weight") and not any(p in name for p in NEVER_QUANTIZED)


def layer_of(name: str) -> int:
    """blk.N.* -> N; -1 for tensors outside the blocks."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


# ---- the rules

@dataclass(frozen=True)
class ModelShape:
    """What the rules read about the model."""

    arch: str  # GGUF architecture
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_expert: int = 0  # experts of a mixture-of-experts model (llama.cpp's hparams.n_expert)

    @property
    def n_gqa(self) -> int:
        return self.n_heads // max(1, self.n_kv_heads)

    @property
    def is_70b(self) -> bool:
        # llama.cpp's LLM_TYPE_70B test for quantization (llama_quant_model_from_metadata)
        return self.arch == "llama" and self.n_layers == 80 and self.n_heads != self.n_kv_heads


@dataclass(frozen=True)
class Slot:
    """One tensor as a rule sees it: its index among the tensors of its category (llama.cpp's
    i_attention_wv / i_ffn_down counters, in its order: by layer, then name) and their number."""

    i: int
    n: int
    model: ModelShape
    imatrix: bool


Rule = Callable[[Slot], "Q | None"]  # None: the preset's default type


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def const(t: Q) -> Rule:
    return lambda s: t


def if_more_bits(t: Q) -> Rule:
    return lambda s: t if more_bits(s.i, s.n) else None


# preset -> category -> rule (llama_tensor_get_type_impl, non-Falcon, no experts).
RULES: dict[str, dict[str, Rule]] = {
    "Q2_K": {
        ATTN_V: lambda s: Q.Q4_K if s.model.n_gqa >= 4 else Q.Q3_K,
        FFN_DOWN: const(Q.Q3_K),
        ATTN_OUTPUT: const(Q.Q3_K),
    },
    "Q3_K_M": {
        ATTN_V: lambda s: Q.Q5_K if s.i < 2 else Q.Q4_K,
        FFN_DOWN: lambda s: Q.Q5_K if s.i < s.n // 16 else Q.Q4_K,
        ATTN_OUTPUT: const(Q.Q4_K),
        ATTN_QKV: const(Q.Q4_K),
    },
    "Q4_K_S": {
        ATTN_V: lambda s: Q.Q5_K if s.i < 4 else None,
        FFN_DOWN: lambda s: Q.Q5_K if s.i < s.n // 8 else None,
    },
    "Q4_K_M": {ATTN_V: if_more_bits(Q.Q6_K), FFN_DOWN: if_more_bits(Q.Q6_K), ATTN_QKV: const(Q.Q5_K)},
    "Q5_K_M": {ATTN_V: if_more_bits(Q.Q6_K), FFN_DOWN: if_more_bits(Q.Q6_K), ATTN_QKV: const(Q.Q6_K)},
    "Q4_0": {FFN_DOWN: lambda s: Q.Q4_1 if s.imatrix and s.i < s.n // 8 else None},
    "Q5_0": {FFN_DOWN: lambda s: Q.Q5_1 if s.imatrix and s.i < s.n // 8 else None},
    # attn_v (and attn_qkv, which current llama.cpp routes through the attn_v branch) Q5_K at GQA >= 4;
    # without an imatrix the first eighth of ffn_down Q5_K
    **{p: {ATTN_V: lambda s: Q.Q5_K if s.model.n_gqa >= 4 else None,
           ATTN_QKV: lambda s: Q.Q5_K if s.model.n_gqa >= 4 else None,
           FFN_DOWN: lambda s: Q.Q5_K if not s.imatrix and s.i < s.n // 8 else None} for p in ("IQ4_NL", "IQ4_XS")},
}

# 8-expert models' attn_output (llama.cpp: Q5_K for these presets, the preset's default otherwise).
EIGHT_EXPERT_ATTN_OUTPUT: dict[str, Rule] = {
    p: const(Q.Q5_K) for p in ("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS")}

# Categories whose rules read a counter (Slot.i); attn_qkv counts with attn_v, as in llama.cpp.
COUNTED = {ATTN_V: ATTN_V, ATTN_QKV: ATTN_V, FFN_DOWN: FFN_DOWN}


def output_type(preset: Preset, cols: int) -> Q:
    """output.weight (or tied token_embd.weight) of a quantized preset."""
    if cols % gguf.GGML_QUANT_SIZES[preset.default][0]:
        return Q.Q8_0
    return preset.default if preset.default == Q.Q8_0 else Q.Q6_K


def rule_type(preset: Preset, name: str, cols: int, slot: Slot, tied: bool) -> Q:
    """The preset's type for one quantizable tensor, before the row-length fallback."""
    if not preset.quantized:
        return preset.default
    cat = category(name)
    if cat == OUTPUT or (tied and cat == TOKEN_EMBD):
        return output_type(preset, cols)
    rule = RULES.get(preset.name, {}).get(cat)
    if slot.model.n_expert == 8 and cat == ATTN_OUTPUT:
        rule = EIGHT_EXPERT_ATTN_OUTPUT.get(preset.name)  # replaces the dense rules
    chosen = rule(slot) if rule else None
    chosen = preset.default if chosen is None else chosen
    if cat in (ATTN_V, ATTN_QKV) and slot.model.is_70b and chosen in (Q.Q3_K, Q.Q4_K):
        # 70B: 8 heads share attn_v, which is 8x smaller than attn_q: more bits cost little.
        chosen = Q.Q5_K
    if cat in (ATTN_V, ATTN_QKV, ATTN_K) and slot.model.n_expert == 8:
        chosen = Q.Q8_0  # llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    return chosen


def mxfp4_moe_type(name: str, shape: tuple[int, ...], tied: bool) -> Q:
    """MXFP4_MOE (llama_tensor_get_type_impl's MOSTLY_MXFP4_MOE branches): the expert tensors, 3-D with
    more than one expert (ne[2] > 1), take MXFP4; every other quantizable tensor Q8_0, output.weight
    (or the tied token_embd.weight) included."""
    cat = category(name)
    if cat == OUTPUT or (tied and cat == TOKEN_EMBD):
        return Q.Q8_0
    return Q.MXFP4 if len(shape) == 3 and shape[0] > 1 else Q.Q8_0


def fallback(t: Q, cols: int) -> Q:
    """The type actually used for rows of `cols` values (tensor_type_fallback)."""
    if t in FLOAT_TYPES or cols % gguf.GGML_QUANT_SIZES[t][0] == 0:
        return t
    t2 = FALLBACK.get(t, LAST_RESORT)
    return t2 if cols % gguf.GGML_QUANT_SIZES[t2][0] == 0 else LAST_RESORT


def preset_types(preset: Preset, tensors: list[tuple[str, tuple[int, ...]]], model: ModelShape,
                 imatrix: bool = False) -> list[Q | None]:
    """The preset's type for each (name, shape) tensor, in the given order, before overrides and the
    fallback; None for a tensor that is never quantized (it keeps its stored type).

    shape is numpy order (..., cols). Counters run in llama.cpp's order (by layer, then name)."""
    tied = not any(category(name) == OUTPUT for name, _ in tensors)
    counted = {c: [k for k, (name, _) in enumerate(tensors) if COUNTED.get(category(name)) == c]
               for c in set(COUNTED.values())}
    # uncounted categories: the layer number (no rule of ours reads it)
    slots = {k: Slot(layer_of(name), model.n_layers, model, imatrix) for k, (name, _) in enumerate(tensors)}
    for c, members in counted.items():
        n = model.n_layers if c == FFN_DOWN else len(members)  # llama.cpp: n_ffn_down = n_layer
        order = sorted(members, key=lambda k: (layer_of(tensors[k][0]), tensors[k][0]))
        slots.update({k: Slot(i, n, model, imatrix) for i, k in enumerate(order)})
        if c == FFN_DOWN and model.n_expert > 1:  # layer_info: the layer from the name
            slots.update({k: Slot(layer_of(tensors[k][0]), n, model, imatrix) for k in members})
    out: list[Q | None] = []
    for k, (name, shape) in enumerate(tensors):
        if not allows_quantization(name, len(shape)):
            out.append(None)
        elif preset.name == "MXFP4_MOE":
            out.append(mxfp4_moe_type(name, shape, tied))
        else:
            out.append(rule_type(preset, name, shape[-1], slots[k], tied))
    return out
