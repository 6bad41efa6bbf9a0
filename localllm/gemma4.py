"""Gemma 4 text models: their ModelConfig from config.json or GGUF metadata, and their tensor names.

References: transformers 5.24 models/gemma4 (Gemma4TextConfig, Gemma4TextModel: the oracle) and
llama.cpp's converter (conversion/gemma.py Gemma4Model: the GGUF keys and tensors) and
src/models/gemma4*.cpp. What a Gemma 4 layer differs by (config.py's Gemma 4 fields):
- two layer kinds (layer_types): sliding layers with head_dim / num_key_value_heads and the default
  rope (rope_parameters.sliding_attention), full layers with global_head_dim (and, where
  attention_k_eq_v, num_global_key_value_heads) and "proportional" rope (partial_rotary_factor of the
  frequencies rotate, exponents over the whole head);
- attention_k_eq_v: full layers have no v_proj, values are the key projection;
- q/k norms with weights, a value norm without; scores scaled by 1 (no 1/sqrt(d));
- norms multiply by w itself (Gemma4RMSNorm; llama.cpp's converter stores them unchanged, norm_shift 0);
- the last num_kv_shared_layers layers have no k/v: they attend to the cache of the last earlier layer
  of their kind; use_double_wide_mlp doubles those layers' MLP;
- per-layer embeddings (hidden_size_per_layer_input), a layer_scalar on each layer's output.
The released multimodal checkpoints (model_type "gemma4") hold the text model under text_config and
`model.language_model.`; the vision and audio towers are skipped.
"""

from __future__ import annotations

import math
from typing import Any

import gguf

from .config import ModelConfig
from .config_fields import MISSING, Fields, check_shape_fields
from .errors import LocalLLMError
from .settings import DEFAULT_LIMITS, LoaderLimits

ARCH = "gemma4"
SLIDING, FULL = "sliding_attention", "full_attention"
MAX_EXPERTS = 1 << 12  # experts a layer may claim (26B-A4B has 128)
# Checkpoint keys of the multimodal model that are not the text model (llama.cpp's mmproj holds them).
_OTHER_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                 "model.multi_modal_projector.")


def _layer_types(f: Fields, n_layers: int) -> list[str]:
    """layer_types, or transformers' default (5 sliding : 1 full); the last layer is always full."""
    types = f.raw("layer_types", None)
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise f.bad("layer_types", types, f"a list of {n_layers} of {SLIDING!r} / {FULL!r}")
    return types[:-1] + [FULL]  # Gemma4TextConfig forces the last layer to full attention


def _rope_set(cfg: dict, kind: str, default: dict) -> dict:
    rp = cfg.get("rope_parameters")
    rp = rp.get(kind, default) if isinstance(rp, dict) else default
    if not isinstance(rp, dict):
        raise LocalLLMError(f"config.json 'rope_parameters.{kind}' is {rp!r}, expected an object")
    return rp


def _full_layer_shape(f: Fields, cfg: dict, types: list[str], head_dim: int, n_kv: int, n_heads: int,
                      k_eq_v: bool, limits: LoaderLimits) -> tuple[int, int]:
    """(head dim, kv heads) of the full layers: from per_layer_config (what transformers 5.24 saves) or
    global_head_dim / num_global_key_value_heads (the released configs; the kv heads count only with
    attention_k_eq_v, as Gemma4TextConfig.__post_init__ has it)."""
    plc = cfg.get("per_layer_config")
    if plc is None:
        hd = f.int("global_head_dim", 2, limits.max_dim, 512)
        kv = f.int("num_global_key_value_heads", 1, n_heads, n_kv) if k_eq_v else n_kv
        return hd, kv
    if not isinstance(plc, dict):
        raise f.bad("per_layer_config", plc, "an object (layer -> overrides)")
    shapes = set()
    for i, kind in enumerate(types):
        over = plc.get(str(i), plc.get(i, {}))
        o = Fields(over if isinstance(over, dict) else {}, "config.json", label=f"per_layer_config.{i}.")
        if set(over) - {"head_dim", "num_key_value_heads"}:
            raise f.bad(f"per_layer_config.{i}", over, "overrides of head_dim / num_key_value_heads only")
        shape = (o.int("head_dim", 2, limits.max_dim, head_dim), o.int("num_key_value_heads", 1, n_heads, n_kv))
        if kind == SLIDING and shape != (head_dim, n_kv):
            raise f.bad(f"per_layer_config.{i}", over, "no override on a sliding layer")
        if kind == FULL:
            shapes.add(shape)
    if len(shapes) > 1:
        raise f.bad("per_layer_config", plc, "one shape for every full-attention layer")
    return shapes.pop() if shapes else (head_dim, n_kv)


def gemma4_config_from_hf(cfg: dict[str, Any], limits: LoaderLimits = DEFAULT_LIMITS) -> ModelConfig:
    """config.json of Gemma4ForCausalLM (model_type gemma4_text) or of the multimodal model (gemma4:
    its text_config) -> ModelConfig, every field type- and range-checked (transformers' defaults)."""
    if cfg.get("model_type") == "gemma4":
        cfg = cfg.get("text_config")
        if not isinstance(cfg, dict):
            raise LocalLLMError("config.json of a gemma4 model has no 'text_config' object")
    f = Fields(cfg, "config.json")
    # "vision": image tokens see each other both ways, text stays causal (all we run); "all": an encoder
    if f.raw("use_bidirectional_attention", None) not in (None, "vision"):
        raise f.bad("use_bidirectional_attention", cfg["use_bidirectional_attention"], "null or 'vision' (causal text)")
    if f.raw("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise f.bad("hidden_activation", cfg["hidden_activation"], "'gelu_pytorch_tanh'")
    if f.bool("attention_bias", False):
        raise f.bad("attention_bias", True, "false")
    n_layers = f.int("num_hidden_layers", 1, limits.max_layers, 30)
    dim = f.int("hidden_size", 1, limits.max_dim, 2304)
    n_heads = f.int("num_attention_heads", 1, limits.max_heads, 8)
    n_kv = f.int("num_key_value_heads", 1, n_heads, 4)
    head_dim = f.int("head_dim", 2, limits.max_dim, 256)
    vocab = f.int("vocab_size", 1, limits.max_vocab, 262144)
    types = _layer_types(f, n_layers)
    k_eq_v = f.bool("attention_k_eq_v", False)
    hd_full, kv_full = _full_layer_shape(f, cfg, types, head_dim, n_kv, n_heads, k_eq_v, limits)
    local = _rope_set(cfg, SLIDING, {"rope_type": "default", "rope_theta": 10000.0})
    glob = _rope_set(cfg, FULL, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    if local.get("rope_type", "default") != "default":
        raise LocalLLMError(f"config.json rope_parameters.{SLIDING}.rope_type {local.get('rope_type')!r}: only 'default'")
    if glob.get("rope_type") not in ("proportional", "default") or glob.get("factor", 1.0) != 1.0:
        raise LocalLLMError(f"config.json rope_parameters.{FULL}: only 'proportional' or 'default' without a factor")
    lf, gf = (Fields(r, "config.json", label=f"rope_parameters.{k}.") for r, k in ((local, SLIDING), (glob, FULL)))
    partial = gf.float("partial_rotary_factor", 1.0) if glob.get("rope_type") == "proportional" else 1.0
    if partial > 1.0:
        raise gf.bad("partial_rotary_factor", partial, "at most 1")
    n_shared = f.int("num_kv_shared_layers", 0, n_layers - 1, 0)
    ple = f.int("hidden_size_per_layer_input", 0, limits.max_dim, 256)
    if ple and f.int("vocab_size_per_layer_input", 1, limits.max_vocab, 262144) != vocab:
        raise f.bad("vocab_size_per_layer_input", cfg.get("vocab_size_per_layer_input", 262144), f"vocab_size {vocab}")
    softcap = f.float("final_logit_softcapping", None) if cfg.get("final_logit_softcapping") is not None else None
    out = ModelConfig(
        arch=ARCH, n_layers=n_layers, dim=dim, ffn_dim=f.int("intermediate_size", 1, limits.max_ffn_dim, 9216),
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=vocab,
        context_length=f.int("max_position_embeddings", 1, limits.max_context, 131072),
        norm_eps=f.float("rms_norm_eps", 1e-6), rope_theta=gf.float("rope_theta", 1e6),
        qkv_bias=False, qk_norm=True, tied_output=f.bool("tie_word_embeddings", True),
        **_common_fields(dim, types, f.int("sliding_window", 1, limits.max_context, 512)),
        rope_theta_local=lf.float("rope_theta", 10000.0), final_softcap=softcap,
        head_dim_global=hd_full, n_kv_heads_global=kv_full, attn_k_eq_v=k_eq_v, rope_partial_global=partial,
        n_kv_shared_layers=n_shared, double_wide_mlp=f.bool("use_double_wide_mlp", False), per_layer_dim=ple,
        layer_out_scale=True, **_hf_moe(f, n_layers, limits),
    )
    return _checked(out, "config.json", limits)


def _hf_moe(f: Fields, n_layers: int, limits: LoaderLimits) -> dict:
    """enable_moe_block: every layer has num_experts experts of moe_intermediate_size, top_k_experts used."""
    if not f.bool("enable_moe_block", False):
        return {}
    n = f.int("num_experts", 1, MAX_EXPERTS)
    return dict(moe_with_mlp=True, n_experts=n, n_experts_used=f.int("top_k_experts", 1, n),
                expert_ffn_dim=f.int("moe_intermediate_size", 1, limits.max_ffn_dim))


def _common_fields(dim: int, types: list[str], window: int) -> dict:
    """What every Gemma 4 layer has, whatever the checkpoint says."""
    return dict(embed_scale=math.sqrt(dim), activation="gelu_tanh", post_norms=True, attn_scale=1.0,
                attn_v_norm=True, sliding_window=window, sliding_layers=tuple(t == SLIDING for t in types))


def _checked(cfg: ModelConfig, source: str, limits: LoaderLimits) -> ModelConfig:
    names = dict(n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", head_dim="head_dim")
    check_shape_fields(cfg, names, source, limits)
    if cfg.n_heads % cfg.n_kv_heads_global or cfg.head_dim_global % 2:
        raise LocalLLMError(f"{source}: full-attention layers' {cfg.n_kv_heads_global} kv heads of"
                            f" {cfg.head_dim_global} do not fit {cfg.n_heads} query heads / rope pairs")
    if cfg.n_heads * cfg.head_dim_global > limits.max_dim:
        raise LocalLLMError(f"{source}: {cfg.n_heads} heads of {cfg.head_dim_global} exceed {limits.max_dim}")
    first = cfg.n_layers - cfg.n_kv_shared_layers
    kinds = {cfg.sliding(i) for i in range(cfg.n_layers)}
    if {cfg.sliding(i) for i in range(first)} != kinds:
        raise LocalLLMError(f"{source}: the {cfg.n_kv_shared_layers} KV-shared layers need an earlier layer of"
                            " each of their kinds (sliding, full) to read")
    return cfg


# ---- GGUF (llama.cpp's converter: Gemma4Model.set_gguf_parameters)


def _per_layer(f: Fields, key: str, n_layers: int, lo: int, hi: int, default: Any = MISSING) -> list[int]:
    """An integer key llama.cpp writes as one value or one per layer -> per layer."""
    value = f.raw(key, default)
    if isinstance(value, list):
        if len(value) != n_layers:
            raise f.bad(key, value, f"{n_layers} values (one per layer)")
        sub = Fields({str(i): v for i, v in enumerate(value)}, f.source, label=f"{f.label}{key}[")
        return [sub.int(str(i), lo, hi) for i in range(n_layers)]
    return [f.int(key, lo, hi, default)] * n_layers


def _by_kind(f: Fields, key: str, values: list[int], sliding: list[bool]) -> tuple[int, int]:
    """(sliding, full) value of a per-layer list that must be constant within each kind."""
    out = []
    for kind in (True, False):
        got = {v for v, s in zip(values, sliding) if s == kind}
        if len(got) > 1:
            raise f.bad(key, values, "one value per layer kind (sliding, full)")
        out.append(got.pop() if got else None)
    s, g = out
    return (s if s is not None else g), (g if g is not None else s)


def gemma4_config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                            limits: LoaderLimits = DEFAULT_LIMITS) -> ModelConfig:
    """GGUF metadata `gemma4.*` (and which tensors exist: v_proj-less layers, layer scalars) -> ModelConfig."""
    f = Fields(meta, "GGUF metadata", f"{ARCH}.")
    k = gguf.Keys
    key = lambda template: template.format(arch=ARCH).removeprefix(f"{ARCH}.")  # noqa: E731
    n_layers = f.int(key(k.LLM.BLOCK_COUNT), 1, limits.max_layers)
    dim = f.int(key(k.LLM.EMBEDDING_LENGTH), 1, limits.max_dim)
    n_heads = f.int(key(k.Attention.HEAD_COUNT), 1, limits.max_heads)
    pattern = f.raw(key(k.Attention.SLIDING_WINDOW_PATTERN))
    if not isinstance(pattern, list) or len(pattern) != n_layers or any(not isinstance(b, bool) for b in pattern):
        raise f.bad(key(k.Attention.SLIDING_WINDOW_PATTERN), pattern, f"{n_layers} booleans (true: sliding)")
    kv_heads = _per_layer(f, key(k.Attention.HEAD_COUNT_KV), n_layers, 1, n_heads, n_heads)
    kv_swa, kv_full = _by_kind(f, key(k.Attention.HEAD_COUNT_KV), kv_heads, pattern)
    hd_full = f.int(key(k.Attention.KEY_LENGTH), 2, limits.max_dim)
    hd_swa = f.int(key(k.Attention.KEY_LENGTH_SWA), 2, limits.max_dim)
    for vkey, want in ((k.Attention.VALUE_LENGTH, hd_full), (k.Attention.VALUE_LENGTH_SWA, hd_swa)):
        if f.raw(key(vkey), want) != want:
            raise f.bad(key(vkey), meta[vkey.format(arch=ARCH)], f"{want} (the key length)")
    n_shared = f.int(key(k.Attention.SHARED_KV_LAYERS), 0, n_layers - 1, 0)
    ffn = _per_layer(f, key(k.LLM.FEED_FORWARD_LENGTH), n_layers, 1, limits.max_ffn_dim)
    first = n_layers - n_shared
    double = ffn[-1] == 2 * ffn[0] and n_shared > 0
    want = [ffn[0] * (2 if double and i >= first else 1) for i in range(n_layers)]
    if ffn != want:
        raise f.bad(key(k.LLM.FEED_FORWARD_LENGTH), ffn, "one length (twice it on KV-shared layers: double-wide MLP)")
    moe = {}
    if f.raw(key(k.LLM.EXPERT_COUNT), 0):
        n = f.int(key(k.LLM.EXPERT_COUNT), 1, MAX_EXPERTS)
        moe = dict(moe_with_mlp=True, n_experts=n, n_experts_used=f.int(key(k.LLM.EXPERT_USED_COUNT), 1, n),
                   expert_ffn_dim=f.int(key(k.LLM.EXPERT_FEED_FORWARD_LENGTH), 1, limits.max_ffn_dim))
    if "rope_freqs.weight" not in tensor_names:
        raise LocalLLMError("GGUF file has no 'rope_freqs.weight' (the full-attention layers' proportional rope)")
    k_eq_v = any(not pattern[i] and f"blk.{i}.attn_k.weight" in tensor_names and f"blk.{i}.attn_v.weight"
                 not in tensor_names for i in range(first))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    vocab = f.int(key(k.LLM.VOCAB_SIZE), 1, limits.max_vocab, len(tokens) if isinstance(tokens, list) and tokens
                  else MISSING)
    softcap_key = key(k.LLM.FINAL_LOGIT_SOFTCAPPING)
    types = [SLIDING if s else FULL for s in pattern]
    cfg = ModelConfig(
        arch=ARCH, n_layers=n_layers, dim=dim, ffn_dim=ffn[0], n_heads=n_heads, n_kv_heads=kv_swa,
        head_dim=hd_swa, vocab_size=vocab,
        context_length=f.int(key(k.LLM.CONTEXT_LENGTH), 1, limits.max_context, 131072),
        norm_eps=f.float(key(k.Attention.LAYERNORM_RMS_EPS), 1e-6),
        rope_theta=f.float(key(k.Rope.FREQ_BASE), 1e6), qkv_bias=False, qk_norm=True,
        tied_output="output.weight" not in tensor_names,
        **_common_fields(dim, types, f.int(key(k.Attention.SLIDING_WINDOW), 1, limits.max_context)),
        rope_theta_local=f.float(key(k.Rope.FREQ_BASE_SWA), 10000.0),
        final_softcap=f.float(softcap_key, None) if meta.get(f"{ARCH}.{softcap_key}") else None,
        head_dim_global=hd_full, n_kv_heads_global=kv_full, attn_k_eq_v=k_eq_v,
        n_kv_shared_layers=n_shared, double_wide_mlp=double,
        per_layer_dim=f.int(key(k.LLM.EMBD_LENGTH_PER_LAYER_INP), 0, limits.max_dim, 0),
        layer_out_scale="blk.0.layer_output_scale.weight" in tensor_names, **moe,
    )
    # rope_partial_global stays 1: the file's rope_freqs divisors (1e30 on unrotated pairs) carry it
    return _checked(cfg, "GGUF metadata", limits)


# ---- Hugging Face tensor names -> GGUF names, from gguf's own table for the architecture


def hf_name_map(n_layers: int):
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers)


def gemma4_hf_name(key: str, name_map) -> str | None:
    """A checkpoint key -> its GGUF name; "" for a tensor of the vision / audio towers (skipped);
    None for an unknown one. layer_scalar has no .weight suffix in the checkpoint, as the converter knows."""
    if key.startswith("model.language_model."):
        key = "model." + key.removeprefix("model.language_model.")
    elif key.startswith(_OTHER_TOWERS):
        return ""
    if key.endswith((".layer_scalar", ".experts.gate_up_proj", ".experts.down_proj")):  # bare parameters
        key += ".weight"
    # the router's scales: llama.cpp's converter names them ffn_gate_inp.scale / ffn_down_exps.scale
    for hf, ours in ((".router.scale", "ffn_gate_inp.scale"), (".router.per_expert_scale", "ffn_down_exps.scale")):
        if key.endswith(hf) and key.startswith("model.layers."):
            layer = key.removeprefix("model.layers.").split(".")[0]
            return f"blk.{layer}.{ours}" if layer.isdigit() else None
    base, _, suffix = key.rpartition(".")
    name = name_map.get_name(base)
    return None if name is None or suffix != "weight" else f"{name}.weight"


# ---- the tensor set a config implies (validate.expected_shapes for gemma4)


def gemma4_expected_shapes(cfg: ModelConfig, rope_pairs: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> torch shape of every tensor of a Gemma 4 Transformer (per-layer head dims, kv heads,
    MLP widths; KV-shared layers without k/v; k_eq_v layers without v). rope_pairs: R/2 of the global set."""
    c, v, L, p = cfg.dim, cfg.vocab_size, cfg.n_layers, cfg.per_layer_dim
    out = {"token_embd.weight": (v, c), "output_norm.weight": (c,), "rope_freqs.weight": (rope_pairs,)}
    if not cfg.tied_output:
        out["output.weight"] = (v, c)
    if p:
        out |= {"per_layer_token_embd.weight": (v, L * p), "per_layer_model_proj.weight": (L * p, c),
                "per_layer_proj_norm.weight": (p,)}
    for i in range(L):
        d, f = cfg.layer_head_dim(i), cfg.layer_ffn_dim(i)
        q, kv = cfg.n_heads * d, cfg.layer_kv_heads(i) * d
        layer = {
            "attn_norm.weight": (c,), "attn_q.weight": (q, c), "attn_q_norm.weight": (d,), "attn_output.weight": (c, q),
            "post_attention_norm.weight": (c,), "ffn_norm.weight": (c,), "ffn_gate.weight": (f, c),
            "ffn_up.weight": (f, c), "ffn_down.weight": (c, f), "post_ffw_norm.weight": (c,),
        }
        if cfg.kv_source(i) == i:
            layer |= {"attn_k.weight": (kv, c), "attn_k_norm.weight": (d,)}
            if not (cfg.attn_k_eq_v and not cfg.sliding(i)):
                layer["attn_v.weight"] = (kv, c)
        if cfg.layer_out_scale:
            layer["layer_output_scale.weight"] = (1,)
        if p:
            layer |= {"inp_gate.weight": (p, c), "proj.weight": (c, p), "post_norm.weight": (c,)}
        if cfg.moe_with_mlp:
            e, fe = cfg.n_experts, cfg.expert_ffn_dim
            layer |= {"ffn_gate_inp.weight": (e, c), "ffn_gate_inp.scale": (c,), "ffn_gate_up_exps.weight": (e, 2 * fe, c),
                      "ffn_down_exps.weight": (e, c, fe), "ffn_down_exps.scale": (e,), "pre_ffw_norm_2.weight": (c,),
                      "post_ffw_norm_1.weight": (c,), "post_ffw_norm_2.weight": (c,)}
        out |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return out


def ignored_tensors(cfg: ModelConfig) -> frozenset[str]:
    """Tensors a checkpoint may hold that the model does not use: the k/v projections and k norm of
    KV-shared layers (transformers' _keys_to_ignore_on_load_unexpected; llama.cpp: not required)."""
    if cfg.arch != ARCH:
        return frozenset()
    return frozenset(f"blk.{i}.{name}" for i in range(cfg.n_layers) if cfg.kv_source(i) != i
                     for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"))
