"""Mixed precision for `localllm quantize --target-bpw / --target-size`: the size budget (refused up
front when out of reach), the plan from sensitivity measured on calibration chunks, and the imatrix
(read from llama.cpp's file, or measured and saved in its format)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import gguf
import numpy as np
import torch

from localllm.quantize.plan import Override, PlanRow, TensorInfo, make_plan
from localllm.quantize.presets import PRESETS, Preset, allows_quantization, fallback
from localllm.quantize.writer import TensorSlot, write_gguf

from localllm.commands.quantize_native import UNQUANTIZED
from localllm.commands.quantize_source import Source, output_metadata
from localllm.errors import LocalLLMError
from localllm.progress import stage_progress
from localllm.quantize_checks import check_reachable

Q = gguf.GGMLQuantizationType


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
            from localllm.imatrix import collect_imatrix_stats, save_imatrix

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
    from localllm.imatrix import load_imatrix

    try:
        return load_imatrix(path, shapes)[0]
    except (ValueError, OSError) as e:
        raise LocalLLMError(f"cannot use imatrix {path}: {e}") from None


def measure_imatrix(path: Path, chunks: list[list[int]], device: str, save_to: str | Path, dataset: str = ""
                    ) -> dict[str, torch.Tensor]:
    """Activation statistics of the model on the calibration chunks, saved for reuse in llama.cpp's
    imatrix format (GGUF; legacy .dat when save_to ends in .dat), which llama-quantize also reads."""
    from localllm.imatrix import collect_imatrix_stats, save_imatrix
    from localllm.load import load_model
    from localllm.runtime import Runtime

    # dense, also on CUDA; the portable backend: its mixture-of-experts forward runs each expert's
    # ExpertLinear, whose inputs the expert statistics record (CUDA's grouped products would skip them)
    lm = load_model(str(path), device, torch.float32, keep_quantized=False, backend=Runtime)
    stats = collect_imatrix_stats(lm.model, chunks, dataset=dataset)
    save_imatrix(save_to, stats)
    return stats.means()


def mixed_preset(plan: Sequence[PlanRow]) -> Preset:
    """The preset whose default type holds the most bytes: it names general.file_type."""
    by_type: dict[Q, int] = {}
    for r in plan:
        by_type[r.target] = by_type.get(r.target, 0) + r.nbytes
    main = max((q for q in by_type if q not in (Q.F32, Q.F16, Q.BF16)), key=by_type.get, default=Q.F32)
    return next(p for p in PRESETS.values() if p.default == main)
