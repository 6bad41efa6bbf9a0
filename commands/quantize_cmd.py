"""`localllm quantize`: read a model, plan a type per tensor, write a GGUF file.

What it reads is quantize_source.py's (the inputs, GGUF or safetensors: its docstring says how each is
read); a mixed-precision plan and the imatrix are quantize_mixed.py's; this module plans and writes
(their names stay importable from here).

The CLI runs a preset on a GGUF input without torch where it can (commands/quantize_native.py: the
same bytes); this module is the torch path for everything else.

Types: a preset (quantize.presets) picks each tensor's type, `--tensor-type REGEX=TYPE` overrides it,
and rows that do not split into blocks of the chosen type fall back (quantize.plan).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping, Sequence

import gguf
import numpy as np
import torch

from localllm.kernels.cpu import load_extension
from localllm.quantize import quantize_tensor
from localllm.quantize.blocks import CPP_K_TYPES, SIMPLE_CPP, write_threads
from localllm.quantize.plan import PlanRow, measure_errors, preset_plan
from localllm.quantize.presets import Preset
from localllm.quantize.partial import remove_stale_partials
from localllm.quantize.writer import TensorSlot, write_gguf

# torch-free pieces, shared with the torch-free preset path (and re-exported here)
from localllm.commands.quantize_native import (  # noqa: F401
    NOT_COPIED, UNQUANTIZED, QuantizeResult, meta_value, check_requantize, output_metadata as native_output_metadata,
    parse_request, phase_line, read_gguf_metadata, typed_value,
)
_meta_value = meta_value  # its earlier name (tests)

from localllm.commands.quantize_mixed import (  # noqa: F401 (re-exported)
    check_requantize_source, data_start, measure_imatrix, mixed_budget, mixed_plan, mixed_preset, overridden,
    read_imatrix,
)
from localllm.commands.quantize_source import (  # noqa: F401 (re-exported)
    HF_SOURCE_ARCHS, SAFETENSORS_DTYPES, Source, SourceTensor, keep_checkpoint_mxfp4, moe_tensors, output_metadata,
    read_gguf_source, read_hf_source, read_source, tokenizer_metadata,
)
from localllm.device import encoder_device
from localllm.errors import LocalLLMError
from localllm.registry import resolve_model
from localllm.settings import DEFAULT_CPU, DEFAULT_FILES
from localllm.quantize_checks import check_calibration_text, check_output, check_targets, check_tensors, imatrix_to_measure

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
K = gguf.Keys.General


CPP_TYPES = CPP_K_TYPES | SIMPLE_CPP  # the types whose C++ encoders take a stored F16 tensor as it is

TORCH_TYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}


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


def calib_text(calib: str | None) -> str:
    from localllm.calibrate import calibration_text
    from localllm.commands.evaluate import read_text

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


def plan_model(inp: str | None, type_name: str, tensor_types: Sequence[str] = (), *,
               tokenizer_from: str | Path | None = None, imatrix: bool = False) -> tuple[Source, list[PlanRow]]:
    """Only the plan (nothing quantized): the source and a row per tensor."""
    preset, overrides = parse_request(type_name, tensor_types)
    src = read_source(resolve_model(inp), tokenizer_from)
    return src, preset_plan(preset, [t.info for t in src.tensors], src.model, overrides, imatrix)


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
