"""Write a GGUF v3 file with `gguf.GGUFWriter`, one tensor at a time, all or nothing.

The metadata and the tensor table go first (every tensor's type and size is known from the plan),
then each tensor's raw bytes as `make_tensor(i)` produces them, so only one tensor is in memory at a
time. The file is written under a temporary name next to OUT and renamed onto OUT (`os.replace`)
only when complete; on any exception, Ctrl-C included (and SIGTERM, which the CLI turns into one),
the temporary file is deleted and OUT is left as it was. A writer killed outright leaves it behind:
quantize/partial.py names it after the writer's pid, and the next writer of OUT removes it.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import gguf
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .partial import make_partial

Q = gguf.GGMLQuantizationType


class SameFileError(ValueError):
    """OUT is one of the input files."""


@dataclass(frozen=True)
class MetaValue:
    """One metadata value with its GGUF type (sub_type: the element type of an array)."""

    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]  # numpy order: (..., cols), in values
    type: Q

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        return math.prod(self.shape) // block * size


def check_not_input(out: Path, inputs: Sequence[Path]) -> None:
    """Refuse to write over an input: the same resolved path, or the same file by another name."""
    for inp in inputs:
        same = Path(out).resolve() == Path(inp).resolve()
        if not same and Path(out).exists():
            try:
                same = os.path.samefile(out, inp)
            except OSError:
                same = False
        if same:
            raise SameFileError(f"output {out} is the input file {inp}: choose another output path")


class _Writer(gguf.GGUFWriter):
    """gguf.GGUFWriter whose typed arrays (a vocabulary: 100k+ tokens, scores, token types) are packed in
    one step instead of GGUFWriter._pack_val's item by item (several struct.pack calls and bytearray
    copies per item: ~0.3 s for SmolLM2's 147k items). The same bytes: the array's item type and count,
    then each item, a string as its uint64 length and UTF-8 bytes, a number in _pack_val's own struct
    format, little-endian; anything else (a scalar, a big-endian file, a bool array) goes to _pack_val."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        V = gguf.GGUFValueType
        fmt = getattr(self, "_simple_value_packing", {}).get(sub_type)
        if (vtype != V.ARRAY or not isinstance(val, list) or not val or self.endianess != gguf.GGUFEndian.LITTLE
                or sub_type is None or sub_type == V.BOOL or (fmt is None and sub_type != V.STRING)):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
        if sub_type != V.STRING:
            return head + struct.pack(f"<{len(val)}{fmt}", *val)
        items = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
        return head + b"".join(struct.pack("<Q", len(b)) + b for b in items)


def write_gguf(out: Path, arch: str, metadata: dict[str, MetaValue], tensors: Sequence[TensorSlot],
               make_tensor: Callable[[int], np.ndarray], *, alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT,
               inputs: Sequence[Path] = (), progress: bool = True, console: Console | None = None) -> Path:
    """Write OUT: `metadata` in its order (general.architecture first, from `arch`), then the tensors.

    make_tensor(i) -> tensor i's raw GGUF bytes: uint8 (..., bytes per row), or any array of exactly
    tensors[i].nbytes bytes."""
    out = Path(out)
    check_not_input(out, inputs)
    tmp = make_partial(out)  # .OUT.PID.XXXX.partial (quantize/partial.py)
    writer = _Writer(tmp, arch)
    try:
        writer.data_alignment = alignment
        if alignment != gguf.GGUF_DEFAULT_ALIGNMENT and gguf.Keys.General.ALIGNMENT not in metadata:
            metadata = {**metadata, gguf.Keys.General.ALIGNMENT: MetaValue(alignment, gguf.GGUFValueType.UINT32)}
        for key, v in metadata.items():
            if key != gguf.Keys.General.ARCHITECTURE:
                writer.add_key_value(key, v.value, v.type, v.sub_type)
        for t in tensors:
            # a non-uint8 dtype keeps the shape as values; raw_dtype gives the type
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with _progress(progress, console) as bar:
            task = bar.add_task("quantizing", total=len(tensors), name="")
            for i, t in enumerate(tensors):
                bar.update(task, name=t.name)
                data = np.ascontiguousarray(make_tensor(i)).view(np.uint8).reshape(-1)
                if data.nbytes != t.nbytes:
                    raise ValueError(f"tensor {t.name!r}: {data.nbytes} bytes, expected {t.nbytes} for {t.type.name}")
                writer.write_tensor_data(data)
                bar.advance(task)
        writer.close()
        _set_default_mode(tmp)
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _progress(enabled: bool, console: Console | None) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[name]}"),
        console=console or Console(stderr=True), transient=True, disable=not enabled,
    )


def _set_default_mode(path: Path) -> None:
    """mkstemp makes the file owner-only; give it the mode a plain open() would (0666 less umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
