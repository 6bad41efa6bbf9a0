"""The shape of one tiny test model (TinySpec) and the architecture tables its writers use
(tiny_hf.py, tiny_gguf.py); tiny_models.py holds the cases the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
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
