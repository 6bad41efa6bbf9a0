"""`localllm quantize`: read a model, plan a type per tensor, write a GGUF file.

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

The CLI runs a preset on a GGUF input without torch where it can (commands/quantize_native.py: the
same bytes); this module is the torch path for everything else.

Types: a preset (quantize.presets) picks each tensor's type, `--tensor-type REGEX=TYPE` overrides it,
and rows that do not split into blocks of the chosen type fall back (quantize.plan).
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import gguf
import numpy as np
import torch

from localllm.kernels.cpu import load_extension
from localllm.quantize import dequantize, quantize_tensor
from localllm.quantize.blocks import CPP_K_TYPES, SIMPLE_CPP, write_threads
from localllm.quantize.plan import (
    Override, PlanRow, TensorInfo, make_plan, measure_errors, preset_plan,
)
from localllm.quantize.presets import PRESETS, ModelShape, Preset, allows_quantization, fallback
from localllm.quantize.decode import dequantize_torch
from localllm.quantize.partial import remove_stale_partials
from localllm.quantize.writer import MetaValue, TensorSlot, write_gguf

# torch-free pieces, shared with the torch-free preset path (and re-exported here)
from localllm.commands.quantize_native import (  # noqa: F401
    NOT_COPIED, UNQUANTIZED, QuantizeResult, meta_value, check_requantize, output_metadata as native_output_metadata,
    parse_request, phase_line, read_gguf_metadata, typed_value,
)
_meta_value = meta_value  # its earlier name (tests)

from localllm.config import Fields, ModelConfig, read_json
from localllm.config_phi3 import hf_rope_tensors
from localllm.device import encoder_device
from localllm.errors import LocalLLMError
from localllm.gguf_file import open_gguf
from localllm.registry import resolve_model
from localllm.settings import DEFAULT_CPU, DEFAULT_FILES
from localllm.progress import stage_progress
from localllm.quantize_checks import (
    check_calibration_text, check_output, check_reachable, check_targets, check_tensors, imatrix_to_measure,
)
from localllm.validate import check_gguf, check_hf_folder
from localllm.moe_mxfp4 import is_mxfp4, read_mxfp4
from localllm.moe_weights import assemble, read_moe
from localllm.weights import PERMUTED_QK_ARCHS, gguf_tensor, hf_moe_headers, hf_tensor_names, ours_to_gguf, safetensors_files

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
K = gguf.Keys.General


CPP_TYPES = CPP_K_TYPES | SIMPLE_CPP  # the types whose C++ encoders take a stored F16 tensor as it is

TORCH_TYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}


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


def quantize_model(
    inp: str | None,
    out: str | Path | None,
    type_name: str,
    tensor_types: Sequence[str] = (),
    dry_run: bool = False,
    device: str = "auto",
    *,
    tokenizer_from: str | Path | None = None,
    imatrix: Mapping[str, torch.Tensor] | None = None,
    imatrix_file: str | Path | None = None,
    target_bpw: float | None = None,
    target_size: int | None = None,
    calib: str | None = None,
    progress: bool = True,
    sample_rows: int = 16,
    allow_requantize: bool = True,
) -> QuantizeResult:
    """Quantize model `inp` to OUT with preset `type_name` (or only plan it, with dry_run).

    imatrix: GGUF tensor name -> (cols,) mean of x^2 per input column, used by the encoders and the
    presets' imatrix rules. target_bpw / target_size / calib: reserved for mixed-precision plans.
    allow_requantize False: llama-quantize's rule (the CLI's default), a write that would re-encode an
    already quantized tensor to another type is refused (check_requantize)."""
    start = time.perf_counter()
    phases: dict[str, float] = {}
    mark = start

    def lap(name: str) -> None:  # the time since the last lap, as phase `name`
        nonlocal mark
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark = now
    mixed = target_bpw is not None or target_size is not None
    check_targets(target_bpw, target_size)
    if calib is not None and not mixed and imatrix_file is None:
        raise LocalLLMError("--calib is for --target-bpw / --target-size / --imatrix")
    preset, overrides = parse_request(type_name or ("Q4_K_M" if mixed else ""), tensor_types)
    dev = encoder_device(device)
    writing = not dry_run
    if out is None and writing:
        raise LocalLLMError("missing OUT: the output GGUF file (or use --dry-run)")
    path = resolve_model(inp)
    if writing:
        check_output(Path(out), [path])  # before reading anything
    measuring = imatrix is None and imatrix_file is not None and imatrix_to_measure(Path(imatrix_file))
    text = calib_text(calib) if mixed or measuring else None
    src = read_source(path, tokenizer_from)
    check_tensors(src.config, [t.info for t in src.tensors])
    if imatrix is None and imatrix_file is not None and not measuring:
        imatrix = read_imatrix(imatrix_file, {t.info.name: t.info.shape for t in src.tensors})
    if mixed:
        if writing and not allow_requantize:  # before the minutes of calibration, not after them
            check_requantize_source([t.info for t in src.tensors])
        budget, align = mixed_budget(src, target_bpw, target_size, overrides)
    chunks = calib_chunks(path, text, calib) if text is not None else None  # the tokenizer only
    lap("read")
    if measuring and not mixed:
        imatrix = measure_imatrix(path, chunks, dev, imatrix_file, calib_name(calib))
        lap("imatrix")
    if mixed:
        plan, preset, imatrix = mixed_plan(
            src, path, budget, align, chunks, imatrix, overrides, dev, progress, imatrix_file if measuring else None,
            calib_name(calib), phases,
        )
        mark = time.perf_counter()  # mixed_plan filled in its own phases
    else:
        plan = preset_plan(preset, [t.info for t in src.tensors], src.model, overrides, imatrix is not None)
        plan = keep_checkpoint_mxfp4(src, plan)
        lap("plan")
    if dry_run:
        named = {t.info.name: t for t in src.tensors}
        errors = measure_errors(plan, lambda name, idx: named[name].read_rows(idx), sample_rows, dev)
        lap("errors")
        return QuantizeResult(preset, plan, errors, None, time.perf_counter() - start, phases)
    if not allow_requantize:
        check_requantize(plan)
    check_output(Path(out), [path, *src.files])
    written = write_source(src, plan, preset, Path(out), dev, imatrix, progress)
    lap("write")
    return QuantizeResult(preset, plan, None, written, time.perf_counter() - start, phases)


def check_requantize_source(infos: Sequence[TensorInfo]) -> None:
    """check_requantize's rule, up front for a mixed-precision plan (whose types are known only after its
    calibration and search, minutes later): an input whose weight matrices are stored quantized is refused
    before any of that."""
    quantized = [t for t in infos if t.source not in UNQUANTIZED and len(t.shape) >= 2]
    if quantized:
        first = quantized[0]
        raise LocalLLMError(
            f"the input is already quantized ({first.name} is {first.source.name}; {len(quantized)} weight "
            "matrices): a mixed-precision plan would re-quantize them, losing quality for no gain in size over "
            "quantizing the 16/32-bit model; give --allow-requantize to do it anyway")


def calib_text(calib: str | None) -> str:
    from localllm.calibrate import calibration_text
    from localllm.commands.eval_chunks import read_text

    text = read_text(calib) if calib else calibration_text()
    check_calibration_text(text, calib or "(built-in)")
    return text


def calib_chunks(path: Path, text: str, calib: str | None) -> list[list[int]]:
    """The calibration chunks, from the tokenizer alone: a text too short is refused before the model loads."""
    from localllm.calibrate import calibration_chunks
    from localllm.load import load_tokenizer
    from localllm.mixed import CALIB_CHUNKS, CALIB_CTX

    try:
        return calibration_chunks(load_tokenizer(str(path)), text, CALIB_CTX, CALIB_CHUNKS)
    except ValueError as e:
        raise LocalLLMError(f"--calib {calib or '(built-in)'}: {e}") from None


def mixed_budget(src: Source, target_bpw: float | None, target_size: int | None,
                 overrides: Sequence[Override]) -> tuple[int, int]:
    """(bytes the tensors may take, the alignment each is padded to), refused when no choice of the
    candidate types fits it (before any calibration)."""
    from localllm.mixed import size_range

    infos = [t.info for t in src.tensors]
    n_values = sum(math.prod(t.shape) for t in infos)
    align = src.alignment if target_size is not None else 1
    smallest, _ = size_range(infos, align, overridden(infos, overrides))
    if target_size is not None:
        check_reachable(smallest, target_size, n_values, None, target_size, header_known=False)
        # the file as write_gguf lays it out: the header, then each tensor padded to the alignment
        # (not the input's header: a folder has none, and the output's keys differ; it takes the
        # metadata's parse: seconds for a large vocabulary, hence the check without it first)
        budget = target_size - data_start(src)
    else:
        budget = int(target_bpw * n_values / 8)
    check_reachable(smallest, budget, n_values, target_bpw, target_size)
    return budget, align


def mixed_plan(src: Source, path: Path, budget: int, align: int, chunks: list[list[int]],
               imatrix: Mapping[str, torch.Tensor] | None, overrides: Sequence[Override], device: str,
               progress: bool, save_imatrix_to: str | Path | None = None, dataset: str = "",
               phases: dict[str, float] | None = None) -> tuple[list[PlanRow], Preset, dict[str, torch.Tensor]]:
    """The per-tensor types of a size budget, from sensitivity measured on the calibration chunks;
    save_imatrix_to: where the imatrix measured on them is saved (llama.cpp's GGUF imatrix format);
    phases: gets the seconds of loading the model and of plan_mixed's phases (MixedPlan.seconds)."""
    from localllm.load import load_model
    from localllm.mixed import plan_mixed
    from localllm.runtime import Runtime

    infos = [t.info for t in src.tensors]
    loading = time.perf_counter()
    # dense, also on CUDA; the portable backend: the gradients need each Linear's own weight in the
    # forward (CUDA's fused q|k|v and gate/up products would leave them unused)
    lm = load_model(str(path), device, torch.float32, keep_quantized=False, backend=Runtime)
    loaded = time.perf_counter() - loading
    with stage_progress(progress) as report:
        if save_imatrix_to is not None:
            from localllm.calibrate import collect_imatrix_stats, save_imatrix

            stats = collect_imatrix_stats(lm.model, chunks, report, dataset)
            save_imatrix(save_imatrix_to, stats)
            imatrix = stats.means()
        mp = plan_mixed(lm, infos, budget, chunks, imatrix, report, align, overridden(infos, overrides))
    if phases is not None:
        phases.update({"load": loaded, **mp.seconds})
    plan = make_plan(infos, mp.choices, overrides)
    return plan, mixed_preset(plan), mp.imatrix


def overridden(infos: Sequence[TensorInfo], overrides: Sequence[Override]) -> dict[str, Q]:
    """Tensor name -> the type a --tensor-type override gives it (after the row-length fallback), as
    make_plan will: the allocator takes these bytes off the budget instead of choosing a type."""
    out = {}
    for t in infos:
        hit = next((o for o in overrides if o.pattern.search(t.name)), None)
        if hit is not None and allows_quantization(t.name, len(t.shape)):
            out[t.name] = fallback(hit.type, t.shape[-1])
    return out


def data_start(src: Source) -> int:
    """Bytes before the first tensor's data in OUT: header, metadata, tensor table and padding.

    A type is a fixed-size field and a shape 8 bytes a dimension, so a stand-in file of 1-value F32
    tensors with the same names and dimension counts has the very same header (general.file_type is
    a UINT32 whatever the preset): written to a temporary folder, less its tensors (one alignment each)."""
    slots = [TensorSlot(t.info.name, (1,) * len(t.info.shape), Q.F32) for t in src.tensors]
    with tempfile.TemporaryDirectory() as folder:
        stand_in = write_gguf(Path(folder) / "header.gguf", src.arch, output_metadata(src, PRESETS["F32"]), slots,
                              lambda i: np.zeros(1, np.float32), alignment=src.alignment, progress=False)
        return stand_in.stat().st_size - len(slots) * src.alignment


def read_imatrix(path: str | Path, shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """shapes: the model's GGUF name -> shape; a file collected on another model is then refused here,
    in one line (its vectors would otherwise fail the encoders mid-plan, or fit and mislead them)."""
    from localllm.calibrate import load_imatrix

    try:
        return load_imatrix(path, shapes)[0]
    except (ValueError, OSError) as e:
        raise LocalLLMError(f"cannot use imatrix {path}: {e}") from None


def measure_imatrix(path: Path, chunks: list[list[int]], device: str, save_to: str | Path, dataset: str = ""
                    ) -> dict[str, torch.Tensor]:
    """Activation statistics of the model on the calibration chunks, saved for reuse in llama.cpp's
    imatrix format (GGUF; legacy .dat when save_to ends in .dat), which llama-quantize also reads."""
    from localllm.calibrate import collect_imatrix_stats, save_imatrix
    from localllm.load import load_model

    lm = load_model(str(path), device, torch.float32, keep_quantized=False)  # dense, also on CUDA
    stats = collect_imatrix_stats(lm.model, chunks, dataset=dataset)
    save_imatrix(save_to, stats)
    return stats.means()


def calib_name(calib: str | None) -> str:
    """The dataset name an imatrix file records: the --calib file, or the built-in text's."""
    return calib if calib is not None else "localllm:calibration.txt"


def parse_size(text: str) -> int:
    """'105454144', '100M', '1.5G' (K/M/G are KiB/MiB/GiB) -> bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        size = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, OverflowError):  # OverflowError: "infM"
        size = 0
    if size <= 0:  # a negative or zero size would only fail later, as "target too small"
        raise LocalLLMError(f"bad size {text!r}: give bytes, or a number with K, M or G")
    return size


def mixed_preset(plan: Sequence[PlanRow]) -> Preset:
    """The preset whose default type holds the most bytes: it names general.file_type."""
    by_type: dict[Q, int] = {}
    for r in plan:
        by_type[r.target] = by_type.get(r.target, 0) + r.nbytes
    main = max((q for q in by_type if q not in (Q.F32, Q.F16, Q.BF16)), key=by_type.get, default=Q.F32)
    return next(p for p in PRESETS.values() if p.default == main)


def plan_model(inp: str | None, type_name: str, tensor_types: Sequence[str] = (), *,
               tokenizer_from: str | Path | None = None, imatrix: bool = False) -> tuple[Source, list[PlanRow]]:
    """Only the plan (nothing quantized): the source and a row per tensor."""
    preset, overrides = parse_request(type_name, tensor_types)
    src = read_source(resolve_model(inp), tokenizer_from)
    return src, preset_plan(preset, [t.info for t in src.tensors], src.model, overrides, imatrix)


def read_source(path: Path, tokenizer_from: str | Path | None) -> Source:
    return read_hf_source(path, tokenizer_from) if path.is_dir() else read_gguf_source(path, tokenizer_from)


def write_source(src: Source, plan: list[PlanRow], preset: Preset, out: Path, device: str,
                 imatrix: Mapping[str, torch.Tensor] | None, progress: bool) -> Path:
    metadata = output_metadata(src, preset)
    slots = [TensorSlot(r.name, r.shape, r.target) for r in plan]
    ext = cpu_encoders(device)

    def make_tensor(i: int) -> np.ndarray:
        t, row = src.tensors[i], plan[i]
        if row.target == row.source and t.raw is not None:
            return t.raw()
        importance = imatrix.get(row.name) if imatrix else None
        native = ext is not None and t.stored is not None and row.target in CPP_TYPES
        return encode(row, t.stored() if native else t.read(), device, importance, ext)

    remove_stale_partials(out, DEFAULT_FILES.stale_partial_seconds)  # left by killed runs
    try:
        return write_gguf(out, src.arch, metadata, slots, make_tensor, alignment=src.alignment,
                          inputs=[src.path, *src.files], progress=progress)
    except OSError as e:  # a full disk, a folder gone meanwhile: nothing was left behind
        raise LocalLLMError(f"writing {out} failed: {e.strerror or e}") from None


def output_metadata(src: Source, preset: Preset) -> dict[str, MetaValue]:
    return native_output_metadata(src.metadata(), preset)


def cpu_encoders(device: str):
    """The compiled CPU kernels whose encoders quantize_tensor uses (same bytes, faster), or None
    (another device, or no build: the torch encoders)."""
    from localllm.kernels.cpu import encoders_for
    from localllm.settings import DEFAULT_CPU

    return encoders_for(device, DEFAULT_CPU.cache_dir)


def encode(row: PlanRow, w: torch.Tensor, device: str, importance: torch.Tensor | None, ext=None) -> np.ndarray:
    # ext: cpu_encoders(device)'s. The types with a C++ encoder take it on the CPU wherever it builds,
    # whatever the device (the same bytes): on a GPU the torch encoders' C-order imatrix searches are
    # thousands of small kernels per chunk of rows (the 32-value types' too: Q4_0 with an imatrix).
    if ext is None and row.target in CPP_K_TYPES | SIMPLE_CPP:
        ext = load_extension(DEFAULT_CPU.cache_dir)
    w = w.reshape(-1, row.shape[-1])
    try:
        on_cpu = ext is not None and row.target in CPP_K_TYPES | SIMPLE_CPP
        return quantize_tensor(w if on_cpu else w.to(device), row.target, importance, ext=ext,
                               threads=write_threads(w.numel(), row.target))
    except ValueError as e:  # non-finite values, a bad imatrix length
        raise LocalLLMError(f"cannot quantize tensor {row.name!r} to {row.target.name}: {e}") from None


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
