"""A tiny model as a Hugging Face folder: config.json, model.safetensors (or shards and their index),
tokenizer.json / tokenizer_config.json, as `save_pretrained` lays a folder out.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from tiny_moe import moe_hf_config
from tiny_spec import HF_CLASS, TinySpec
from tiny_tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, tokenizer_json, vocab_size
from tiny_weights import make_weights


def hf_config(spec: TinySpec) -> dict:
    cfg = {
        "architectures": [HF_CLASS[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": vocab_size(),
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context_length,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": spec.storage_dtype,
        "use_cache": True,
    }
    if spec.head_dim is not None:
        cfg["head_dim"] = spec.head_dim
    cfg |= moe_hf_config(spec)
    if spec.arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if spec.arch == "mistral":
        cfg["sliding_window"] = None
    if spec.arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if spec.arch == "phi3":
        cfg |= phi3_config(spec)
    if spec.arch == "smollm3":
        cfg |= {"no_rope_layer_interval": spec.nope_interval or 4, "use_sliding_window": False, "pad_token_id": None,
                "attention_bias": False, "mlp_bias": False}
    if spec.gemma:
        cfg |= gemma_hf_config(spec)
    return cfg


def gemma_hf_config(spec: TinySpec) -> dict:
    """The Gemma2Config / Gemma3TextConfig keys beyond Llama's, as the released models spell them."""
    cfg = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "head_dim": spec.hd, "attention_bias": False,
           "query_pre_attn_scalar": spec.query_pre_attn_scalar or spec.hd, "sliding_window": spec.sliding_window,
           "attn_logit_softcapping": spec.attn_softcap, "final_logit_softcapping": spec.final_softcap,
           "pad_token_id": 0}
    if spec.arch == "gemma3_text":  # the 1B model's config.json spelling (pre rope_parameters)
        cfg |= {"rope_local_base_freq": spec.rope_local_theta, "sliding_window_pattern": 6}
    return cfg


def phi3_config(spec: TinySpec) -> dict:
    """The keys a Phi-3 / 3.5 / 4-mini config.json adds: original length at the top level, LongRoPE in
    rope_scaling {"type": "longrope", short_factor, long_factor}, partial_rotary_factor, sliding_window."""
    cfg = {"pad_token_id": None, "sliding_window": spec.sliding_window,
           "original_max_position_embeddings": spec.longrope_original or spec.context_length}
    if spec.partial_rotary is not None:
        cfg["partial_rotary_factor"] = spec.partial_rotary
    if spec.longrope_original is not None:
        short, long = spec.longrope_factors()
        cfg["rope_scaling"] = {"type": "longrope", "short_factor": short, "long_factor": long}
    return cfg


def write_hf_folder(spec: TinySpec, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """weights: HF name -> fp32 tensor written instead of make_weights(spec) (same names and shapes)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if spec.multimodal:
        return write_gemma3_multimodal(spec, folder)
    weights = make_weights(spec) if weights is None else weights
    dtype = getattr(torch, spec.storage_dtype)
    tensors = {k: v.to(dtype).contiguous() for k, v in weights.items()}
    names = list(tensors)
    if spec.shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        # Consecutive groups, named as save_pretrained names shards.
        per = math.ceil(len(names) / spec.shards)
        weight_map = {}
        for s in range(spec.shards):
            shard = f"model-{s + 1:05d}-of-{spec.shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[s * per:(s + 1) * per]}
            save_file(part, str(folder / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    write_tokenizer_files(spec, folder)
    return folder


def write_tokenizer_files(spec: TinySpec, folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer_json())
    tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": SPECIAL_TOKENS[BOS_ID],
               "eos_token": SPECIAL_TOKENS[EOS_ID], "add_bos_token": False, "model_max_length": spec.context_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


# A tiny SigLIP tower (2 x 2 patches of 14 pixels) and projector (4 image tokens): present in the
# checkpoint as in a real Gemma 3 4B+ one, unused by text-only input.
TINY_VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
               "vision_use_head": False}


def write_gemma3_multimodal(spec: TinySpec, folder: Path) -> Path:
    """The spec's text weights inside a Gemma3ForConditionalGeneration, saved by save_pretrained
    (as checkpoint names: language_model.model.*, vision_tower.*, multi_modal_projector.*)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = replace(spec, multimodal=False)
    cfg = Gemma3Config(text_config=hf_config(text), vision_config=dict(TINY_VISION), mm_tokens_per_image=4,
                       tie_word_embeddings=spec.tied, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(spec.seed)
    model = Gemma3ForConditionalGeneration(cfg)
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in make_weights(text).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith(("model.vision_tower.", "model.multi_modal_projector.", "lm_head.")) for k in missing)
    model.save_pretrained(str(folder))
    write_tokenizer_files(text, folder)
    return folder
