"""`localllm quantize IN OUT TYPE` on a GGUF input without torch: the preset path for a CPU.

`import torch` alone costs more CPU time (~2 s) than llama-quantize's whole run on the default model
(docs/PERFORMANCE.md, issue 20). This path imports neither torch nor anything that imports it: the
input is opened and checked as the loader checks it (open_gguf, check_gguf, check_tensors), planned by
the same preset rules (quantize.plan.preset_plan), and written by the same writer (quantize.writer); each
tensor is encoded by the C++ encoders built as a plain shared library (kernels/cpu_encode_lib.py) on
numpy views of the file's mapping. The bytes are those of quantize_cmd.quantize_model's torch path
(tests/test_quantize_native.py compares the two files for each preset family).

quantize_native returns None, before anything is written, where this path does not apply; the caller
then runs quantize_cmd.quantize_model: a folder input, an imatrix, --target-*, --dry-run, a --device
other than auto / cpu, a planned type without a C++ encoder here (IQ4_NL, IQ4_XS, MXFP4, an F16 / BF16 /
F32 conversion of a quantized tensor is fine), or no C++ compiler (a note says so).

Also here, shared with quantize_cmd (which re-exports them): the result type, the preset request, the
requantize rule, and the GGUF metadata copy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import gguf
import numpy as np

from localllm.errors import LocalLLMError
from localllm.quantize.plan import Override, PlanError, PlanRow, TensorInfo, parse_override, preset_plan
from localllm.quantize.presets import PRESETS, ModelShape, Preset, find_preset
from localllm.quantize.type_facts import encode_threads
from localllm.quantize.writer import MetaValue, TensorSlot, write_gguf

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
K = gguf.Keys.General

# Keys llama-quantize drops (general.file_type and general.quantization_version it sets in place).
NOT_COPIED = {gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
              gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT}
UNQUANTIZED = {Q.F32, Q.F16, Q.BF16}
DENSE = (Q.F32, Q.F16, Q.BF16)


@dataclass
class QuantizeResult:
    preset: Preset
    plan: list[PlanRow]
    errors: list[float] | None  # --dry-run: predicted relative RMSE per tensor
    out: Path | None
    seconds: float
    # phase -> wall seconds, in order: read (input, plan inputs), [imatrix], [load, imatrix, fisher,
    # errors, search: --target-*], plan, [errors: --dry-run], write (encoding and writing)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def parse_request(type_name: str, tensor_types: Sequence[str]) -> tuple[Preset, list[Override]]:
    preset = find_preset(type_name)
    if preset is None:
        raise LocalLLMError(f"unknown quantization type {type_name!r} (types: {', '.join(PRESETS)})")
    try:
        return preset, [parse_override(t) for t in tensor_types]
    except PlanError as e:
        raise LocalLLMError(str(e)) from None


def check_requantize(plan: Sequence[PlanRow]) -> None:
    """llama-quantize's rule (llama-quant.cpp: "requantizing from type %s is disabled"): a tensor stored
    quantized may be copied as it is, never re-encoded to another type, unless --allow-requantize. Its
    values are already rounded: Q4_1 -> Q8_0 writes a bigger file with no gain."""
    requant = [r for r in plan if r.source not in UNQUANTIZED and r.target != r.source]
    if requant:
        first = requant[0]
        raise LocalLLMError(
            f"the input is already quantized ({first.name} is {first.source.name}; {len(requant)} tensors would be "
            f"re-quantized, e.g. to {first.target.name}): requantizing loses quality for no gain in size over "
            "quantizing the 16/32-bit model; give --allow-requantize to do it anyway")


def phase_line(phases: dict[str, float]) -> str:
    """'read 0.9 s, plan 0.0 s, write 41.2 s': where the time went, in order."""
    return ", ".join(f"{name} {sec:.1f} s" for name, sec in phases.items())


def quantize_native(inp: str | None, out: str | Path | None, type_name: str, tensor_types: Sequence[str] = (),
                    *, threads: int, allow_requantize: bool = True, progress: bool = True,
                    cache_dir: Path | None = None) -> QuantizeResult | None:
    """quantize_cmd.quantize_model(inp, out, type_name, tensor_types) for a GGUF input on the CPU, without
    torch; None where this path does not apply (module docstring), nothing written then. threads: the
    encoders' (-t/--threads, localllm.cores.thread_count)."""
    from localllm.gguf_file import open_gguf
    from localllm.kernels.cpu_encode_lib import encodes, load_encoders
    from localllm.quantize.partial import remove_stale_partials
    from localllm.quantize_checks import check_output, check_tensors
    from localllm.registry import resolve_model
    from localllm.settings import DEFAULT_CPU, DEFAULT_FILES
    from localllm.validate import check_gguf

    start = mark = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now
    preset, overrides = parse_request(type_name, tensor_types)
    if out is None:
        raise LocalLLMError("missing OUT: the output GGUF file (or use --dry-run)")
    path = resolve_model(inp)
    if path.is_dir():
        return None
    out = Path(out)
    check_output(out, [path])  # before reading anything
    f = open_gguf(path)
    if not f.tensors:
        raise LocalLLMError(f"the input has no weights (a vocab-only file?): nothing to quantize: {path}")
    cfg = check_gguf(f)  # config, types and every tensor's shape, as the loader checks them
    model = ModelShape(f.metadata["general.architecture"], cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.n_experts)
    tensors = list(f.tensors.values())
    infos = [TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type) for t in tensors]
    check_tensors(cfg, infos)
    lap("read")
    plan = preset_plan(preset, infos, model, overrides, False)
    lap("plan")
    lib = None
    if any(r.target != r.source and r.target not in DENSE for r in plan):
        lib = load_encoders(cache_dir or DEFAULT_CPU.cache_dir)
        if lib is None or not all(r.target == r.source or r.target in DENSE or encodes(lib, r.target) for r in plan):
            return None
    if not allow_requantize:
        check_requantize(plan)
    metadata = output_metadata(read_gguf_metadata(path, f=f), preset)
    alignment = int(f.metadata.get(K.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))
    slots = [TensorSlot(r.name, r.shape, r.target) for r in plan]

    def make_tensor(i: int) -> np.ndarray:
        return encode_tensor(plan[i], tensors[i], lib, threads)

    remove_stale_partials(out, DEFAULT_FILES.stale_partial_seconds)  # left by killed runs
    try:
        written = write_gguf(out, model.arch, metadata, slots, make_tensor, alignment=alignment, inputs=[path],
                             progress=progress)
    except OSError as e:  # a full disk, a folder gone meanwhile: nothing was left behind
        raise LocalLLMError(f"writing {out} failed: {e.strerror or e}") from None
    lap("write")
    return QuantizeResult(preset, plan, None, written, time.perf_counter() - start, phases)


def encode_tensor(row: PlanRow, t: gguf.ReaderTensor, lib, threads: int) -> np.ndarray:
    """Tensor t's bytes as row.target: its stored bytes where the type is kept; else its values (the
    mapping's F16 / F32 rows as they are, BF16 widened, a quantized type decoded by the gguf package, as
    the torch path's read()) encoded by the C++ encoders, or converted for an F32 / F16 / BF16 target
    (quantize/simple.py's rules: a cast, rounding to nearest even; BF16: gguf's rule)."""
    if row.target == row.source:
        return np.ascontiguousarray(t.data).view(np.uint8)
    cols = row.shape[-1]
    if row.source in (Q.F16, Q.F32):
        x = np.asarray(t.data).reshape(-1, cols)
    else:  # BF16 or a quantized type (requantize): gguf's values, fp32
        x = gguf.quants.dequantize(np.asarray(t.data), row.source).astype(np.float32, copy=False).reshape(-1, cols)
    if row.target == Q.F32:
        return x.astype(np.float32)
    if row.target == Q.F16:
        return x.astype(np.float16)
    if row.target == Q.BF16:
        return gguf.quants.quantize(x.astype(np.float32), Q.BF16)
    try:
        from localllm.kernels.cpu_encode_lib import encode

        return encode(lib, x, int(row.target), gguf.GGML_QUANT_SIZES[row.target][1],
                      encode_threads(math.prod(row.shape), row.target, threads))
    except ValueError:  # non-finite values
        raise LocalLLMError(f"cannot quantize tensor {row.name!r} to {row.target.name}: "
                            f"cannot quantize non-finite values to {row.target.name}") from None


# ---- the GGUF metadata copy

def output_metadata(metadata: dict[str, MetaValue], preset: Preset) -> dict[str, MetaValue]:
    metadata = dict(metadata)
    # set in place where the input has them (dict order), else appended
    metadata[K.FILE_TYPE] = MetaValue(int(preset.file_type), V.UINT32)
    metadata[K.QUANTIZATION_VERSION] = MetaValue(gguf.GGML_QUANT_VERSION, V.UINT32)
    return metadata


def read_gguf_metadata(path: Path, keep: Callable[[str], bool] = lambda key: key not in NOT_COPIED,
                       f=None) -> dict[str, MetaValue]:
    """Every key of a (validated) GGUF file with its GGUF type, in file order; strings as bytes. From
    open_gguf's values and types (its metadata cache: no second parse of a large vocabulary); a cache
    entry without the types falls back to gguf's reader. f: the file as open_gguf opened it (not opened
    and checked again)."""
    from localllm.gguf_file import open_gguf

    f = open_gguf(path) if f is None else f
    if f.value_types is not None:
        return {key: typed_value(key, value, *f.value_types[key]) for key, value in f.metadata.items() if keep(key)}
    reader = gguf.GGUFReader(path, "r")
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not keep(key):
            continue
        out[key] = meta_value(key, field)
    return out


def typed_value(key: str, value, vtype: int, item: int | None) -> MetaValue:
    """A plain metadata value (gguf_meta.read_kv_section's: strings decoded, arrays as lists) with its
    GGUF type -> what the writer copies (strings as their UTF-8 bytes, as meta_value gives them)."""
    if vtype == V.STRING:
        return MetaValue(value.encode("utf-8"), V.STRING)
    if vtype != V.ARRAY:
        return MetaValue(value, V(vtype))
    if not value:
        raise LocalLLMError(f"metadata key {key!r} is an empty or nested array, which localllm cannot copy")
    if item == V.STRING:
        return MetaValue([s.encode("utf-8") for s in value], V.ARRAY, V.STRING)
    return MetaValue(list(value), V.ARRAY, V(item))


def meta_value(key: str, field: gguf.ReaderField) -> MetaValue:
    main = field.types[0]
    if main == V.STRING:
        return MetaValue(bytes(field.parts[field.data[0]]), V.STRING)
    if main != V.ARRAY:
        return MetaValue(field.parts[field.data[0]][0].item(), main)
    if len(field.data) == 0 or len(field.types) != 2:
        raise LocalLLMError(f"metadata key {key!r} is an empty or nested array, which localllm cannot copy")
    sub = field.types[1]
    if sub == V.STRING:
        return MetaValue([bytes(field.parts[i]) for i in field.data], V.ARRAY, V.STRING)
    return MetaValue([field.parts[i][0].item() for i in field.data], V.ARRAY, sub)
