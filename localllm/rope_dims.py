"""Rope's dimensions and Phi-3's rope-factor tensor names, without torch: what check_gguf
(localllm/validate.py) needs, so that `localllm quantize`'s torch-free preset path validates its input
as the loader does (rope.py and config_phi3.py re-export them)."""

from __future__ import annotations

# No import of .config: config_gguf.py / config_hf.py call into config_phi3.py, which imports this module; cfg parameters
# are config.ModelConfig values.

# Phi-3 (LongRoPE): the per-dim factor tensors a GGUF holds (config_phi3.py).
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def rotary_dims(cfg) -> int:
    """R of the global rope set: the leading dims of each head that rope rotates (partial rotary:
    Phi-4-mini; Gemma 4: its full layers' head dim)."""
    return cfg.rotary_dim or cfg.head_dim_global or cfg.head_dim


def local_rotary_dims(cfg) -> int:
    """R of the local (sliding layers') rope set: their head dim, Gemma 4's differing from the global one."""
    return cfg.rotary_dim or cfg.head_dim
