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

The pieces: tiny_spec.py (TinySpec), tiny_tokenizer.py, tiny_weights.py, tiny_moe.py (experts),
tiny_hf.py (write_hf_folder), tiny_gguf.py (write_gguf), tiny_raw.py (raw data of every tensor type);
this module holds the cases the tests use.

Nothing here imports localllm: these files are the inputs both we and transformers load.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tiny_spec import TinySpec

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

# A model whose 2-D tensors use every tensor type the runtime reads (tiny_raw.mixed_type_raw). Rows of
# 256 values so that K-quant super-blocks fit; 2 layers give 16 matrices for 16 types.
MIXED = TinySpec("llama", dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, seed=6)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-3) -> None:
    """Our logits against the oracle's: same shape, max abs difference <= tol, and a reference that is
    not degenerate (random weights of realistic scale give logits spread over about +-3)."""
    assert ours.shape == ref.shape
    assert ref.std() > 0.1 and torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"
