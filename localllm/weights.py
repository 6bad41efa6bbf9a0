"""Checkpoint tensors -> our parameter names (which are the GGUF names) as torch tensors.

GGUF names are ours already; Hugging Face names go through one explicit table. Quantized GGUF tensors
are decoded with the `gguf` package's values (quantize/formats/).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import torch

from localllm.quantize.decode import dequantize_torch
from localllm.quantize.formats import SUPPORTED_TYPES

from .config import ModelConfig
from .config_hf import read_json
from .errors import LocalLLMError
from .fused import split_rows
from .gemma4 import gemma4_hf_name, hf_name_map, ignored_tensors
from .gguf_file import GGUFFile
from .moe_mxfp4 import is_mxfp4, read_mxfp4_tensors
from .moe_weights import MoESource, Part, hf_moe_parts, legacy_expert, read_moe
from .tensor_names import GGUF_RENAMES, gguf_to_ours, ours_to_gguf  # noqa: F401 (moved there, re-exported)

# Hugging Face parameter name (per layer: with {i}) -> GGUF / our name.
HF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    # Phi-3's fused q|k|v and gate|up, as gguf's TensorNameMap names them (split at load: fused.py)
    "model.layers.{i}.self_attn.qkv_proj.weight": "blk.{i}.attn_qkv.weight",
    "model.layers.{i}.mlp.gate_up_proj.weight": "blk.{i}.ffn_up.weight",
}
_HF_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in HF_NAMES.items()]

# Architectures whose HF names come from gguf's TensorNameMap for their GGUF architecture (HF_NAMES
# is Llama's table: there post_attention_layernorm is the MLP's input norm, ffn_norm; in Gemma it
# is the attention output's norm, post_attention_norm, and pre_feedforward_layernorm is ffn_norm).
TENSOR_MAP_ARCHS = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
# HF RMSNorm computes x * (1 + w) here; GGUF holds w + 1 (the converter adds 1 to every
# `*norm.weight`): the HF loader adds it (add_norm_offset).
NORM_PLUS_ONE_ARCHS = frozenset({"gemma2", "gemma3"})
SKIP = ""  # hf_namer's answer for a checkpoint tensor the text model does not use

# Gemma3ForConditionalGeneration checkpoints: the text model under language_model, named either as
# save_pretrained writes it (language_model.model.*, language_model.lm_head.*) or as the module holds
# it (model.language_model.*, lm_head.*); renamed as transformers' "llava" conversion and llama.cpp's
# Gemma3Model do. The vision tower and the projector, which a text model does not use, are skipped
# by their prefixes (both forms).
MULTIMODAL_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

# GGUF architectures whose q/k rows llama.cpp's converter permuted for interleaved rope (its SmolLM3Model
# is a LlamaModel, whose modify_tensors permutes them).
PERMUTED_QK_ARCHS = frozenset({"llama", "mistral", "smollm3"})

# Whole-model 1-D rope tensors: held as buffers named without ".weight" (model.Transformer).
ROPE_BUFFERS = ("rope_freqs", "rope_factors_short", "rope_factors_long")

# Lookup tables a backend may keep as blocks (QEmbedding); Gemma 4's per-layer embeddings are one.
EMBEDDINGS = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})
# Float types a backend may keep as rows in the file's type (Runtime.dense_blocks: the CPU's).
DENSE_BLOCK_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                               gguf.GGMLQuantizationType.BF16})

# Our module's names for attention tensors live under `.attn.` (see model.Block).
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "attn_sinks")
# ... and the mixture-of-experts MLP's under `.moe.` (localllm/moe.py).
_MOE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")


# GGUF names llama.cpp gives a tensor our module holds under another GGUF name, per architecture:
def to_module_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> blk.3.attn.attn_q.weight; rope_freqs.weight -> rope_freqs."""
    if gguf_name.removesuffix(".weight") in ROPE_BUFFERS:
        return gguf_name.removesuffix(".weight")
    parts = gguf_name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[2] in _ATTN:
        parts.insert(2, "attn")
    elif len(parts) > 2 and parts[0] == "blk" and parts[2] in _MOE:
        parts.insert(2, "moe")
    return ".".join(parts)


def gguf_name(module_name: str) -> str:
    """Inverse of to_module_name: blk.3.attn.attn_q.weight -> blk.3.attn_q.weight (module names too)."""
    if module_name in ROPE_BUFFERS:
        return module_name + ".weight"
    parts = module_name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[2] in ("attn", "moe"):
        del parts[2]
    return ".".join(parts)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute on the rows (output dim) of a q or k weight."""
    rows = w.shape[0]
    # The converter did reshape(H, 2, D/2, ...).swapaxes(1, 2); the inverse reads it as (H, D/2, 2, ...).
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class QuantizedTensor:
    """A linear weight left in its GGUF blocks: uint8 (rows, bytes per row) of type qtype."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor


def gguf_tensor(t: gguf.ReaderTensor) -> torch.Tensor:
    if t.tensor_type not in SUPPORTED_TYPES:
        raise LocalLLMError(f"tensor {t.name!r} has unsupported type {t.tensor_type.name}")
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        # Reader data is a read-only memmap; torch needs a writable array, but we copy on cast anyway.
        return torch.from_numpy(np.array(t.data, dtype=np.float32))
    # quantize.decode's torch decoders give exactly gguf.quants.dequantize's values (tests/
    # test_quant_formats.py) about 4x faster: (rows, bytes per row) -> (rows, cols) float32.
    shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: (..., cols)
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(math.prod(shape[:-1]), -1)
    return dequantize_torch(torch.from_numpy(raw.copy()), t.tensor_type).reshape(shape)


def gguf_state_dict(
    f: GGUFFile, cfg: ModelConfig, keep_quantized: frozenset = frozenset(), keep_embedding: bool = False
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Every tensor decoded to float, except linear weights (and token_embd with keep_embedding) of a
    type in keep_quantized: QuantizedTensor, uint8 (rows, row bytes) viewing the file's mapping (no copy).
    Dense types (DENSE_BLOCK_TYPES) in keep_quantized are kept only as 2-D rows of a multiple of 32 values."""
    out, ignored = {}, ignored_tensors(cfg)
    for name, t in f.tensors.items():
        if name in ignored:
            continue
        keep = keep_embedding or name not in EMBEDDINGS
        # 2-D linear weights, and 3-D expert tensors (E, F, C) as their E * F rows (localllm/moe.py; Gemma
        # 4's experts beside the MLP are decoded: gemma4_moe.py's products take dense tensors)
        dims = (2,) if cfg.moe_with_mlp else (2, 3)
        if t.tensor_type in DENSE_BLOCK_TYPES:  # F32/F16/BF16 rows the CPU products read (cpu_quant.cpp)
            dims = (2,) if int(t.shape[0]) % 32 == 0 else ()
        if t.tensor_type in keep_quantized and keep and len(t.shape) in dims and name.endswith(".weight"):
            rows = math.prod(int(d) for d in t.shape[1:])  # ggml order: t.shape[0] is the row length
            raw = t.data.view(np.uint8).reshape(rows, -1)  # F16/BF16 data is typed: view as bytes
            w = QuantizedTensor(t.tensor_type, torch.from_numpy(raw))
        else:
            w = gguf_tensor(t)
        if cfg.arch in PERMUTED_QK_ARCHS and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads
            if isinstance(w, QuantizedTensor):  # rows are whole blocks: permute the raw rows alike
                w = QuantizedTensor(w.qtype, unpermute_qk(w.data, heads))
            else:
                w = unpermute_qk(w, heads)
        out |= {to_module_name(n): part for n, part in split_fused(cfg, gguf_to_ours(cfg.arch, name), w)}
    return stack_legacy_experts(out)


def stack_legacy_experts(state: dict) -> dict:
    """Per-expert tensors of the old GGUF layout (moe_weights.legacy_expert, validated by check_gguf)
    -> one stacked tensor each: dense ones stacked (E, F, C), quantized ones' rows concatenated
    (E * F, row bytes), as the merged layout stores them."""
    groups: dict[str, dict[int, object]] = {}
    for name in list(state):
        hit = legacy_expert(gguf_name(name))
        if hit is not None:
            groups.setdefault(hit[0], {})[hit[1]] = state.pop(name)
    for merged, experts in groups.items():
        parts = [experts[e] for e in range(len(experts))]
        if isinstance(parts[0], QuantizedTensor):
            state[to_module_name(merged)] = QuantizedTensor(parts[0].qtype, torch.cat([p.data for p in parts]))
        else:
            state[to_module_name(merged)] = torch.stack(parts)
    return state


def split_fused(cfg: ModelConfig, name: str, w):
    """fused.split_rows for a dense tensor or a QuantizedTensor (its raw rows split alike)."""
    if isinstance(w, QuantizedTensor):
        return [(n, QuantizedTensor(w.qtype, rows)) for n, rows in split_rows(cfg, name, w.data)]
    return split_rows(cfg, name, w)


def hf_name(name: str) -> str | None:
    for pattern, target in _HF_PATTERNS:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    return None


def hf_namer(cfg: ModelConfig | None) -> Callable[[str], str | None]:
    """checkpoint key -> GGUF name, SKIP (not a text-model weight) or None (unknown), for cfg's
    architecture (None: HF_NAMES, the Llama family's table)."""
    if cfg is not None and cfg.arch == "gemma4":  # gemma4.py: gguf's GEMMA4 table and the converter's extras
        gemma4_map = hf_name_map(cfg.n_layers)
        return lambda key: gemma4_hf_name(key, gemma4_map)
    if cfg is None or cfg.arch not in TENSOR_MAP_ARCHS:
        return hf_name
    name_map = gguf.get_tensor_name_map(TENSOR_MAP_ARCHS[cfg.arch], cfg.n_layers)
    multimodal = cfg.arch == "gemma3"

    def mapped(key: str) -> str | None:
        if multimodal and key.startswith(MULTIMODAL_SKIPPED):
            return SKIP
        for prefix, replacement in MULTIMODAL_TEXT_PREFIXES if multimodal else ():
            if key.startswith(prefix):
                key = replacement + key[len(prefix):]
                break
        if key == "lm_head.weight":  # Gemma 2's GGUF tensor list has no OUTPUT (tied); a stored head is used
            return "output.weight"
        out = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        return None if out == key else out  # TensorNameMap also maps GGUF names to themselves

    return mapped


def add_norm_offset(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """HF Gemma norm weights w -> w + 1 in fp32, the multiplier GGUF holds (the converter's
    modify_tensors adds 1 to every `*norm.weight`; transformers' Gemma RMSNorm computes 1 + w.float())."""
    if cfg.arch not in NORM_PLUS_ONE_ARCHS:
        return
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = t.float() + 1


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / s for s in index_shards(index)]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LocalLLMError(f"no .safetensors files in {folder}")
    for p in files:
        if not p.is_file():
            raise LocalLLMError(f"missing safetensors shard {p.name} named in the index of {folder}")
    return files


def index_shards(index: Path) -> list[str]:
    """The shard file names of a model.safetensors.index.json, checked: plain names in its folder."""
    value = read_json(index)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict):
        raise LocalLLMError(f"{index} has no 'weight_map' object (tensor name -> shard file)")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise LocalLLMError(f"{index} maps {key!r} to {shard!r}, expected a shard's file name in its folder")
    return sorted(set(weight_map.values()))


def hf_tensor_names(folder: Path, cfg: ModelConfig | None = None) -> Iterator[tuple[Path, str, str]]:
    """(file, checkpoint key, GGUF name) of every tensor of a safetensors folder, by hf_namer(cfg)."""
    for path, key, name, _, _ in hf_tensor_headers(folder, cfg):
        yield path, key, name


def hf_tensor_headers(folder: Path, cfg: ModelConfig | None = None
                      ) -> Iterator[tuple[Path, str, str, tuple[int, ...], str]]:
    """(file, checkpoint key, GGUF name, shape, dtype) of every tensor the text model uses, from the
    files' headers only; names by hf_namer(cfg). Mixture-of-experts tensors, which map to parts of
    ours, are hf_moe_headers'."""
    namer = hf_namer(cfg)
    for path, key, shape, dtype in hf_header_entries(folder):
        name = namer(key)
        if name is None and hf_moe_parts(path, key, shape) is None and not key.endswith("rotary_emb.inv_freq"):
            raise LocalLLMError(f"unknown tensor {key!r} in {path.name}")  # inv_freq: a cached buffer, not a weight
        if name:  # None: the buffer above or an expert tensor; SKIP: not the text model's
            yield path, key, name, shape, dtype


def hf_moe_headers(folder: Path, cfg: ModelConfig | None = None) -> list[Part]:
    """The parts of every mixture-of-experts tensor of a safetensors folder (localllm/moe_weights.py)."""
    namer, out = hf_namer(cfg), []
    for path, key, shape, dtype in hf_header_entries(folder):
        if namer(key) is None:
            out += hf_moe_parts(path, key, shape, dtype) or []
    return out


def hf_header_entries(folder: Path) -> Iterator[tuple[Path, str, tuple[int, ...], str]]:
    """(file, checkpoint key, shape, dtype) of every tensor, from the files' headers only."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                entries = [(key, f.get_slice(key)) for key in f.keys()]
                entries = [(key, tuple(s.get_shape()), s.get_dtype()) for key, s in entries]
        except (SafetensorError, OSError, ValueError) as e:
            raise LocalLLMError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        for key, shape, dtype in entries:
            yield path, key, shape, dtype


def hf_state_dict(folder: Path, keys: dict[str, tuple[Path, str] | MoESource], cfg: ModelConfig
                  ) -> dict[str, torch.Tensor]:
    """keys: GGUF name -> (file, checkpoint key), or the parts of an expert tensor (MoESource), as
    validated (validate.check_hf_folder); fused checkpoint tensors split into ours (fused.py). MXFP4
    experts (moe_mxfp4.py) come as QuantizedTensor rows, placed by the backend (load.place_quantized)."""
    from safetensors import SafetensorError, safe_open

    # a released gpt-oss's MXFP4 experts: kept as blocks, gate and up from one pass over gate_up (moe_mxfp4.py)
    mxfp4 = {n: s.parts for n, s in keys.items() if isinstance(s, MoESource) and is_mxfp4(s.parts)}
    out = {to_module_name(n): QuantizedTensor(gguf.GGMLQuantizationType.MXFP4, rows)
           for n, rows in read_mxfp4_tensors(mxfp4).items()}
    for name, source in keys.items():
        if name in mxfp4:
            continue
        if isinstance(source, MoESource):
            out[to_module_name(name)] = read_moe(source)
            continue
        path, key = source
        try:
            with safe_open(str(path), framework="pt") as f:
                # A copy that owns its memory: tensors viewing safetensors' mapping were never freed
                # after generation ran on them (13 mappings and ~5 MB kept per load of the tiny model).
                w = f.get_tensor(key).clone()
        except (SafetensorError, OSError) as e:
            raise LocalLLMError(f"cannot read tensor {key!r} from {path}: {e}") from None
        out |= {to_module_name(n): part for n, part in split_rows(cfg, name, w)}
    return out
