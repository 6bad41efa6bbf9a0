"""Open a GGUF file through the `gguf` package (memory-mapped) and check it before we trust it.

Nothing here parses GGUF by hand: `gguf.GGUFReader` reads the header, metadata and tensor table and
maps the data with numpy.memmap, so no full copy of the file is made. We only turn its failures and
the inconsistencies it does not check (reads past the end of the file, unknown tensor types) into
one-line errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import LocalLLMError
from .gguf_cache import Header, read_header, write_header
from .settings import DEFAULT_CPU

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


class _PastEnd(Exception):
    """A read that would run past the end of the file; args: (end byte, file size)."""


class _BadTensor(Exception):
    """A tensor-table entry we cannot trust; args: (one-line reason,)."""


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader plus the checks it lacks, so a cut or corrupt file names its problem.

    GGUFReader slices its memmap without looking at the file's size: a truncated header surfaces as
    a numpy view/reshape error, a tensor type id that is not a ggml type as an enum ValueError.
    """

    def __init__(self, path: Path, cached: Header | None):
        self.cached = cached  # set before the parse, which calls _build_fields
        self.kv_end = 0
        # "c" (copy-on-write): numpy arrays that torch can wrap without a copy; the file is never written.
        super().__init__(path, "c")

    def _build_fields(self, offs, count):
        if self.cached is None:
            self.kv_end = super()._build_fields(offs, count)
            return self.kv_end
        # A cached key/value section: gguf parses only the alignment field (its __init__ reads it).
        if self.cached.alignment_offset is not None:
            super()._build_fields(self.cached.alignment_offset, 1)
        self.kv_end = self.cached.kv_end
        return self.kv_end

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _PastEnd(end, len(self.data))
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs, fields):
        # Check every tensor before the reader maps any (it maps data eagerly, without bounds).
        for field in fields:
            _check_tensor_info(field, int(start_offs), len(self.data))
        super()._build_tensors(start_offs, fields)


def _check_tensor_info(field: gguf.ReaderField, data_start: int, file_size: int) -> None:
    """Raise _BadTensor for an unknown type id or data that ends past the end of the file."""
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise _BadTensor(f"tensor {name!r} has unknown type id {int(raw_type[0])} (not a ggml type)") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    # Python ints: a corrupt shape must not overflow numpy's uint64 into a small, "valid" size.
    end = data_start + int(offset[0]) + math.prod(int(d) for d in dims) * type_size // block
    if end > file_size:
        raise _BadTensor(
            f"truncated GGUF (data past the end of the file): tensor {name!r} ends at byte {end},"
            f" the file has {file_size} bytes"
        )


def open_gguf(path: str | Path, cache_dir: Path | None = DEFAULT_CPU.cache_dir) -> GGUFFile:
    """Open and validate a GGUF file; raise LocalLLMError with one line naming any problem.
    cache_dir: where a large key/value section is cached once parsed (localllm/gguf_cache.py); None: never."""
    path = Path(path)
    _check_magic(path)
    cached = read_header(path, cache_dir) if cache_dir is not None else None
    try:
        reader = _CheckedReader(path, cached)
    except _PastEnd as e:
        end, size = e.args
        raise LocalLLMError(
            f"truncated GGUF (header or metadata past the end of the file): needs byte {end},"
            f" the file has {size} bytes: {path}"
        ) from None
    except _BadTensor as e:
        raise LocalLLMError(f"{e.args[0]}: {path}") from None
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError) as e:
        raise LocalLLMError(f"cannot read GGUF file {path}: {_reason(e)}") from None
    except NotImplementedError as e:
        raise LocalLLMError(f"unsupported GGUF file {path}: {_reason(e)}") from None
    metadata = cached.metadata if cached is not None else read_metadata_fields(reader)
    if cached is None and cache_dir is not None and reader.kv_end >= DEFAULT_CPU.header_cache_min_bytes:
        align = reader.fields.get("general.alignment")
        write_header(path, cache_dir, Header(metadata, reader.kv_end, None if align is None else int(align.offset)))
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors})


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
