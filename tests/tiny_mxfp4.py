"""A tiny gpt-oss in the layout of OpenAI's released safetensors (experts as MXFP4 _blocks / _scales),
and the same blocks as an MXFP4 GGUF.

The experts are quantized once, by gguf.quants (llama.cpp's rule), as the GGUF rows llama.cpp's files
hold: gate_up_proj (E, C, 2F) transposed to its (E, 2F, C) rows, gate/up still interleaved; down_proj
(E, F, C) to (E, C, F). to_hf_blocks rewrites those bytes in the checkpoint's form, the one
transformers' convert_moe_packed_tensors decodes (an independent inverse of quantize/mxfp4.from_hf_blocks:
block byte i holds values 2i (low nibble) and 2i + 1; the scale byte is GGUF's exponent byte). The
GGUF's expert tensors are the same rows, gate = even rows and up = odd rows (the converter's split).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

import tiny_models as tm
from tiny_gguf import write_gguf
from tiny_hf import hf_config, write_tokenizer_files
from tiny_spec import TinySpec
from tiny_weights import make_weights

Q = gguf.GGMLQuantizationType
SPEC = tm.MOE_CASES["gpt_oss"]
# transformers' Mxfp4Config as OpenAI's config.json holds it
QUANT_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def gguf_mxfp4_rows(w: torch.Tensor) -> np.ndarray:
    """A stacked expert tensor (E, rows, K) -> (E, rows, K / 32 * 17) MXFP4 bytes (gguf.quants)."""
    e, rows, k = w.shape
    return gguf.quants.quantize(w.reshape(-1, k).numpy(), Q.MXFP4).reshape(e, rows, -1)


def to_hf_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 bytes (..., G * 17) -> (blocks (..., G, 16), scales (..., G)) uint8: per block byte 0 is
    the scale, bytes 1..16 hold value j (low nibble) and j + 16 (high); the checkpoint's byte i holds
    values 2i (low) and 2i + 1 (high)."""
    b = raw.reshape(*raw.shape[:-1], -1, 17)
    scales, qs = b[..., 0], b[..., 1:]
    values = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # (..., G, 32) codes in value order
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)
    return blocks.astype(np.uint8), scales.astype(np.uint8)


def expert_rows(weights: dict[str, torch.Tensor], layer: int) -> dict[str, np.ndarray]:
    """One layer's experts as GGUF MXFP4 rows: "gate_up" (E, 2F, .) interleaved, "down" (E, C, .)."""
    p = f"model.layers.{layer}.mlp.experts."
    return {"gate_up": gguf_mxfp4_rows(weights[p + "gate_up_proj"].transpose(-1, -2).contiguous()),
            "down": gguf_mxfp4_rows(weights[p + "down_proj"].transpose(-1, -2).contiguous())}


def released_tensors(spec: TinySpec = SPEC) -> tuple[dict[str, torch.Tensor], dict[str, tuple[np.ndarray, Q]]]:
    """-> (the checkpoint's tensors: dense ones in the spec's dtype, experts as uint8 blocks / scales;
    the GGUF's expert tensors as (raw MXFP4, type) for write_gguf's raw)."""
    weights = make_weights(spec)
    dtype = getattr(torch, spec.storage_dtype)
    hf, raw = {}, {}
    for i in range(spec.n_layers):
        rows = expert_rows(weights, i)
        p = f"model.layers.{i}.mlp.experts."
        for name, r in rows.items():
            blocks, scales = to_hf_blocks(r)
            hf[p + f"{name}_proj_blocks"] = torch.from_numpy(blocks)
            hf[p + f"{name}_proj_scales"] = torch.from_numpy(scales)
        raw[f"blk.{i}.ffn_gate_exps.weight"] = (np.ascontiguousarray(rows["gate_up"][:, 0::2]), Q.MXFP4)
        raw[f"blk.{i}.ffn_up_exps.weight"] = (np.ascontiguousarray(rows["gate_up"][:, 1::2]), Q.MXFP4)
        raw[f"blk.{i}.ffn_down_exps.weight"] = (rows["down"], Q.MXFP4)
    dense = {k: v.to(dtype).contiguous() for k, v in weights.items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    return dense | hf, raw


def write_released_folder(folder: Path, spec: TinySpec = SPEC,
                          tensors: dict[str, torch.Tensor] | None = None, split_scales: bool = False) -> Path:
    """The folder as OpenAI's holds it; tensors: released_tensors(spec)[0] or a variant. split_scales:
    two shards and an index, the scales in the second (a pair read from two files)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = released_tensors(spec)[0] if tensors is None else tensors
    if not split_scales:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.endswith("_scales")},
                  "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scales")}}
        for name, part in shards.items():
            save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map = {k: name for name, part in shards.items() for k in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_config(spec) | {"quantization_config": QUANT_CONFIG}, indent=2))
    write_tokenizer_files(spec, folder)
    return folder


def write_mxfp4_gguf(path: Path, spec: TinySpec = SPEC) -> Path:
    """The same model as an MXFP4 GGUF: experts the same blocks, the rest F32 (as the folder's values)."""
    return write_gguf(spec, path, raw=released_tensors(spec)[1])
