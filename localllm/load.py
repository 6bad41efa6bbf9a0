"""Load a model (GGUF file or Hugging Face safetensors folder) with its tokenizer, ready to run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.kernels.cpu import BlockQWeight, load_extension, pack_for_cpu
from localllm.kernels.qweight import QUANTIZED_TYPES, QWeight
from localllm.quantize.decode import dequantize_torch

from .config import ModelConfig
from .errors import LocalLLMError
from .gguf_file import GGUFFile, open_gguf
from .model import QEmbedding, Transformer, llama3_rope_factors
from .nonfinite import check_vectors
from .registry import resolve_model
from .settings import DEFAULT_CPU
from .tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from .validate import check_gguf, check_hf_folder
from .weights import QuantizedTensor, gguf_name, gguf_state_dict, hf_state_dict


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    tensor_types: Counter  # checkpoint tensor type name -> count
    file_bytes: int


def place_quantized(
    model: Transformer, state: dict, device: str, keep: bool | None = None, raw: bool = False,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The one pass that decides where quantized linear weights live, by the checkpoint's tensor types.

    raw (load_model's choice on CPU and MPS): each QuantizedTensor stays as the file's blocks in a
    BlockQWeight (kernels/cpu.py: C++ kernels on the CPU, torch decoding on MPS), token_embd included.
    Otherwise on CUDA each becomes a QWeight held by its Linear (quantized on the GPU, run by the
    fused kernels of kernels/); elsewhere it is decoded to dense float here (gguf's values exactly).
    keep overrides the choice (tests run the kernels on the CPU under TRITON_INTERPRET).
    """
    keep = torch.device(device).type == "cuda" if keep is None else keep
    on_cpu = raw and torch.device(device).type == "cpu"
    ext = load_extension(DEFAULT_CPU.cache_dir) if on_cpu else None  # None: the torch fallback
    for name, value in list(state.items()):
        if not isinstance(value, QuantizedTensor):
            continue
        if raw:
            qw = pack_for_cpu(BlockQWeight.from_blocks(value.data.to(device), value.qtype, dtype), ext)
            if name == "token_embd.weight":
                model.token_embd = QEmbedding(qw)
            else:
                model.get_submodule(name.removesuffix(".weight")).set_quantized(qw)
            del state[name]
        elif keep:
            module = model.get_submodule(name.removesuffix(".weight"))
            # block-major where the integer-dot decode kernels read it (kernels/triton_q8.py)
            module.set_quantized(QWeight.from_raw(value.data.to(device), value.qtype).to_blocks())
            del state[name]
        else:
            state[name] = dequantize_torch(value.data, value.qtype)


def build_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype, keep_quantized: bool | None = None,
    raw_blocks: bool = False,
) -> Transformer:
    """Build on the meta device, then assign the checkpoint tensors (one materialisation only).
    raw_blocks: quantized tensors stay as the file's blocks (see place_quantized)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    place_quantized(model, state, device, keep_quantized, raw_blocks, dtype)
    state.setdefault("rope_freqs", llama3_rope_factors(cfg))
    check_vectors(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing and len(state) <= 1:  # rope_freqs aside, nothing: a vocab-only GGUF
        raise LocalLLMError("the file has no weights (a vocab-only GGUF?): it can tokenize but not generate")
    if missing:
        raise LocalLLMError(f"checkpoint is missing tensor {gguf_name(missing[0])!r} ({len(missing)} missing)")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise LocalLLMError(f"checkpoint has unexpected tensor {gguf_name(extra[0])!r} for architecture {cfg.arch}")
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise LocalLLMError(f"tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(ref.shape)}")
        keep_fp32 = name == "rope_freqs"
        state[name] = state[name].to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def read_gguf_model(
    f: GGUFFile, device: str = "cpu", raw: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter]:
    """On CUDA quantized linear weights stay in their blocks (see place_quantized); with raw (CPU,
    MPS) the quantized embedding too, as views of the file's mapping. The whole file is validated
    (validate.check_gguf) before the first tensor is decoded."""
    cfg = check_gguf(f)
    types = Counter(t.tensor_type.name for t in f.tensors.values())
    if raw:
        return cfg, gguf_state_dict(f, cfg, QUANTIZED_TYPES, keep_embedding=True), types
    keep = QUANTIZED_TYPES if torch.device(device).type == "cuda" else frozenset()
    return cfg, gguf_state_dict(f, cfg, keep), types


def read_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter, Tokenizer]:
    cfg, keys = check_hf_folder(folder)
    tok = load_hf_tokenizer(folder)
    state = hf_state_dict(folder, keys)
    types = Counter(str(t.dtype).removeprefix("torch.") for t in state.values())
    return cfg, state, types, tok


def file_size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size


def load_model(
    spec: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, keep_quantized: bool | None = None
) -> LoadedModel:
    """spec: a GGUF path, a HF folder, a models.toml name, or None for the default model.
    keep_quantized: see place_quantized (False: dense weights on every device, e.g. for calibration).
    A quantized GGUF file on CPU or MPS keeps its blocks (BlockQWeight); on the CPU its kernels compute
    in fp32, so the model's dense tensors (norms, biases) and the KV cache are float32 whatever dtype
    says. F32/F16/BF16 tensors are decoded to dense as before."""
    path = resolve_model(spec)
    raw = False
    if path.is_dir():
        cfg, state, types, tok = read_hf_folder(path)
    else:
        f = open_gguf(path)
        quantized = any(t.tensor_type in QUANTIZED_TYPES for t in f.tensors.values())
        raw = quantized and keep_quantized is None and torch.device(device).type in ("cpu", "mps")
        cfg, state, types = read_gguf_model(f, device, raw)
        tok = load_gguf_tokenizer(f.metadata)
    if raw and torch.device(device).type == "cpu":
        dtype = torch.float32
    model = build_model(cfg, state, device, dtype, keep_quantized, raw)
    return LoadedModel(model, tok, cfg, path, types, file_size(path))


def load_tokenizer(spec: str | None) -> Tokenizer:
    """Only the tokenizer (works on vocab-only GGUF files)."""
    path = resolve_model(spec)
    if path.is_dir():
        return load_hf_tokenizer(path)
    return load_gguf_tokenizer(open_gguf(path).metadata)
