"""GGUF tensor names that check_gguf (localllm/validate.py) needs, without torch: the per-architecture
renames (gpt-oss's post_attention_norm) and the old one-tensor-per-expert layout's names. Moved out of
weights.py / moe_weights.py (which re-export them) so that `localllm quantize`'s torch-free preset path
(commands/quantize_native.py) validates its input as the loader does."""

from __future__ import annotations

import re

from .errors import LocalLLMError

# gpt-oss's norm before the MLP is `post_attention_norm` there (HF's post_attention_layernorm), our
# ffn_norm (model.Block's post_attention_norm is Gemma's norm of the attention output).
GGUF_RENAMES = {"gpt-oss": {"post_attention_norm": "ffn_norm"}}


def gguf_to_ours(arch: str, name: str) -> str:
    """A GGUF file's tensor name -> the GGUF name our module uses (GGUF_RENAMES; most are the same)."""
    renames = GGUF_RENAMES.get(arch)
    if not renames:
        return name
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[2] in renames:
        parts[2] = renames[parts[2]]
    return ".".join(parts)


def ours_to_gguf(arch: str, name: str) -> str:
    """Inverse of gguf_to_ours: the name a file of `arch` gives our tensor (what the converter writes)."""
    renames = {ours: theirs for theirs, ours in GGUF_RENAMES.get(arch, {}).items()}
    parts = name.split(".")
    if renames and len(parts) > 2 and parts[0] == "blk" and parts[2] in renames:
        parts[2] = renames[parts[2]]
    return ".".join(parts)


# HF model_type -> GGUF architecture where they differ (the converter registers Mistral and Mixtral
# under LlamaModel: their GGUF says llama).
GGUF_ARCHS = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


def gguf_arch(hf_arch: str) -> str:
    return GGUF_ARCHS.get(hf_arch, hf_arch)


# ---- GGUF: the old one-tensor-per-expert layout (early Mixtral files: blk.N.ffn_gate.E.weight, ...)

_LEGACY_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def legacy_expert(name: str) -> tuple[str, int] | None:
    """blk.3.ffn_gate.5.weight -> ("blk.3.ffn_gate_exps.weight", 5); None for any other name."""
    m = _LEGACY_EXPERT.match(name)
    return (f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.weight", int(m.group(3))) if m else None


def merge_legacy_shapes(shapes: dict[str, tuple[int, ...]], types: dict[str, object],
                        where: str) -> dict[str, tuple[int, ...]]:
    """A GGUF file's name -> torch shape with per-expert tensors replaced by their stack (E, ...),
    checked: experts 0..E-1, each once, of one shape and one type (their rows are concatenated)."""
    out, groups = {}, {}
    for name, shape in shapes.items():
        hit = legacy_expert(name)
        if hit is None:
            out[name] = shape
        else:
            groups.setdefault(hit[0], {})[hit[1]] = name
    for merged, experts in groups.items():
        names = [experts.get(e) for e in range(len(experts))]
        if None in names:
            missing = next(e for e, n in enumerate(names) if n is None)
            raise LocalLLMError(f"{where}: expert {missing} of {merged!r} is missing (per-expert tensors)")
        if len({shapes[n] for n in names}) > 1 or len({types[n] for n in names}) > 1:
            raise LocalLLMError(f"{where}: the per-expert tensors of {merged!r} differ in shape or type")
        if merged in out:
            raise LocalLLMError(f"{where}: {merged!r} is stored both stacked and per expert")
        out[merged] = (len(names), *shapes[names[0]])
    return out
