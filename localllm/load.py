"""Load a model (GGUF file or Hugging Face safetensors folder) with its tokenizer, ready to run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from localllm.kernels.qweight import QUANTIZED_TYPES, QWeight
from localllm.quantize.decode import dequantize_torch

from .config import ModelConfig
from .config_fields import Fields
from .config_hf import read_json
from .config_phi3 import hf_rope_tensors
from .errors import LocalLLMError
from .gguf_file import GGUFFile, open_gguf
from .gguf_split import split_parts
from .backends import runtime_class
from .model import Linear, QEmbedding, Transformer
from .nonfinite import check_vectors
from .parallel import TensorParallel
from .registry import resolve_model
from .rope import rope_factors
from .runtime import Runtime
from .tp_load import gguf_shard, hf_shard
from .tp_shard import check_supported, local_config
from .tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from .validate import check_gguf, check_hf_folder
from .weights import (DENSE_BLOCK_TYPES, EMBEDDINGS, ROPE_BUFFERS, QuantizedTensor, add_norm_offset, gguf_name,
                      gguf_state_dict, hf_state_dict, to_module_name)


@dataclass
class LoadedModel:
    runtime: Runtime  # the model on its backend: what generation, benchmarks and evaluation run
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    tensor_types: Counter  # checkpoint tensor type name -> count
    file_bytes: int

    @property
    def model(self) -> Transformer:
        """The weights (read them; never attach state: the runtime owns what it builds from them)."""
        return self.runtime.model


def layout_for(backend: type[Runtime], keep_quantized: bool | None) -> str:
    """How quantized tensors are kept: the backend's choice, or keep_quantized's override (True: QWeight
    for the Triton kernels on any device, as tests run them under TRITON_INTERPRET; False: dense)."""
    if keep_quantized is None:
        return backend.quantized
    return "qweight" if keep_quantized else "dense"


def place_quantized(model: Transformer, state: dict, backend: type[Runtime], layout: str, device: str,
                    dtype: torch.dtype) -> None:
    """The one pass that places quantized linear weights (QuantizedTensor values of state), by layout:
    "blocks": the file's blocks as the backend's BlockQWeight (token_embd too, a QEmbedding);
    "qweight": a QWeight held by its Linear, block-major where the integer-dot kernels read it
    (kernels/triton_q8.py); "dense": decoded to float here (gguf's values exactly)."""
    for name, value in list(state.items()):
        if not isinstance(value, QuantizedTensor):
            continue
        if layout == "blocks":
            qw = backend.block_weight(value.data.to(device), value.qtype, dtype)
            if name in EMBEDDINGS:  # token_embd (and Gemma 4's per_layer_token_embd)
                setattr(model, name.removesuffix(".weight"), QEmbedding(qw))
            else:
                model.get_submodule(name.removesuffix(".weight")).set_quantized(qw)
            del state[name]
        elif layout == "qweight":
            module = model.get_submodule(name.removesuffix(".weight"))
            module.set_quantized(QWeight.from_raw(value.data.to(device), value.qtype).to_blocks())
            del state[name]
        else:
            # (rows, K) -> the parameter's shape: 3-D (E, F, K) for expert tensors (localllm/moe.py)
            state[name] = dequantize_torch(value.data, value.qtype).reshape(model.get_parameter(name).shape)


# torch dtype -> the GGUF type of the same rows (a safetensors folder's linear weights as blocks)
DENSE_QTYPES = {torch.float32: gguf.GGMLQuantizationType.F32, torch.float16: gguf.GGMLQuantizationType.F16,
                torch.bfloat16: gguf.GGMLQuantizationType.BF16}


def dense_as_blocks(model: Transformer, state: dict) -> None:
    """Float linear weights and embeddings of state (a safetensors folder's, in its dtype) -> QuantizedTensor
    rows of their GGUF type, for a backend that multiplies them as they are stored (Runtime.dense_blocks):
    2-D, rows of a multiple of 32 values, held by a Linear (or an embedding); others stay as they are."""
    for name, t in list(state.items()):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in DENSE_QTYPES or t.shape[1] % 32:
            continue
        try:
            held = name in EMBEDDINGS or isinstance(model.get_submodule(name.removesuffix(".weight")), Linear)
        except AttributeError:
            held = False
        if held and name.endswith(".weight"):
            state[name] = QuantizedTensor(DENSE_QTYPES[t.dtype], t.contiguous().view(torch.uint8))


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype,
                keep_quantized: bool | None = None, layout: str | None = None,
                backend: type[Runtime] | None = None, tp: TensorParallel | None = None) -> Runtime:
    """Build on the meta device with the backend's ops, assign the checkpoint tensors (one
    materialisation only), and let the backend prepare them -> the model's Runtime.
    layout: see place_quantized (None: layout_for(backend, keep_quantized)); backend: None for the
    device's (backends.runtime_class; tests pass Runtime to run the portable backend on the CPU).
    tp: state is rank tp.rank's shard (tp_load) of a model of the whole config cfg; the module is built
    with its local config (tp_shard.local_config) and runs the sharded forward (Transformer's tp)."""
    backend = backend or runtime_class(device, cfg, tp)
    layout = layout_for(backend, keep_quantized) if layout is None else layout
    if layout == "blocks" and backend.blocks_dtype is not None:
        dtype = backend.blocks_dtype
    with torch.device("meta"):
        model = Transformer(cfg if tp is None else local_config(cfg, tp), backend.ops, tp)
    if layout == "blocks" and backend.dense_blocks:
        dense_as_blocks(model, state)
    place_quantized(model, state, backend, layout, device, dtype)
    state.setdefault("rope_freqs", rope_factors(cfg))
    check_vectors(state)
    assign(model, state, cfg, device, dtype)
    model.eval()
    backend.prepare(model)
    return backend(model)


def assign(model: Transformer, state: dict, cfg: ModelConfig, device: str, dtype: torch.dtype) -> None:
    """state's tensors into the meta-built model, checked against its state dict, cast to dtype (the
    rope divisors stay fp32) on device."""
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
        keep_fp32 = name in ROPE_BUFFERS
        # moved in the file's dtype, then cast on the device: torch casts a host-to-GPU copy on the host
        # (an F16 file loaded as fp32: twice the bytes over the bus, and a single pass of host conversion)
        state[name] = state[name].to(device=device).to(torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(state, assign=True, strict=True)


def read_gguf_model(f: GGUFFile, layout: str, cfg: ModelConfig | None = None, dense_blocks: bool = False,
                    tp: TensorParallel | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter]:
    """The file's config and tensors: quantized ones kept as their blocks unless layout is "dense"
    (for "blocks" the embedding too, as views of the file's mapping; with dense_blocks F32/F16/BF16
    linear weights too: Runtime.dense_blocks). The whole file is validated (validate.check_gguf) before
    the first tensor is decoded; cfg: its result, when the caller has it. tp: only rank tp.rank's
    shard (tp_load.gguf_shard)."""
    cfg = cfg or check_gguf(f)
    types = Counter(t.tensor_type.name for t in f.tensors.values())
    keep = frozenset() if layout == "dense" else QUANTIZED_TYPES | (DENSE_BLOCK_TYPES if dense_blocks else frozenset())
    if tp is not None:
        return cfg, gguf_shard(f, cfg, tp, keep, keep_embedding=layout == "blocks"), types
    return cfg, gguf_state_dict(f, cfg, keep, keep_embedding=layout == "blocks"), types


def read_hf_folder(folder: Path, tp: TensorParallel | None = None
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter, Tokenizer]:
    """tp: only rank tp.rank's shard (tp_load.hf_shard)."""
    cfg, keys = check_hf_folder(folder)
    if tp is not None:
        check_supported(cfg, tp.world)
    tok = load_hf_tokenizer(folder)
    state = hf_state_dict(folder, keys, cfg) if tp is None else hf_shard(folder, keys, cfg, tp)
    longrope = hf_rope_tensors(Fields(read_json(folder / "config.json"), "config.json"), cfg)  # LongRoPE divisors
    state |= {to_module_name(n): t for n, t in longrope.items()}
    types = Counter(t.qtype.name if isinstance(t, QuantizedTensor) else str(t.dtype).removeprefix("torch.")
                    for t in state.values())  # QuantizedTensor: a released gpt-oss's MXFP4 experts
    add_norm_offset(state, cfg)
    return cfg, state, types, tok


def file_size(path: Path) -> int:
    """Bytes of the weights: a folder's safetensors files, a split GGUF's parts, or the file."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    parts = split_parts(path)
    return sum(p.stat().st_size for p in parts) if all(p.is_file() for p in parts) else path.stat().st_size


def load_model(
    spec: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, keep_quantized: bool | None = None,
    backend: type[Runtime] | None = None, tp: TensorParallel | None = None,
) -> LoadedModel:
    """spec: a GGUF path, a HF folder, a models.toml name, or None for the default model. The backend
    is picked here, once, from the device and the config (backends.runtime_class); quantized GGUF tensors are kept
    as it wants them (Runtime.quantized; keep_quantized overrides: layout_for), F32/F16/BF16 tensors
    are dense in dtype (on the CPU, beside kept blocks, fp32: its kernels compute in fp32). backend:
    see build_model. tp: load and run only rank tp.rank's shard (localllm/tp_shard.py; the config
    returned is the file's whole one, the runtime's model.cfg the rank's local one)."""
    path = resolve_model(spec)
    if path.is_dir():
        cfg, state, types, tok = read_hf_folder(path, tp)
        backend = backend or runtime_class(device, cfg, tp)
        layout = layout_for(backend, keep_quantized)
    else:
        f = open_gguf(path)
        cfg = check_gguf(f)  # once: the backend depends on it
        if tp is not None:
            check_supported(cfg, tp.world)
        backend = backend or runtime_class(device, cfg, tp)
        layout = layout_for(backend, keep_quantized)
        quantized = any(t.tensor_type in QUANTIZED_TYPES for t in f.tensors.values())
        if not quantized and layout == "blocks" and not backend.dense_blocks:
            layout = "dense"  # nothing to keep: a float file is dense on backends without dense blocks
        cfg, state, types = read_gguf_model(f, layout, cfg, backend.dense_blocks, tp)
        tok = load_gguf_tokenizer(f.metadata)
    runtime = build_model(cfg, state, device, dtype, layout=layout, backend=backend, tp=tp)
    return LoadedModel(runtime, tok, cfg, path, types, file_size(path))


def load_tokenizer(spec: str | None) -> Tokenizer:
    """Only the tokenizer (works on vocab-only GGUF files)."""
    path = resolve_model(spec)
    if path.is_dir():
        return load_hf_tokenizer(path)
    return load_gguf_tokenizer(open_gguf(path).metadata)
