"""What `localllm quantize` reads: a model's tensors (each read lazily: all values, some rows, or its
stored bytes) and its metadata, from a GGUF file or a Hugging Face safetensors folder.

Inputs:
- a GGUF file: every metadata key is copied with its own GGUF type (tokenizer, chat template,
  architecture keys...), in order, except general.file_type, which the preset sets (and
  general.quantization_version, set to 2, as llama-quantize does; split keys are dropped).
  Quantized tensors are decoded first (quantize.formats.dequantize: the gguf package's values); a
  tensor whose chosen type is its stored type is copied byte for byte.
- a Hugging Face safetensors folder: tensors are renamed to GGUF names (localllm.weights.HF_NAMES),
  q/k rows permuted for the llama architecture (Llama and Mistral) as convert_hf_to_gguf.py does, and
  the architecture keys written as the converter writes them. The tokenizer metadata is built from
  the folder's tokenizer files as the converter builds it (localllm.hf_to_gguf): byte-level BPE from
  tokenizer.json ("gpt2"), SentencePiece from tokenizer.model ("llama"); merges, special ids, add_bos
  and the chat template via gguf.SpecialVocab. convert_hf_to_gguf names the pre-tokenizer
  (tokenizer.ggml.pre) by hashing the tokenizer's output against its own table; localllm instead
  requires tokenizer.json's pre-tokenizer regexes to be exactly those of a known name
  (tokenizer.pretok.PRE_TOKENIZERS), and the built tokenizer to reproduce tokenizer.json's ids on a
  fixed multi-script text; otherwise the folder is refused. `tokenizer_from` (optional, an override):
  copy the tokenizer.* keys from a GGUF of the same model instead (e.g. one of llama.cpp's vocab-only
  files).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from localllm.quantize import dequantize
from localllm.quantize.plan import PlanRow, TensorInfo
from localllm.quantize.presets import ModelShape, Preset
from localllm.quantize.decode import dequantize_torch
from localllm.quantize.writer import MetaValue

from localllm.commands.quantize_native import output_metadata as native_output_metadata, read_gguf_metadata
from localllm.config import ModelConfig
from localllm.config_fields import Fields
from localllm.config_hf import read_json
from localllm.config_phi3 import hf_rope_tensors
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.validate import check_gguf, check_hf_folder
from localllm.moe_mxfp4 import is_mxfp4, read_mxfp4
from localllm.moe_weights import assemble, read_moe
from localllm.weights import PERMUTED_QK_ARCHS, gguf_tensor, hf_moe_headers, hf_tensor_names, ours_to_gguf, safetensors_files

Q = gguf.GGMLQuantizationType
K = gguf.Keys.General


@dataclass(frozen=True)
class SourceTensor:
    info: TensorInfo
    read: Callable[[], torch.Tensor]  # all values, float32, numpy-order shape
    read_rows: Callable[[torch.Tensor], torch.Tensor]  # some rows (of the (-1, cols) view), float32
    raw: Callable[[], np.ndarray] | None  # the stored GGUF bytes (GGUF input), copied when the type is kept
    # F16 / F32 values as the GGUF file stores them, numpy-order shape (a read-only view of its mapping):
    # what the C++ encoders take without a float32 copy (quantize.blocks.encode_cpp); None: use read()
    stored: Callable[[], torch.Tensor] | None = None


@dataclass
class Source:
    path: Path
    files: list[Path]  # the files OUT must not be
    arch: str  # GGUF architecture
    model: ModelShape
    tensors: list[SourceTensor]
    metadata: Callable[[], dict[str, MetaValue]]  # read only when writing
    alignment: int
    config: ModelConfig  # what the loader will build from OUT: every tensor is checked against it


def read_source(path: Path, tokenizer_from: str | Path | None) -> Source:
    return read_hf_source(path, tokenizer_from) if path.is_dir() else read_gguf_source(path, tokenizer_from)


def output_metadata(src: Source, preset: Preset) -> dict[str, MetaValue]:
    return native_output_metadata(src.metadata(), preset)


# ---- GGUF input

def read_gguf_source(path: Path, tokenizer_from: str | Path | None = None) -> Source:
    if tokenizer_from is not None:
        raise LocalLLMError("--tokenizer-from is for safetensors input: a GGUF input keeps its own tokenizer")
    f = open_gguf(path)
    if not f.tensors:
        raise LocalLLMError(f"the input has no weights (a vocab-only file?): nothing to quantize: {path}")
    cfg = check_gguf(f)  # config, types and every tensor's shape, as the loader checks them
    model = ModelShape(f.metadata["general.architecture"], cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.n_experts)
    tensors = [_gguf_tensor(t) for t in f.tensors.values()]
    alignment = int(f.metadata.get(K.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))
    return Source(path, [path], model.arch, model, tensors, lambda: read_gguf_metadata(path, f=f), alignment, cfg)


def _gguf_tensor(t: gguf.ReaderTensor) -> SourceTensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    qtype = t.tensor_type

    def rows_2d() -> np.ndarray:
        return t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim != 2 else t.data

    def decode(data: np.ndarray) -> torch.Tensor:
        values = dequantize(np.asarray(data), qtype)
        # F32 data comes back as the read-only memmap itself: copy it for torch
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def read() -> torch.Tensor:
        return gguf_tensor(t)  # the loader's decoding: the gguf package's values, torch-fast

    def read_rows(idx: torch.Tensor) -> torch.Tensor:
        return decode(rows_2d()[idx.numpy()])

    def raw() -> np.ndarray:
        return np.ascontiguousarray(t.data).view(np.uint8)

    def stored() -> torch.Tensor:
        with warnings.catch_warnings():  # torch warns that the mapping is read-only: the encoders only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(t.data).reshape(shape)

    return SourceTensor(TensorInfo(t.name, shape, qtype), read, read_rows, raw,
                        stored if qtype in (Q.F16, Q.F32) else None)


# ---- Hugging Face safetensors input

# Architectures whose safetensors folders this command converts (hf_metadata writes their keys; the
# others need keys and tensor changes of their own, e.g. Gemma's sliding window and norm offset).
HF_SOURCE_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "mixtral", "qwen3_moe", "gpt_oss")


def read_hf_source(folder: Path, tokenizer_from: str | Path | None) -> Source:
    from safetensors import safe_open

    # the converter's code (and the tokenizer libraries it loads) only for a folder: not on a GGUF's path
    from localllm.hf_to_gguf import converter_rope_freqs, gguf_arch, hf_metadata

    cfg, _ = check_hf_folder(folder)  # config.json and every tensor header, as the loader checks them
    if cfg.arch == "gemma4":
        return _gemma4_hf_source(folder, cfg, tokenizer_from)
    if cfg.arch not in HF_SOURCE_ARCHS:
        raise LocalLLMError(f"{folder}: quantizing a {cfg.arch} safetensors folder is not supported (supported:"
                            f" {', '.join(HF_SOURCE_ARCHS)}); quantize its GGUF instead")
    hp = read_json(folder / "config.json")
    arch = gguf_arch(cfg.arch)
    model = ModelShape(arch, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.n_experts)
    files = safetensors_files(folder)
    tensors: list[SourceTensor] = []
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":  # linear, YaRN: metadata (hf_metadata)
        freqs = torch.from_numpy(converter_rope_freqs(hp, cfg.head_dim))
        tensors.append(_memory_tensor("rope_freqs.weight", freqs))
    # LongRoPE's divisor sets (phi3), long then short as Phi3MiniModel.generate_extra_tensors yields them
    longrope = hf_rope_tensors(Fields(hp, "config.json"), cfg)
    tensors += [_memory_tensor(name, longrope[name]) for name in sorted(longrope)]
    for path, key, name in hf_tensor_names(folder, cfg):
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(key)
            tensors.append(_hf_tensor(path, key, ours_to_gguf(arch, name), tuple(sl.get_shape()), sl.get_dtype(), arch, cfg))
    tensors += moe_tensors(folder, arch)
    if tokenizer_from is not None:
        tok_kv = tokenizer_metadata(Path(tokenizer_from), cfg.vocab_size)
    else:
        from localllm.hf_to_gguf import hf_tokenizer_metadata

        tok_kv = hf_tokenizer_metadata(folder, cfg.vocab_size)
    return Source(folder, files, arch, model, tensors, lambda: hf_metadata(hp, cfg, folder, arch) | tok_kv,
                  gguf.GGUF_DEFAULT_ALIGNMENT, cfg)


def _gemma4_hf_source(folder: Path, cfg, tokenizer_from: str | Path | None) -> Source:
    """A Gemma 4 folder as llama.cpp's Gemma4Model converts it (localllm/gemma4_gguf.py): its keys, its
    names (gguf's GEMMA4 table), rope_freqs for the full layers; KV-shared layers' stored k/v dropped."""
    from safetensors import safe_open

    from localllm.gemma4 import ignored_tensors
    from localllm.gemma4_gguf import gemma4_metadata, gemma4_rope_freqs
    from localllm.hf_to_gguf import hf_tokenizer_metadata
    from localllm.weights import hf_tensor_headers

    ignored = ignored_tensors(cfg)
    tensors = [_memory_tensor("rope_freqs.weight", gemma4_rope_freqs(cfg))]
    for path, key, name, shape, _ in hf_tensor_headers(folder, cfg):
        if name not in ignored:
            with safe_open(str(path), framework="pt") as f:
                dtype = f.get_slice(key).get_dtype()
            tensors.append(_hf_tensor(path, key, name, shape, dtype, "gemma4", cfg))
    tok_kv = (tokenizer_metadata(Path(tokenizer_from), cfg.vocab_size) if tokenizer_from is not None
              else hf_tokenizer_metadata(folder, cfg.vocab_size))
    model = ModelShape("gemma4", cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)
    return Source(folder, safetensors_files(folder), "gemma4", model, tensors,
                  lambda: gemma4_metadata(cfg, folder) | tok_kv, gguf.GGUF_DEFAULT_ALIGNMENT, cfg)


SAFETENSORS_DTYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}


def _hf_tensor(path: Path, key: str, name: str, shape: tuple[int, ...], dtype: str, arch: str, cfg) -> SourceTensor:
    from safetensors import safe_open

    from localllm.hf_to_gguf import permute_qk

    if dtype not in SAFETENSORS_DTYPES:
        raise LocalLLMError(f"tensor {key!r} in {path.name} has dtype {dtype} (expected F32, F16 or BF16)")
    # convert_hf_to_gguf stores 1-D tensors as F32 whatever the checkpoint's dtype
    source = SAFETENSORS_DTYPES[dtype] if len(shape) >= 2 else Q.F32

    def read() -> torch.Tensor:
        with safe_open(str(path), framework="pt") as f:
            w = f.get_tensor(key).float()
        if arch in PERMUTED_QK_ARCHS and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute_qk(w, cfg.n_heads)
        elif arch in PERMUTED_QK_ARCHS and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute_qk(w, cfg.n_kv_heads)
        return w

    return SourceTensor(TensorInfo(name, shape, source), read,
                        lambda idx: read().reshape(-1, shape[-1])[idx], None)


def moe_tensors(folder: Path, arch: str) -> list[SourceTensor]:
    """The stacked expert tensors of a mixture-of-experts folder (localllm/moe_weights.py), each read
    from its parts when written, named as the converter names them in the file (weights.ours_to_gguf)."""
    out = []
    for name, (source, shape) in assemble(hf_moe_headers(folder), folder.name).items():
        if is_mxfp4(source.parts):  # a released gpt-oss's experts: their blocks, written unchanged
            out.append(_mxfp4_tensor(ours_to_gguf(arch, name), shape, source.parts))
            continue
        dtype = source.parts[0].dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise LocalLLMError(f"tensor {source.parts[0].key!r} in {folder.name} has dtype {dtype} (expected F32, F16 or BF16)")
        stored = SAFETENSORS_DTYPES[dtype] if len(shape) >= 2 else Q.F32

        def read(source=source) -> torch.Tensor:
            return read_moe(source).float()

        out.append(SourceTensor(TensorInfo(ours_to_gguf(arch, name), shape, stored), read,
                                lambda idx, read=read, cols=shape[-1]: read().reshape(-1, cols)[idx], None))
    return out


def _mxfp4_tensor(name: str, shape: tuple[int, ...], parts) -> SourceTensor:
    """MXFP4 expert rows (localllm/moe_mxfp4.py): raw() is the GGUF bytes of the checkpoint's blocks."""
    def read() -> torch.Tensor:
        return dequantize_torch(read_mxfp4(parts), Q.MXFP4).reshape(shape)

    return SourceTensor(TensorInfo(name, shape, Q.MXFP4), read,
                        lambda idx: read().reshape(-1, shape[-1])[idx], lambda: read_mxfp4(parts).numpy())


def keep_checkpoint_mxfp4(src: Source, plan: list[PlanRow]) -> list[PlanRow]:
    """A safetensors folder's MXFP4 experts keep their blocks whatever the preset (llama.cpp's converter
    writes gpt-oss's MXFP4 experts as they are for every --outtype); a --tensor-type override still
    re-encodes them."""
    if not src.path.is_dir():
        return plan
    return [replace(r, target=Q.MXFP4, note="kept (the checkpoint's MXFP4)")
            if r.source == Q.MXFP4 and not r.note.startswith("override") and r.target != Q.MXFP4 else r
            for r in plan]


def _memory_tensor(name: str, w: torch.Tensor) -> SourceTensor:
    return SourceTensor(TensorInfo(name, tuple(w.shape), Q.F32), lambda: w,
                        lambda idx: w.reshape(-1, w.shape[-1])[idx], None)


def tokenizer_metadata(path: Path, vocab_size: int) -> dict[str, MetaValue]:
    """The tokenizer.* keys of a GGUF file (the tokenizer of a safetensors input)."""
    f = open_gguf(path)
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise LocalLLMError(f"{path} has no tokenizer (tokenizer.ggml.tokens)")
    if len(tokens) != vocab_size:
        raise LocalLLMError(f"{path} has {len(tokens)} tokens, the model's vocabulary has {vocab_size}")
    return read_gguf_metadata(path, keep=lambda key: key.startswith("tokenizer."))
