"""Tiny random-weight Gemma 4 text models, written the way real ones are (tiny_models.py's companion).

The HF folder is what transformers' Gemma4ForCausalLM.save_pretrained writes (config.json with
model_type gemma4_text and per_layer_config, model.safetensors), plus tiny_hf's tokenizer files.
The GGUF is what llama.cpp's converter (conversion/gemma.py Gemma4Model) writes for that folder:
gemma4.* keys (per-layer head_count_kv / feed_forward_length arrays, sliding_window_pattern, key_length
of the full layers and key_length_swa of the sliding ones, shared_kv_layers, embedding_length_per_layer_
input), tensor names from gguf's GEMMA4 name map, norms unchanged (norm_shift 0), layer_scalar as
blk.N.layer_output_scale.weight (1,), and rope_freqs.weight: 1 for the rotated pairs of the full layers'
proportional rope, 1e30 for the others.

Nothing here imports localllm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_gguf import add_tensor, add_tokenizer, encode_tensor
from tiny_spec import GGUF_FILE_TYPE, Q
import tiny_tokenizer
from tiny_tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, tokenizer_json

S, F = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma4Spec:
    layer_types: tuple[str, ...] = (S, S, F, S, S, F)
    dim: int = 64
    ffn_dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    global_head_dim: int = 32
    n_global_kv_heads: int | None = 1
    k_eq_v: bool = True
    sliding_window: int = 5
    partial_rotary: float = 0.25
    final_softcap: float | None = 30.0
    ple_dim: int = 0
    n_kv_shared: int = 0
    double_wide: bool = False
    n_experts: int = 0  # enable_moe_block with this many experts (26B-A4B style)
    top_k: int = 2
    expert_ffn_dim: int = 32
    tied: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False)  # more config.json keys

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)


# The released configs' variants, small: 31B-style dense (k_eq_v, global kv heads, soft-cap, no PLE)
# and E2B/E4B-style (PLE, KV sharing over the last layers, double-wide MLP there, no k_eq_v).
CASES = {
    "dense": Gemma4Spec(seed=11, final_softcap=2.0),  # a small cap: logits of ~1 feel it
    "e2b": Gemma4Spec(k_eq_v=False, n_global_kv_heads=None, ple_dim=16, n_kv_shared=3, double_wide=True,
                      final_softcap=None, tied=True, seed=12),
    "untied": Gemma4Spec(tied=False, seed=13, k_eq_v=False, n_global_kv_heads=None),
    # 26B-A4B style: experts beside the dense MLP in every layer, k_eq_v
    "moe": Gemma4Spec(n_experts=4, top_k=2, seed=14),
}


def text_config(spec: Gemma4Spec) -> dict:
    """The Gemma4TextConfig arguments (transformers then saves them with per_layer_config)."""
    cfg = dict(
        vocab_size=tiny_tokenizer.vocab_size(), hidden_size=spec.dim, intermediate_size=spec.ffn_dim,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, global_head_dim=spec.global_head_dim, attention_k_eq_v=spec.k_eq_v,
        layer_types=list(spec.layer_types), sliding_window=spec.sliding_window, max_position_embeddings=256,
        final_logit_softcapping=spec.final_softcap, hidden_size_per_layer_input=spec.ple_dim,
        vocab_size_per_layer_input=tiny_tokenizer.vocab_size(), num_kv_shared_layers=spec.n_kv_shared,
        use_double_wide_mlp=spec.double_wide, tie_word_embeddings=spec.tied, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                         F: {"rope_type": "proportional", "partial_rotary_factor": spec.partial_rotary,
                             "rope_theta": 1e6}},
    )
    if spec.n_global_kv_heads is not None:
        cfg["num_global_key_value_heads"] = spec.n_global_kv_heads
    if spec.n_experts:
        cfg |= dict(enable_moe_block=True, num_experts=spec.n_experts, top_k_experts=spec.top_k,
                    moe_intermediate_size=spec.expert_ffn_dim)
    return cfg | spec.extra


def make_model(spec: Gemma4Spec):
    """transformers' Gemma4ForCausalLM with every weight redrawn: matrices std 0.1 (logits of a few
    units), norms 1 + N(0, 0.1), layer scalars in [0.5, 1.5] (all of them matter)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    model = Gemma4ForCausalLM(Gemma4TextConfig(**text_config(spec))).eval()
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in name or name.endswith("embed_scale"):
                continue
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("router.proj.weight"):  # decisive routing: top-k far from ties
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def write_hf_folder(spec: Gemma4Spec, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    make_model(spec).save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(tokenizer_json())
    tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": SPECIAL_TOKENS[BOS_ID],
               "eos_token": SPECIAL_TOKENS[EOS_ID], "add_bos_token": False, "model_max_length": 256}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return folder


def gguf_tensors(spec: Gemma4Spec, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF state dict -> GGUF name -> fp32 array, as the converter maps it (no permutation, no norm shift)."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, spec.n_layers)
    out = {}
    for key, t in state.items():
        if key == "lm_head.weight" and spec.tied:
            continue
        if key.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            key += ".weight"
        if key.endswith(("router.scale", "router.per_expert_scale")):  # Gemma4Model.modify_tensors
            bid = int(key.split(".")[2])
            kind = gguf.MODEL_TENSOR.FFN_GATE_INP if key.endswith("router.scale") else gguf.MODEL_TENSOR.FFN_DOWN_EXP
            out[gguf.TENSOR_NAMES[kind].format(bid=bid) + ".scale"] = t.float().numpy()
            continue
        base, suffix = key.rsplit(".", 1)
        name = name_map.get_name(base)
        assert name is not None, key
        out[f"{name}.{suffix}"] = t.float().numpy().reshape(t.shape or (1,))
    rotated = int(spec.global_head_dim * spec.partial_rotary / 2)
    out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (spec.global_head_dim // 2 - rotated),
                                        dtype=np.float32)
    return out


def write_gguf(spec: Gemma4Spec, folder: Path, path: Path, qtype: Q = Q.F32,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """The GGUF of the HF folder's weights (folder: write_hf_folder's); extra: more tensors written
    (a converted checkpoint that stored k/v for its KV-shared layers has them)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("Tiny Gemma4")
    L = spec.n_layers
    swa = [t == S for t in spec.layer_types]
    first = L - spec.n_kv_shared
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(spec.dim)
    if spec.double_wide:
        w.add_feed_forward_length([spec.ffn_dim * (2 if i >= first else 1) for i in range(L)])
    else:
        w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    if spec.n_global_kv_heads is not None:
        w.add_head_count_kv([spec.n_kv_heads if s else spec.n_global_kv_heads for s in swa])
    else:
        w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(spec.global_head_dim)
    w.add_value_length(spec.global_head_dim)
    w.add_key_length_swa(spec.head_dim)
    w.add_value_length_swa(spec.head_dim)
    w.add_rope_dimension_count(spec.global_head_dim)
    w.add_rope_dimension_count_swa(spec.head_dim)
    if spec.final_softcap:
        w.add_final_logit_softcapping(spec.final_softcap)
    w.add_sliding_window(spec.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(spec.n_kv_shared)
    w.add_embedding_length_per_layer_input(spec.ple_dim)
    if spec.n_experts:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.top_k)
        w.add_expert_feed_forward_length(spec.expert_ffn_dim)
    w.add_file_type(GGUF_FILE_TYPE.get(qtype, gguf.LlamaFileType.GUESSED))
    add_tokenizer(w)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data in (gguf_tensors(spec, state) | (extra or {})).items():
        raw = encode_tensor(data, qtype) if name != "rope_freqs.weight" else (data, Q.F32)
        add_tensor(w, name, *raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
