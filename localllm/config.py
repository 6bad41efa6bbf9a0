"""One frozen dataclass describes every architecture we run, built from GGUF metadata or config.json.

Llama, Mistral, Qwen2 and Qwen3 differ only by fields here (qkv bias, q/k norm, rope scaling, tied
output), never by subclasses: the model module reads these fields and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

# GGUF `general.architecture` / HF `model_type` -> the fields that distinguish it.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
    "gemma2": dict(qkv_bias=False, qk_norm=False),
    "gemma3": dict(qkv_bias=False, qk_norm=True),
    "phi3": dict(qkv_bias=False, qk_norm=False),  # Phi-3, 3.5, 4 (config_phi3.py)
    "smollm3": dict(qkv_bias=False, qk_norm=False),
    # mixture of experts (moe_config.py); Mixtral's GGUF says `llama`
    "mixtral": dict(qkv_bias=False, qk_norm=False),
    "qwen3moe": dict(qkv_bias=False, qk_norm=True),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True),
    "gpt-oss": dict(qkv_bias=True, qk_norm=False),
    "gpt_oss": dict(qkv_bias=True, qk_norm=False),
    "gemma4": dict(qkv_bias=False, qk_norm=True),  # read by gemma4.py (validate.py picks it), not here
}


# Architectures whose configs have a reader of their own (it imports this module): arch -> file.
OWN_READERS = {"gemma4": "gemma4.py"}


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling; factor 1 means none. kind "llama3": Llama 3.x's banded divisors
    (low/high_freq_factor); kind "linear": every frequency divided by factor (HF "linear", GGUF
    rope.scaling.type "linear": positions / factor); kind "yarn": beta_fast/slow, and truncate (the
    correction range rounded outwards to whole dims: transformers' default and llama.cpp's rule;
    gpt-oss says false). localllm/rope.py turns it into divisors."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_output: bool = False
    rope_scaling: RopeScaling | None = None
    # --- families beyond Llama (issue 19): every default is Llama's, so a Llama config sets none ---
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(dim))
    activation: str = "silu"  # the GLU's gate function: "silu", "gelu_tanh" (Gemma), "swiglu_oai" (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss clamps gate and up to this before its GLU
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add (Gemma 2/3/4)
    attn_scale: float | None = None  # scores times this; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2/3/4)
    attn_out_bias: bool = False  # attn_output has a bias (gpt-oss)
    attn_sinks: bool = False  # one learned logit per head joins each softmax, then is dropped (gpt-oss)
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    # per layer, True where attention slides (a window); () = no sliding layers
    sliding_layers: tuple[bool, ...] = ()
    rope_theta_local: float | None = None  # rope base of sliding layers (Gemma 3); None: rope_theta
    # per layer, False where the layer has no rope (SmolLM3's NoPE layers); () = rope everywhere
    rope_layers: tuple[bool, ...] = ()
    rotary_dim: int | None = None  # dims of a head that rope rotates (Phi-4-mini: 3/4); None: head_dim
    rope_attn_factor: float = 1.0  # cos and sin of the global rope set times this (YaRN, LongRoPE)
    # LongRoPE (config_phi3.py): the model holds rope_factors_short / rope_factors_long divisors and uses
    # the long ones when the context in use (the KV cache's capacity) exceeds this; None: no LongRoPE
    rope_original_context: int | None = None
    # mixture of experts (Mixtral, Qwen3-MoE, gpt-oss); n_experts 0 = a dense MLP in every layer
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    moe_norm_topk: bool = True  # the chosen experts' softmax weights renormalised to sum to 1
    moe_bias: bool = False  # router and expert products have biases (gpt-oss)
    # "softmax": top-k of softmax(router logits) (Mixtral, Qwen3-MoE); "topk_softmax": top-k of the
    # logits, softmax over those k (gpt-oss) (localllm/moe.py route)
    moe_gating: str = "softmax"
    # --- Gemma 4 (gemma4.py reads them from config.json / GGUF): layers of two shapes, shared caches, PLE
    head_dim_global: int | None = None  # head dim of the non-sliding layers (global_head_dim); None: head_dim
    n_kv_heads_global: int | None = None  # kv heads of the non-sliding layers; None: n_kv_heads
    attn_k_eq_v: bool = False  # non-sliding layers have no attn_v: values are the key projection
    attn_v_norm: bool = False  # values RMS-normalised (no weight) before the cache
    # fraction of the global rope set's frequencies that rotate ("proportional" rope: the others are 0,
    # the exponent still over the whole head; GGUF's rope_freqs carries it as divisors 1e30)
    rope_partial_global: float = 1.0
    n_kv_shared_layers: int = 0  # the last N layers read the cache of the last earlier layer of their kind
    double_wide_mlp: bool = False  # KV-shared layers have an MLP of 2 * ffn_dim
    per_layer_dim: int = 0  # per-layer embeddings (PLE): width of each layer's input; 0 = none
    layer_out_scale: bool = False  # each layer's output (residual included) times a learned scalar
    moe_with_mlp: bool = False  # experts beside the dense MLP, with their own norms (Gemma 4: gemma4_moe.py)

    def sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def has_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def layer_head_dim(self, layer: int) -> int:
        """Head dim of this layer (Gemma 4: global_head_dim on non-sliding layers)."""
        return self.head_dim_global if self.head_dim_global and not self.sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.n_kv_heads_global if self.n_kv_heads_global and not self.sliding(layer) else self.n_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose cache rows this layer attends to: itself, or for one of the last
        n_kv_shared_layers the last earlier layer of its kind (sliding or not), as transformers'
        Gemma4TextConfig.kv_sharing_modes and llama.cpp's n_layer_kv_from_start pick it."""
        first = self.n_layers - self.n_kv_shared_layers
        if layer < first:
            return layer
        return max(j for j in range(first) if self.sliding(j) == self.sliding(layer))

    def layer_ffn_dim(self, layer: int) -> int:
        return 2 * self.ffn_dim if self.double_wide_mlp and self.kv_source(layer) != layer else self.ffn_dim

    @property
    def uniform_kv(self) -> bool:
        """Every layer has its own cache of one shape (one (L, B, Hkv, S, D) buffer serves)."""
        return not self.n_kv_shared_layers and self.head_dim_global in (None, self.head_dim) and \
            self.n_kv_heads_global in (None, self.n_kv_heads)

    @property
    def llama_layer(self) -> bool:
        """True when every layer is the Llama layer the fast decoders (C++, CUDA graphs) implement:
        none of the fields above set. Backends run other configs on the portable torch forward."""
        return self == replace(self, **{f.name: f.default for f in fields(ModelConfig) if f.name in FAMILY_FIELDS})

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


# The fields of issue 19's families (ModelConfig.llama_layer: all at their defaults).
FAMILY_FIELDS = frozenset({
    "embed_scale", "activation", "swiglu_limit", "post_norms", "attn_scale", "attn_softcap", "final_softcap",
    "attn_out_bias", "attn_sinks", "sliding_window", "sliding_layers", "rope_theta_local", "rope_layers",
    "rotary_dim", "rope_attn_factor", "n_experts", "n_experts_used", "expert_ffn_dim", "moe_norm_topk", "moe_bias",
    "rope_original_context", "moe_gating",
    "head_dim_global", "n_kv_heads_global", "attn_k_eq_v", "attn_v_norm", "rope_partial_global",
    "n_kv_shared_layers", "double_wide_mlp", "per_layer_dim", "layer_out_scale", "moe_with_mlp",
})
