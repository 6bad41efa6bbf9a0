"""Open a GGUF file through the `gguf` package (memory-mapped) and check it before we trust it.

Nothing here parses GGUF by hand: `gguf.GGUFReader` reads the header, metadata and tensor table and
maps the data with numpy.memmap, so no full copy of the file is made. We only turn its failures and
the inconsistencies it does not check (data past the end of the file) into one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import LocalLLMError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # GGUF key -> plain python value (str, int, float, bool, list)
    tensors: dict[str, gguf.ReaderTensor]  # tensor name -> reader tensor (data is a memmap view)


def read_metadata_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value pairs as plain python values; the GGUF.* header pseudo-keys are skipped."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _check_magic(path: Path) -> None:
    if not path.exists():
        raise LocalLLMError(f"file not found: {path}")
    if not path.is_file():
        raise LocalLLMError(f"not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise LocalLLMError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")


def _check_tensor_bounds(path: Path, reader: gguf.GGUFReader) -> None:
    # GGUFReader maps tensors lazily and numpy raises deep inside for data past the end; check here.
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise LocalLLMError(
                f"truncated GGUF: tensor {t.name!r} data ends at byte {end} but the file has {size} bytes: {path}"
            )


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file; raise LocalLLMError with one line naming any problem."""
    path = Path(path)
    _check_magic(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError) as e:
        raise LocalLLMError(f"cannot read GGUF file {path}: {_reason(e)}") from None
    except NotImplementedError as e:
        raise LocalLLMError(f"unsupported GGUF file {path}: {_reason(e)}") from None
    _check_tensor_bounds(path, reader)
    return GGUFFile(path, read_metadata_fields(reader), {t.name: t for t in reader.tensors})


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def tensor_to_numpy(t: gguf.ReaderTensor) -> np.ndarray:
    """Decode one tensor to float32 with exactly the values of gguf.quants.dequantize.

    Shape is numpy order (rows, cols) = torch Linear (out_features, in_features).
    """
    from quantize.formats import dequantize  # formats own the block decoders

    return dequantize(t.data, t.tensor_type)
