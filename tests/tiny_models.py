"""Tiny random-weight models written to disk the way real ones are, for oracle tests.

One set of random weights (Hugging Face parameter names, fp32 values already rounded to the
checkpoint's storage dtype) is written two ways:

- `write_hf_folder`: config.json + model.safetensors (or shards + model.safetensors.index.json) +
  tokenizer.json / tokenizer_config.json, as `save_pretrained` lays a folder out;
- `write_gguf`: what llama.cpp's convert_hf_to_gguf.py writes for that folder: `{arch}.*` metadata,
  the gpt2 (byte-level BPE) vocabulary, tensor names from gguf's own name map, q/k rows permuted for
  the llama architecture (Llama and Mistral both convert to `llama`), `rope_freqs.weight` for llama3
  rope scaling, 1-D tensors kept F32 and 2-D ones in the requested type (F32 or Q8_0, quantized
  with `gguf.quants.quantize`).

Nothing here imports localllm: these files are the inputs both we and transformers load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# HF config "architectures" entry and GGUF architecture per HF model_type. Llama.cpp's converter
# registers MistralForCausalLM under LlamaModel, so a Mistral GGUF says `llama`.
HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3"}
GEMMA = ("gemma2", "gemma3_text")
# GGUF architectures whose q/k rows the converter permutes (its LlamaModel and subclasses: SmolLM3Model)
PERMUTED_GGUF_ARCHS = ("llama", "smollm3")
# mixture of experts (Mixtral converts to `llama` with expert tensors)
HF_CLASS |= {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
GGUF_ARCH |= {"mixtral": "llama", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
GGUF_FILE_TYPE = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                  Q.F16: gguf.LlamaFileType.MOSTLY_F16}


@dataclass(frozen=True)
class TinySpec:
    """The shape of one tiny model; `arch` is the HF model_type."""

    arch: str
    n_layers: int = 2
    dim: int = 64
    ffn_dim: int = 128  # a multiple of 32: ffn_down's rows are quantized in blocks of 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None: dim // n_heads and no "head_dim" in config.json
    tied: bool = False
    rope_theta: float = 10000.0
    # HF rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 4.0, ...}
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    context_length: int = 256
    storage_dtype: str = "float32"  # safetensors dtype: float32, float16 or bfloat16
    shards: int = 1
    seed: int = 0
    # mixture of experts: n_experts > 0 replaces each MLP (expert_ffn_dim: an expert's hidden width)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = True  # Qwen3-MoE's norm_topk_prob (Mixtral always renormalises)
    name: str = field(default="", compare=False)
    # Gemma 2 / 3, gpt-oss (config.json keys of the same names; None: the key is written as null)
    sliding_window: int | None = None
    query_pre_attn_scalar: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_local_theta: float = 10000.0  # Gemma 3's sliding layers (llama.cpp's fixed value: GGUF can't say another)
    # Gemma 3 only: the Gemma3ForConditionalGeneration folder (text model under model.language_model,
    # plus a tiny SigLIP vision tower and projector), saved by transformers' save_pretrained
    multimodal: bool = False
    # phi3 (Phi-3 / 3.5 / 4): fused qkv_proj and gate_up_proj always; these set its options
    partial_rotary: float | None = None  # Phi-4-mini's partial_rotary_factor
    # sliding_window: Gemma's field above (config.json sliding_window; Phi-3-mini: 2047)
    longrope_original: int | None = None  # LongRoPE: original_max_position_embeddings, random factors
    # smollm3: every n-th layer NoPE (config.json no_rope_layer_interval; llama.cpp's GGUF: always 4)
    nope_interval: int | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch in ("qwen2", "gpt_oss")

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "gemma3_text", "qwen3_moe")

    @property
    def gemma(self) -> bool:
        return self.arch in GEMMA

    @property
    def rotary_dims(self) -> int:
        """Rotated dims of a head: transformers' int(head_dim * partial_rotary_factor)."""
        return int(self.hd * (self.partial_rotary or 1.0))

    def longrope_factors(self) -> tuple[list[float], list[float]]:
        """(short, long) LongRoPE divisors, one per rotated pair: different sets of realistic ranges
        (Phi-3's short ones ~1-2, long ones growing to ~tens), drawn from the seed."""
        g = torch.Generator().manual_seed(self.seed + 100)
        n = self.rotary_dims // 2
        short = 1 + torch.rand(n, generator=g)
        long = torch.cumsum(1 + 3 * torch.rand(n, generator=g), 0)
        return [round(float(x), 4) for x in short], [round(float(x), 4) for x in long]


# ---- tokenizer: a small byte-level BPE trained here, saved as tokenizer.json and as GGUF metadata

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
_CORPUS = """Once upon a time, there was a little girl named Emma who loved to play in the sun.
She would often go to the beach and play with her friends. One day, she decided to go to the park.
The quick brown fox jumps over the lazy dog. Hello world! 1234567890 tokens, weights and caches.
A model reads text as numbers; the tokenizer cuts words into pieces and the pieces into bytes.
Llama, Mistral, Qwen: attention heads, key and value heads, rotary position embeddings, norms."""


@cache
def tokenizer_json(vocab_size: int = 384) -> str:
    """A byte-level BPE (GPT-2 style) trained on a few lines: 256 byte tokens, merges, 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    return tok.to_str()


def vocab_and_merges() -> tuple[list[str], list[str]]:
    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def vocab_size() -> int:
    return len(vocab_and_merges()[0])


# ---- weights

def _storage_round(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values exactly representable in the storage dtype (so every format holds the same numbers)."""
    return t.to(getattr(torch, dtype)).float()


def make_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights with realistic scales (std 0.02-0.1; norm weights around 1)."""
    g = torch.Generator().manual_seed(spec.seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    C, F, D, V = spec.dim, spec.ffn_dim, spec.hd, vocab_size()
    qd, kvd = spec.n_heads * D, spec.n_kv_heads * D
    # Gemma's RMSNorm multiplies by 1 + w: its stored norm weights sit around 0, not 1
    one = 0.0 if spec.gemma else 1.0
    w = {"model.embed_tokens.weight": randn(V, C, std=0.1)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = one + randn(C, std=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(qd, C, std=0.1)
        w[p + "self_attn.k_proj.weight"] = randn(kvd, C, std=0.1)
        w[p + "self_attn.v_proj.weight"] = randn(kvd, C, std=0.1)
        w[p + "self_attn.o_proj.weight"] = randn(C, qd, std=0.08)
        if spec.arch == "gpt_oss":  # o_proj bias and attention sinks
            w[p + "self_attn.o_proj.bias"] = randn(C, std=0.05)
            w[p + "self_attn.sinks"] = randn(spec.n_heads, std=1.0)
        if spec.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = randn(qd, std=0.1)
            w[p + "self_attn.k_proj.bias"] = randn(kvd, std=0.1)
            w[p + "self_attn.v_proj.bias"] = randn(kvd, std=0.05)
        if spec.qk_norm:
            w[p + "self_attn.q_norm.weight"] = one + randn(D, std=0.1)
            w[p + "self_attn.k_norm.weight"] = one + randn(D, std=0.1)
        # Llama: the MLP's input norm; Gemma: the attention output's norm (then pre_feedforward_layernorm)
        w[p + "post_attention_layernorm.weight"] = one + randn(C, std=0.1)
        if spec.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = randn(C, std=0.1)
            w[p + "post_feedforward_layernorm.weight"] = randn(C, std=0.1)
        if spec.n_experts:
            w |= moe_weights(spec, p, randn)
            continue
        w[p + "mlp.gate_proj.weight"] = randn(F, C, std=0.1)
        w[p + "mlp.up_proj.weight"] = randn(F, C, std=0.1)
        w[p + "mlp.down_proj.weight"] = randn(C, F, std=0.08)
    w["model.norm.weight"] = one + randn(C, std=0.1)
    if not spec.tied:
        w["lm_head.weight"] = randn(V, C, std=0.1)
    if spec.arch == "phi3":
        w = fuse_phi3(w, spec.n_layers)
    return {k: _storage_round(v, spec.storage_dtype) for k, v in w.items()}


def fuse_phi3(w: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Phi-3's checkpoint layout: q|k|v rows in self_attn.qkv_proj, gate|up rows (gate first, as
    Phi3MLP chunks them) in mlp.gate_up_proj."""
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    return w


# ---- Hugging Face folder

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


# ---- GGUF, as convert_hf_to_gguf.py writes it

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


def _add_tensor(w: gguf.GGUFWriter, name: str, raw: np.ndarray, t: Q) -> None:
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
        _add_tensor(w, name, *data_t)
    w.write_header_to_file(path if split_max_tensors else None)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]


# ---- mixture of experts (Mixtral, Qwen3-MoE)

# HF model_type -> (router, per-expert gate / up / down) names under model.layers.N., as real
# checkpoints and transformers 5's save_pretrained store them
MOE_HF_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}


def moe_weights(spec: TinySpec, p: str, randn) -> dict[str, torch.Tensor]:
    """One layer's router and experts (HF names with prefix p); a router of std 0.5 spreads the
    tokens over the experts (tests/test_moe.py checks)."""
    C, F, E = spec.dim, spec.expert_ffn_dim, spec.n_experts
    if spec.arch == "gpt_oss":  # GptOssMLP: router with bias; experts stacked, x @ W, gate/up interleaved
        return {p + "mlp.router.weight": randn(E, C, std=0.5), p + "mlp.router.bias": randn(E, std=0.2),
                p + "mlp.experts.gate_up_proj": randn(E, C, 2 * F, std=0.15),
                p + "mlp.experts.gate_up_proj_bias": randn(E, 2 * F, std=0.1),
                p + "mlp.experts.down_proj": randn(E, F, C, std=0.08),
                p + "mlp.experts.down_proj_bias": randn(E, C, std=0.05)}
    router, gate, up, down = MOE_HF_NAMES[spec.arch]
    w = {p + router + ".weight": randn(E, C, std=0.5)}
    for e in range(E):
        w[p + gate.format(e=e) + ".weight"] = randn(F, C, std=0.1)
        w[p + up.format(e=e) + ".weight"] = randn(F, C, std=0.1)
        w[p + down.format(e=e) + ".weight"] = randn(C, F, std=0.08)
    return w


def moe_hf_config(spec: TinySpec) -> dict:
    if spec.arch == "gpt_oss":
        return {"num_local_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "intermediate_size": spec.expert_ffn_dim, "attention_bias": True, "swiglu_limit": 7.0,
                "sliding_window": spec.sliding_window, "router_aux_loss_coef": 0.0,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.n_layers)]}
    if spec.arch == "mixtral":
        return {"num_local_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "intermediate_size": spec.expert_ffn_dim, "router_jitter_noise": 0.0, "sliding_window": None}
    if spec.arch == "qwen3_moe":
        return {"num_experts": spec.n_experts, "num_experts_per_tok": spec.n_experts_used,
                "moe_intermediate_size": spec.expert_ffn_dim, "norm_topk_prob": spec.norm_topk,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                "use_sliding_window": False}
    return {}


def gpt_oss_converted(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GptOssModel.modify_tensors / filter_tensors (non-MXFP4 experts): sinks get `.weight`; gate_up_proj
    (E, C, 2F) transposed and split into its interleaved gate (even) and up (odd) rows; down_proj (E, F, C)
    transposed; the biases renamed (gate/up split alike). Other names pass through."""
    out = {}
    for name, t in weights.items():
        if name.endswith("self_attn.sinks"):
            out[name + ".weight"] = t
        elif name.endswith("experts.gate_up_proj"):
            t = t.transpose(-1, -2)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = t[:, 0::2].contiguous()
            out[name.replace("gate_up_proj", "up_proj.weight")] = t[:, 1::2].contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[..., 0::2].contiguous()
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[..., 1::2].contiguous()
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = t.transpose(-1, -2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        else:
            out[name] = t
    return out


def split_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """blk.N.ffn_gate_exps.weight (E, F, C) -> [(blk.N.ffn_gate.E.weight, (F, C)), ...]; others as they are."""
    m = re.match(r"^(blk\.\d+\.ffn_(?:gate|up|down))_exps\.weight$", name)
    return [(f"{m.group(1)}.{e}.weight", data[e]) for e in range(data.shape[0])] if m else [(name, data)]


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors `...experts.{e}.NAME.weight` -> one (E, ...) tensor `...experts.NAME.weight`,
    as the converter merges them (the name gguf's TensorNameMap maps to ffn_*_exps)."""
    out, experts = {}, {}
    for name, t in weights.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(.*)$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


# ---- raw blocks for the types gguf.quants cannot quantize (the K-quants)

# type -> byte offsets of the fp16 scale fields inside one block (ggml-common.h block_qN_K).
K_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
}


# type -> largest |sub-block scale x quant| a block can reach; super-block scales are drawn so that
# decoded values stay below ~0.3 (realistic weights, finite logits).
K_RANGE = {Q.Q2_K: 15 * 3, Q.Q3_K: 32 * 4, Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 128 * 32}


def raw_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks whose fp16 scales are finite and small."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    top = 0.3 / K_RANGE[qtype]
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.3 * top, top, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * nbytes)


def random_tensor_data(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF data of one tensor of this type: quantized by gguf where it can, else raw blocks."""
    if qtype in K_SCALE_OFFSETS:
        return raw_blocks(qtype, rows, cols, rng)
    return encode_exact((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)


def encode_exact(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x (rows, cols) fp32 in this type's raw GGUF form (gguf.quants where it is not plain numpy)."""
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):  # gguf cannot quantize them: ours, llama.cpp's bytes (tests/test_iq4.py)
        from localllm.quantize import quantize_tensor

        return quantize_tensor(torch.from_numpy(np.ascontiguousarray(x, np.float32)), qtype)
    return gguf.quants.quantize(x, qtype)


def write_raw_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A GGUF holding only these (raw data, type) tensors, no model metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, t) in tensors.items():
        _add_tensor(w, name, raw, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- a model whose 2-D tensors use every tensor type the runtime reads

ALL_TYPES = [Q[n] for n in "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K MXFP4 IQ4_NL IQ4_XS".split()]
# Rows of 256 values so that K-quant super-blocks fit; 2 layers give 16 matrices for 16 types.
MIXED = TinySpec("llama", dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, seed=6)


def mixed_type_raw(spec: TinySpec, seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF name -> (raw data, type): the i-th 2-D tensor takes ALL_TYPES[i % 16]; the model's own
    (already permuted) weights encoded where gguf can quantize the type, random blocks for K-quants."""
    rng = np.random.default_rng(seed)
    two_d = [(name, data) for name, data in gguf_tensors(spec).items() if data.ndim == 2]
    out = {}
    for i, (name, data) in enumerate(two_d):
        t = ALL_TYPES[i % len(ALL_TYPES)]
        out[name] = (raw_blocks(t, *data.shape, rng) if t in K_SCALE_OFFSETS else encode_exact(data, t), t)
    return out


# ---- the cases the tests use

CASES: dict[str, TinySpec] = {
    # Llama 2 style: untied output, sharded f32 safetensors.
    "llama": TinySpec("llama", shards=2, seed=1),
    # Mistral (Nemo style head_dim != dim / heads), untied, f16 safetensors.
    "mistral": TinySpec("mistral", head_dim=32, storage_dtype="float16", seed=2),
    # Qwen2(.5) small: q/k/v bias, tied output.
    "qwen2": TinySpec("qwen2", tied=True, norm_eps=1e-6, rope_theta=1e6, seed=3),
    # Qwen3: q/k norm, head_dim 32 (explicit, != dim / heads), untied.
    "qwen3": TinySpec("qwen3", head_dim=32, norm_eps=1e-6, rope_theta=1e6, seed=4),
    # Llama 3.2 style: tied, llama3 rope scaling with a short original context so all three
    # frequency bands (kept, smoothed, divided by factor) occur within head_dim 16.
    "llama3": TinySpec("llama", tied=True, rope_theta=10000.0, seed=5, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    # Llama 2 style linear rope scaling ("rope_type": "linear", GGUF rope.scaling.type / factor).
    "llama_linear": TinySpec("llama", seed=9, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
# Mixture of experts (tests/test_moe.py): Mixtral 8 experts top-2 (its GGUF says `llama`), Qwen3-MoE
# 16 experts top-4 with norm_topk_prob, and without. Expert widths a multiple of 32 (Q8_0 rows of
# ffn_down_exps) and of 8 (the CPU's 8-row tiles: each expert starts on a tile).
MOE_CASES: dict[str, TinySpec] = {
    "mixtral": TinySpec("mixtral", ffn_dim=64, n_experts=8, n_experts_used=2, expert_ffn_dim=64, seed=11),
    "qwen3_moe": TinySpec("qwen3_moe", head_dim=32, norm_eps=1e-6, rope_theta=1e6, n_experts=16, n_experts_used=4,
                          expert_ffn_dim=32, seed=12),
    # gpt-oss: sinks, q/k/v/o biases, sliding window 4 on layers 0 and 2, YaRN (short original context:
    # the ramp spans the 8 frequencies of head_dim 16), 8 experts top-2 with biases, clamped SwiGLU.
    "gpt_oss": TinySpec("gpt_oss", n_layers=3, head_dim=16, n_heads=4, n_kv_heads=2, rope_theta=150000.0,
                        context_length=131072, sliding_window=4,
                        n_experts=8, n_experts_used=2, expert_ffn_dim=32, seed=14, rope_scaling={
                            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "original_max_position_embeddings": 4096, "truncate": False}),
    "qwen3_moe_nonorm": TinySpec("qwen3_moe", n_experts=16, n_experts_used=4, expert_ffn_dim=32, norm_topk=False,
                                 tied=True, seed=13),
}

# The same qwen2 weights rounded to bf16 and stored as bf16.
CASES["qwen2_bf16"] = replace(CASES["qwen2"], storage_dtype="bfloat16")

# Families beyond the Llama layer (issue 19), looked up with CASES by case_spec.
FAMILY_CASES: dict[str, TinySpec] = {}
# Gemma 2: post norms, gelu-tanh, head_dim 32 != dim / heads (as in the real 2304 / 8 vs 256),
# every other layer sliding with a window of 5 (the prompts are 16 long), soft-caps low enough
# (attention scores 2.0, logits 3.0) that they change the logits, tied output.
FAMILY_CASES["gemma2"] = TinySpec("gemma2", n_layers=4, head_dim=32, tied=True, norm_eps=1e-6,
                                  sliding_window=5, attn_softcap=2.0, final_softcap=3.0, seed=7)
# The same with query_pre_attn_scalar != head_dim (the 27B models'): GGUF can't say it (llama.cpp
# derives the scale from the block count), so safetensors only.
FAMILY_CASES["gemma2_qscale"] = replace(FAMILY_CASES["gemma2"], query_pre_attn_scalar=24)
# Gemma 3 (4B style): q/k norm, 6 layers (5 sliding with window 5, the 6th global), rope bases 1e6
# (global) and 1e4 (sliding), linear rope scaling 4 on the global layer, no soft-caps, tied output.
FAMILY_CASES["gemma3"] = TinySpec("gemma3_text", n_layers=6, head_dim=32, tied=True, norm_eps=1e-6,
                                  sliding_window=5, rope_theta=1e6, seed=8,
                                  rope_scaling={"rope_type": "linear", "factor": 4.0})
# The same weights rounded to bf16 and stored as bf16 (the norm offset is added in fp32, as
# transformers' 1 + w.float()).
FAMILY_CASES["gemma3_bf16"] = replace(FAMILY_CASES["gemma3"], storage_dtype="bfloat16")
# The same weights in a Gemma3ForConditionalGeneration checkpoint (safetensors only: the converter
# writes the text model's GGUF, the same file as gemma3's).
FAMILY_CASES["gemma3_mm"] = replace(FAMILY_CASES["gemma3"], multimodal=True)


def case_spec(case: str) -> TinySpec:
    for table in (CASES, FAMILY_CASES, PHI_CASES):
        if case in table:
            return table[case]
    raise KeyError(case)


# Phi-3 / Phi-4 (`phi3`) and SmolLM3 cases (tests/test_phi3_smollm3.py).
PHI_CASES: dict[str, TinySpec] = {
    # Phi-3-mini 128k style: fused tensors, LongRoPE (short != long factors) with an original context of 8
    # (the tests' 16-token prompts run the long set, 8-token ones the short set), a sliding window of 5.
    "phi3": TinySpec("phi3", seed=7, longrope_original=8, sliding_window=5),
    # Phi-4-mini shaped: partial rotary 0.75 (rotated dims 12 of head_dim 16), LongRoPE, tied, no window.
    "phi4mini": TinySpec("phi3", seed=8, partial_rotary=0.75, longrope_original=8, tied=True),
    # SmolLM3: tied, 4 layers with the 4th NoPE (llama.cpp's fixed step, so the GGUF says the same).
    "smollm3": TinySpec("smollm3", n_layers=4, tied=True, rope_theta=5e5, seed=9, nope_interval=4),
    # SmolLM3 with every 2nd layer NoPE: config.json only (llama.cpp's GGUF cannot say it), untied.
    "smollm3_nope2": TinySpec("smollm3", n_layers=4, seed=10, nope_interval=2),
}


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-3) -> None:
    """Our logits against the oracle's: same shape, max abs difference <= tol, and a reference that is
    not degenerate (random weights of realistic scale give logits spread over about +-3)."""
    assert ours.shape == ref.shape
    assert ref.std() > 0.1 and torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"
