"""What `localllm quantize` checks before any expensive work (reading weights, calibrating, encoding).

Everything that can be known from the options, the file system, the input's header and the plan's
candidate types is checked here, first, each as one LocalLLMError line naming the value and what was
expected: a target no plan can reach must not wait for ~15 s of calibration to be refused, and a file
the loader would refuse must not be written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from localllm.quantize.partial import make_partial
from localllm.quantize.plan import TensorInfo
from localllm.quantize.writer import SameFileError, check_not_input

from .config import ModelConfig
from .errors import LocalLLMError


def check_targets(target_bpw: float | None, target_size: int | None) -> None:
    if target_bpw is not None and target_size is not None:
        raise LocalLLMError("give --target-bpw or --target-size, not both")
    if target_bpw is not None and not 0 < target_bpw <= 32:  # nan fails both; 32: F32, the widest type
        raise LocalLLMError(f"--target-bpw must be a positive number of bits per weight, at most 32; got {target_bpw}")


def check_writable_folder(target: Path, what: str) -> None:
    """TARGET's folder exists, is one, and TARGET's partial file can be created in it (tried, not asked:
    os.access says yes to root on a read-only file system)."""
    folder = target.parent
    if folder.exists() and not folder.is_dir():
        raise LocalLLMError(f"{what} folder {folder} is not a folder")
    if not folder.is_dir():
        raise LocalLLMError(f"{what} folder does not exist: {folder}")
    try:
        make_partial(target).unlink()  # were it left (a kill right here), the next writer removes it
    except OSError as e:
        raise LocalLLMError(f"cannot write in {what} folder {folder}: {e.strerror or e}") from None


def check_output(out: Path, inputs: Sequence[Path]) -> None:
    try:
        check_not_input(out, inputs)
    except SameFileError as e:
        raise LocalLLMError(str(e)) from None
    if out.is_dir():
        raise LocalLLMError(f"output {out} is a folder: give a file name")
    check_writable_folder(out, "output")


def imatrix_to_measure(path: Path) -> bool:
    """--imatrix FILE: True when it is to be measured and saved there (it does not exist yet: its
    folder must take it), False when it is to be read."""
    if path.is_dir():
        raise LocalLLMError(f"--imatrix {path} is a folder: give a file name")
    if path.exists():
        return False
    check_writable_folder(path, "--imatrix")
    return True


def check_calibration_text(text: str, source: str) -> None:
    if not text.strip():
        raise LocalLLMError(f"calibration text {source} is empty: give a text of a few thousand words")


def check_tensors(cfg: ModelConfig, tensors: Sequence[TensorInfo]) -> None:
    """Every tensor is one the model built from cfg has, with the shape it has there, and none is
    missing: a file that disagrees with its own config would be written, then refused by the loader.
    The oracle is the loader's own (validate.check_tensor_set)."""
    from .tensor_names import gguf_arch, gguf_to_ours, merge_legacy_shapes
    from .validate import check_tensor_set

    if not tensors:
        raise LocalLLMError("the input has no weights (a vocab-only file?): nothing to quantize")
    arch = gguf_arch(cfg.arch)  # the names are the file's (gpt-oss: post_attention_norm is our ffn_norm)
    shapes = {gguf_to_ours(arch, t.name): tuple(t.shape) for t in tensors}
    shapes = merge_legacy_shapes(shapes, {t.name: t.source for t in tensors}, "the input")  # old Mixtral files
    check_tensor_set(cfg, shapes, "the input")


def check_reachable(smallest: int, budget: int, n_values: int, target_bpw: float | None, target_size: int | None,
                    header_known: bool = True) -> None:
    """A budget below the smallest size the candidate types give (mixed.size_range), in the target's unit.
    header_known=False: budget is the whole --target-size, the header not yet taken off."""
    if budget >= smallest:
        return
    if target_bpw is not None:
        raise LocalLLMError(f"target too small: --target-bpw {target_bpw}, the smallest this model reaches is"
                            f" {smallest * 8 / n_values:.4f} bits per weight")
    if not header_known:
        raise LocalLLMError(f"target too small: --target-size {target_size} bytes, the tensors alone take at least"
                            f" {smallest} bytes ({smallest / 2**20:.2f} MiB)")
    least = smallest + target_size - budget  # budget: target_size less the header
    raise LocalLLMError(f"target too small: --target-size {target_size} bytes, the smallest file this model gives"
                        f" is {least} bytes ({least / 2**20:.2f} MiB)")
