"""A tiny model as GGUF, as llama.cpp's convert_hf_to_gguf.py writes it: `{arch}.*` metadata, the gpt2
vocabulary, tensor names from gguf's own name map, q/k rows permuted for the llama architecture.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_moe import gpt_oss_converted, split_experts, stack_experts
from tiny_spec import GGUF_ARCH, GGUF_FILE_TYPE, PERMUTED_GGUF_ARCHS, Q, TinySpec
from tiny_tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, vocab_and_merges, vocab_size
from tiny_weights import make_weights


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half pairs -> interleaved pairs, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(spec: TinySpec) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the per-frequency divisors written as rope_freqs.weight."""
    rs = spec.rope_scaling
    dim = spec.hd
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rs.get("factor", 8.0)
    low_freq_factor = rs.get("low_freq_factor", 1.0)
    high_freq_factor = rs.get("high_freq_factor", 4.0)
    old_context_len = rs.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array (numpy order = HF order), permuted as the converter permutes."""
    arch = GGUF_ARCH[spec.arch]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)  # "gpt-oss": GPT_OSS
    name_map = gguf.get_tensor_name_map(model_arch, spec.n_layers)
    out = {}
    for hf, t in gpt_oss_converted(stack_experts(make_weights(spec))).items():
        base, suffix = hf.rsplit(".", 1)
        name = name_map.get_name(base)
        assert name is not None, hf
        if spec.gemma and hf.endswith("norm.weight"):  # Gemma2Model / Gemma3Model.modify_tensors
            t = t + 1
        data = t.numpy()
        if arch in PERMUTED_GGUF_ARCHS and base.endswith("q_proj"):
            data = permute_qk(data, spec.n_heads)
        elif arch in PERMUTED_GGUF_ARCHS and base.endswith("k_proj"):
            data = permute_qk(data, spec.n_kv_heads)
        out[f"{name}.{suffix}"] = data
    if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(spec)
    if arch == "phi3" and spec.longrope_original is not None:  # Phi3MiniModel.generate_extra_tensors
        short, long = spec.longrope_factors()
        out["rope_factors_long.weight"] = np.array(long, dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(short, dtype=np.float32)
    return out


def add_gemma_metadata(w: gguf.GGUFWriter, spec: TinySpec) -> None:
    """Gemma2Model / Gemma3Model.set_gguf_parameters (conversion/gemma.py) beyond the common keys."""
    if spec.arch == "gemma2":
        w.add_attn_logit_softcapping(spec.attn_softcap)
        w.add_final_logit_softcapping(spec.final_softcap)
        w.add_sliding_window(spec.sliding_window)
        return
    if spec.final_softcap:
        w.add_final_logit_softcapping(spec.final_softcap)
    w.add_sliding_window(spec.sliding_window)


def encode_tensor(data: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """The converter's choice: 1-D tensors stay F32; 2-D ones take qtype (F16 where blocks don't fit)."""
    if data.ndim == 1 or qtype == Q.F32:
        return data.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return data.astype(np.float16), Q.F16
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        return data.astype(np.float16), Q.F16
    return gguf.quants.quantize(data.astype(np.float32), qtype), qtype


def add_tensor(w: gguf.GGUFWriter, name: str, raw: np.ndarray, t: Q) -> None:
    # F32/F16 arrays carry their type; quantized (and BF16) data is uint8 (rows, bytes per row).
    if t in (Q.F32, Q.F16):
        w.add_tensor(name, raw)
    else:
        w.add_tensor(name, raw, raw_dtype=t)


def add_tokenizer(w: gguf.GGUFWriter) -> None:
    tokens, merges = vocab_and_merges()
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)


def add_phi3_metadata(w: gguf.GGUFWriter, spec: TinySpec) -> None:
    """What Phi3MiniModel.set_gguf_parameters / generate_extra_tensors add: the original context, the
    rotated dims int(partial * dim) // heads, the sliding window (0 for none), LongRoPE's attention factor."""
    original = spec.longrope_original or spec.context_length
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(int((spec.partial_rotary or 1.0) * spec.dim) // spec.n_heads)
    w.add_sliding_window(spec.sliding_window or 0)
    if spec.longrope_original is not None:
        scale = spec.context_length / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def write_gguf(spec: TinySpec, path: Path, qtype: Q = Q.F32,
               raw: dict[str, tuple[np.ndarray, Q]] | None = None, per_expert: bool = False,
               split_max_tensors: int = 0) -> Path:
    """raw: GGUF name -> (raw data, type) written instead of that tensor (the mixed-type model).
    per_expert: expert tensors in the old layout of early Mixtral files (blk.N.ffn_gate.E.weight, ...).
    split_max_tensors: > 0 writes a split GGUF of parts of at most this many tensors, as the converter
    does with --split-max-tensors (gguf's writer: PATH-STEM-00001-of-0000N.gguf ..., gguf-split's keys);
    the first part's path is returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = GGUF_ARCH[spec.arch]
    # no path yet when splitting: the writer plans the parts' names once it has every tensor
    w = gguf.GGUFWriter(None if split_max_tensors else str(path), arch, split_max_tensors=split_max_tensors)
    # The converter names the file after the model ("Mistral 7B Instruct v0.3"); the architecture
    # stays `llama` for Mistral, so transformers' GGUF loader builds a LlamaForCausalLM for it.
    w.add_name(f"Tiny {spec.arch.capitalize()}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.dim)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    if arch != "gemma2":  # Gemma2Model.set_gguf_parameters writes no rope base (llama.cpp: 10000)
        w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    if spec.head_dim is not None:  # TextModel.set_gguf_parameters writes these only for explicit head_dim
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    rs = spec.rope_scaling or {}
    if rs.get("rope_type") == "linear" and arch != "gemma2":  # TextModel.set_gguf_parameters (Gemma 3:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # its full_attention rope)
        w.add_rope_scaling_factor(rs["factor"])
    if spec.gemma:
        add_gemma_metadata(w, spec)
    w.add_file_type(GGUF_FILE_TYPE.get(qtype, gguf.LlamaFileType.GUESSED))
    if arch in ("llama", "smollm3"):  # LlamaModel.set_gguf_parameters (SmolLM3Model inherits it)
        w.add_vocab_size(vocab_size())
        w.add_rope_dimension_count(spec.hd)
    if arch == "phi3":
        add_phi3_metadata(w, spec)
    if spec.n_experts:  # LlamaModel / Qwen3MoeModel.set_gguf_parameters
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        if arch != "llama":
            w.add_expert_feed_forward_length(spec.expert_ffn_dim)
    if spec.arch == "gpt_oss":  # GptOssModel.set_gguf_parameters and the base class's rope scaling
        w.add_sliding_window(spec.sliding_window)
        rs = spec.rope_scaling or {}
        if rs.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rs["factor"])
            w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    add_tokenizer(w)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = gguf_tensors(spec)
    if per_expert:
        tensors = {n: d for name, data in tensors.items() for n, d in split_experts(name, data)}
    for name, data in tensors.items():
        if raw and name in raw:
            data_t = raw[name]
        else:  # the converter keeps rope_freqs, MoE routers (ffn_gate_inp) and biases in F32 whatever the type
            keep = name == "rope_freqs.weight" or ".ffn_gate_inp." in name or name.endswith(".bias")
            data_t = encode_tensor(data, qtype) if not keep else (data, Q.F32)
        add_tensor(w, name, *data_t)
    w.write_header_to_file(path if split_max_tensors else None)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]
