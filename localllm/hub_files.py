"""Which files of a Hugging Face repository make the model a `owner/repo[:QUANT]` reference names.

GGUF repositories, by llama.cpp's rules (common/download.cpp: get_gguf_split_info, find_best_model,
gguf_filename_is_model): a file's quant tag is what follows the last '-' or '.' of its name before
.gguf (and before gguf-split's -0000i-of-0000N); QUANT picks the files whose path contains QUANT then
'.' or '-' (case-insensitive); no QUANT: Q4_K_M, then Q8_0, then the first model file. mmproj, imatrix
and draft-head sidecars are not models. A split set counts once, by its first part, and all its parts
are fetched. Among matches we take a single file before a split set (llama.cpp takes the first match in
listing order; a repo holding both is rare). Repositories without GGUF files are safetensors checkpoints:
their config, tokenizer and *.safetensors (+ index) files at the top level.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import LocalLLMError

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's find_best_model without a tag
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # gguf_filename_is_model
SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
# What a safetensors checkpoint needs (localllm/validate.check_hf_folder, tokenizer/): the top level only.
SAFETENSORS_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                     "chat_template.jinja", "chat_template.json", "model.safetensors.index.json")


@dataclass(frozen=True)
class GGUFName:
    prefix: str  # the path without .gguf and without the split suffix (tag included)
    tag: str  # upper case; "" when the name has none
    index: int  # 1-based part number (1 for a single file)
    count: int  # parts in the set (1 for a single file)


def gguf_name(path: str) -> GGUFName | None:
    """get_gguf_split_info: None for a path that is not a .gguf file."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix, index, count = path[: -len(".gguf")], 1, 1
    if m := SPLIT.match(prefix):
        prefix, index, count = m[1], int(m[2]), int(m[3])
    tag = m[1].upper() if (m := TAG.search(prefix)) else ""
    return GGUFName(prefix, tag, index, count)


def is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return gguf_name(path) is not None and not any(s in name for s in NOT_MODELS)


def model_ggufs(files: list[str]) -> list[str]:
    return sorted(f for f in files if is_model_gguf(f))


def quant_of(path: str) -> str:
    """The name a file is picked by: its tag, else its file name without .gguf (and split suffix)."""
    n = gguf_name(path)
    return n.tag or n.prefix.rsplit("/", 1)[-1]


def available_quants(files: list[str]) -> list[str]:
    return sorted({quant_of(f) for f in model_ggufs(files)})


def split_set(files: list[str], first: str) -> list[str]:
    """get_split_files: every part of first's set (first alone for a single file), in part order."""
    n = gguf_name(first)
    if n.count <= 1:
        return [first]
    parts = [f for f in files if (g := gguf_name(f)) and g.count == n.count and g.prefix == n.prefix]
    return sorted(parts, key=lambda f: gguf_name(f).index)


def pick_gguf(files: list[str], quant: str | None) -> list[str] | None:
    """The model's files (a split set's parts in order) for QUANT, None when nothing matches."""
    models = model_ggufs(files)
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + "[.-]", re.IGNORECASE)
        matches = [f for f in models if pattern.search(f) and gguf_name(f).index == 1]
        if matches:
            best = min(matches, key=lambda f: (gguf_name(f).count > 1, f))  # a single file first
            return split_set(files, best)
    if not quant:
        firsts = [f for f in models if gguf_name(f).index == 1]
        return split_set(files, firsts[0]) if firsts else None
    return None


def complete_split(files: list[str], chosen: list[str]) -> bool:
    """Every part of the chosen set is among files (a cache that lost a part is not a model)."""
    return len(chosen) == gguf_name(chosen[0]).count and all(f in files for f in chosen)


def safetensors_files(files: list[str]) -> list[str]:
    """The top-level files of a safetensors checkpoint, [] when the repo has no weights of it."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    if not weights or "config.json" not in top:
        return []
    return sorted(weights + [f for f in top if f in SAFETENSORS_NAMES])


def choose_files(repo: str, files: list[str], quant: str | None) -> tuple[str, list[str]]:
    """("gguf", the model's parts) or ("safetensors", the checkpoint's files) for a repo's file list;
    LocalLLMError naming what the repo offers when nothing fits."""
    if model_ggufs(files):
        chosen = pick_gguf(files, quant)
        if chosen is None:
            raise LocalLLMError(f"no {quant} GGUF in {repo} (quants: {', '.join(available_quants(files))})")
        return "gguf", chosen
    weights = safetensors_files(files)
    if not weights:
        raise LocalLLMError(f"{repo} has neither GGUF files nor a safetensors checkpoint (config.json, *.safetensors)")
    if quant:
        raise LocalLLMError(f"{repo} is a safetensors checkpoint, it has no quants: drop ':{quant}'")
    return "safetensors", weights
