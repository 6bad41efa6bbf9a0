"""The loader's trust boundary: a checkpoint's tensors against its config, before anything is built.

config_gguf.py / config_hf.py check every config field (type and range); this module derives the exact tensor set the
config implies (expected_shapes, which must agree with model.Transformer's state dict: tests check it)
and checks every tensor's name, type and shape against it. Only then does load.py decode a weight or
build the model, so a file's claims (a million layers, a 2^31 embedding width) cost nothing: every
expected tensor must be present, and the GGUF reader has already checked that each lies inside the file.

Public entry points for every reader of model files (load, info, quantize): check_gguf(GGUFFile) and
check_hf_folder(folder) return the validated ModelConfig (weights holding NaN or Inf are found when
the first logits are not finite: localllm/nonfinite.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path


from localllm.quantize.type_facts import SUPPORTED_TYPES

from .config import ModelConfig
from .config_gguf import config_from_gguf
from .config_hf import config_from_hf, hf_config_json
from .errors import LocalLLMError
from .fused import file_shapes
from .gemma4 import gemma4_config_from_gguf, gemma4_config_from_hf, gemma4_expected_shapes, ignored_tensors
from .gguf_file import GGUFFile
from .rope_dims import ROPE_FACTOR_TENSORS, rotary_dims
from .settings import DEFAULT_LIMITS, LoaderLimits
from .tensor_names import gguf_to_ours, merge_legacy_shapes

# MXFP4's name as check_hf_folder reports an assembled pair (moe_mxfp4.DTYPE; a test checks they agree).
# The torch-using readers (moe_mxfp4, moe_weights, weights) are imported by check_hf_folder itself: a
# GGUF's check imports no torch (`localllm quantize`'s torch-free path: commands/quantize_native.py).
MXFP4_DTYPE = "MXFP4"

# Hugging Face checkpoints: the dtypes we decode (safetensors' names).
HF_DTYPES = frozenset({"F32", "F16", "BF16"})


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch shape (out, in) of every tensor cfg's Transformer holds; rope_freqs
    (optional in a file) included. Must match model.Transformer (tests/test_bad_loader.py checks)."""
    if cfg.arch == "gemma4":
        return gemma4_expected_shapes(cfg, rotary_dims(cfg) // 2)
    c, q, kv, f, d = cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim, cfg.head_dim
    rot = cfg.rotary_dim or d
    out = {"token_embd.weight": (cfg.vocab_size, c), "output_norm.weight": (c,), "rope_freqs.weight": (rot // 2,)}
    if not cfg.tied_output:
        out["output.weight"] = (cfg.vocab_size, c)
    layer = {
        "attn_norm.weight": (c,), "attn_q.weight": (q, c), "attn_k.weight": (kv, c), "attn_v.weight": (kv, c),
        "attn_output.weight": (c, q), "ffn_norm.weight": (c,), "ffn_gate.weight": (f, c),
        "ffn_up.weight": (f, c), "ffn_down.weight": (c, f),
    }
    if cfg.qkv_bias:
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if cfg.qk_norm:
        layer |= {"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)}
    if cfg.attn_out_bias:
        layer |= {"attn_output.bias": (c,)}
    if cfg.attn_sinks:
        layer |= {"attn_sinks.weight": (cfg.n_heads,)}
    if cfg.post_norms:
        layer |= {"post_attention_norm.weight": (c,), "post_ffw_norm.weight": (c,)}
    if cfg.n_experts:
        layer = {k: v for k, v in layer.items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))}
        layer |= moe_shapes(cfg)
    for i in range(cfg.n_layers):
        out |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    if cfg.rope_original_context is not None:  # LongRoPE divisors (config_phi3.py)
        out |= dict.fromkeys(ROPE_FACTOR_TENSORS, ((cfg.rotary_dim or d) // 2,))
    return out


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One block's mixture-of-experts tensors (localllm/moe.py), torch order: router (E, C), experts
    (E, F, C) and (E, C, F); gpt-oss's biases."""
    e, c, f = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
    out = {"ffn_gate_inp.weight": (e, c), "ffn_gate_exps.weight": (e, f, c), "ffn_up_exps.weight": (e, f, c),
           "ffn_down_exps.weight": (e, c, f)}
    if cfg.moe_bias:
        out |= {"ffn_gate_inp.bias": (e,), "ffn_gate_exps.bias": (e, f), "ffn_up_exps.bias": (e, f),
                "ffn_down_exps.bias": (e, c)}
    return out


# absent: computed from the config (rope.rope_factors); LongRoPE's from config.json for a HF
# folder (config_phi3.hf_longrope), and a GGUF config has them only when the file holds both
OPTIONAL = frozenset({"rope_freqs.weight", *ROPE_FACTOR_TENSORS})


def check_tensor_set(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str,
                     names: dict[str, str] | None = None) -> None:
    """shapes: GGUF tensor name -> torch shape (out, in), as the checkpoint holds them. Every expected
    tensor present with its shape, nothing else. names: GGUF name -> the checkpoint's own, for messages."""
    names = names or {}
    expected = file_shapes(cfg, expected_shapes(cfg))  # the checkpoint's layout (fused tensors: fused.py)
    ignored = ignored_tensors(cfg)
    shapes = {n: s for n, s in shapes.items() if n not in ignored}
    extra = [n for n in shapes if n not in expected]
    if extra:
        raise LocalLLMError(f"{where} has unexpected tensor {names.get(extra[0], extra[0])!r} for this config"
                            f" ({cfg.arch}, {cfg.n_layers} layers{', tied output' if cfg.tied_output else ''})")
    missing = [n for n in expected if n not in shapes and n not in OPTIONAL]
    if missing and len(shapes) == 0:
        raise LocalLLMError(f"{where} has no weights (a vocab-only GGUF?): it can tokenize but not generate")
    if missing:
        raise LocalLLMError(f"{where} is missing tensor {missing[0]!r} ({len(missing)} missing) for its config"
                            f" ({cfg.n_layers} layers)")
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            raise LocalLLMError(f"{where}: tensor {names.get(name, name)!r} has shape {tuple(shape)}, expected"
                                f" {expected[name]} from the config (dim {cfg.dim}, {cfg.n_heads} heads of"
                                f" {cfg.head_dim}, {cfg.n_kv_heads} kv heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size})")


def gguf_torch_shape(t) -> tuple[int, ...]:
    """A reader tensor's dims (ggml order: columns first) -> torch order (rows, cols)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def check_gguf(f: GGUFFile, limits: LoaderLimits = DEFAULT_LIMITS) -> ModelConfig:
    """The whole GGUF model (config, tokenizer size, every tensor's name, type and shape) before anything
    is decoded or built -> its ModelConfig; one LocalLLMError line naming the first problem."""
    for name, t in f.tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise LocalLLMError(f"tensor {name!r} has unsupported type {t.tensor_type.name}")
    read = gemma4_config_from_gguf if f.metadata.get("general.architecture") == "gemma4" else config_from_gguf
    cfg = read(f.metadata, set(f.tensors), limits)
    where = f"GGUF file {f.path.name}"
    shapes = {gguf_to_ours(cfg.arch, n): gguf_torch_shape(t) for n, t in f.tensors.items()}
    shapes = merge_legacy_shapes(shapes, {n: t.tensor_type for n, t in f.tensors.items()}, where)
    check_tensor_set(cfg, shapes, where)
    check_vocab(cfg, f.metadata.get("tokenizer.ggml.tokens"), where)
    return cfg


def check_vocab(cfg: ModelConfig, tokens, where: str) -> None:
    """The tokenizer's ids must have embedding rows (more rows than tokens is padding, and fine)."""
    if isinstance(tokens, list) and len(tokens) > cfg.vocab_size:
        raise LocalLLMError(f"{where}: the tokenizer has {len(tokens)} tokens but the embedding only"
                            f" {cfg.vocab_size} rows")


def check_hf_tensors(cfg: ModelConfig, tensors: dict[str, tuple[tuple[int, ...], str]], folder_name: str,
                     names: dict[str, str]) -> ModelConfig:
    """tensors: GGUF name -> (shape, safetensors dtype). A "tied" config whose checkpoint stores
    lm_head anyway uses the stored head (transformers does when it differs; llama.cpp's converter
    writes it): the returned config says so."""
    if cfg.tied_output and "output.weight" in tensors:
        cfg = replace(cfg, tied_output=False)
    for name, (_, dtype) in tensors.items():
        if dtype not in HF_DTYPES and dtype != MXFP4_DTYPE:  # MXFP4: a checked pair (moe_mxfp4.py)
            raise LocalLLMError(f"tensor {names.get(name, name)!r} in {folder_name} has dtype {dtype},"
                                f" expected one of {', '.join(sorted(HF_DTYPES))}")
    check_tensor_set(cfg, {n: shape for n, (shape, _) in tensors.items()}, folder_name, names)
    return cfg


def check_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, tuple[Path, str]]]:
    """config.json and every tensor header of a safetensors folder, validated before any tensor is
    read -> (config, GGUF name -> (file, checkpoint key))."""
    from .moe_mxfp4 import check_quant_config, is_mxfp4
    from .moe_weights import assemble
    from .weights import hf_moe_headers, hf_tensor_headers

    raw = hf_config_json(folder)
    gemma4 = isinstance(raw, dict) and raw.get("model_type") in ("gemma4", "gemma4_text")
    cfg = gemma4_config_from_hf(raw) if gemma4 else config_from_hf(raw)
    keys, tensors = {}, {}
    for path, key, name, shape, dtype in hf_tensor_headers(folder, cfg):
        if name in keys:
            raise LocalLLMError(f"tensor {key!r} appears twice in {folder.name} ({keys[name][0].name}, {path.name})")
        keys[name], tensors[name] = (path, key), (shape, dtype)
    names = {name: key for name, (_, key) in keys.items()}
    # mixture-of-experts tensors: assembled from their parts (per-expert keys, gpt-oss's split gate/up)
    for name, (source, shape) in assemble(hf_moe_headers(folder, cfg), folder.name).items():
        if name in keys:
            raise LocalLLMError(f"tensor {source.parts[0].key!r} appears twice in {folder.name}")
        dtypes = {p.dtype for p in source.parts}
        dtype = MXFP4_DTYPE if is_mxfp4(source.parts) else sorted(dtypes)[0] if len(dtypes) == 1 else "mixed"
        keys[name], tensors[name] = source, (shape, dtype)
        names[name] = source.parts[0].key
    check_quant_config(raw, any(dtype == MXFP4_DTYPE for _, dtype in tensors.values()), folder.name)
    cfg = check_hf_tensors(cfg, tensors, folder.name, names)
    ignored = ignored_tensors(cfg)
    return cfg, {name: k for name, k in keys.items() if name not in ignored}
