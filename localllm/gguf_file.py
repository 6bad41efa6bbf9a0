"""Open a GGUF file through the `gguf` package (memory-mapped) and check it before we trust it.

`gguf.GGUFReader` reads the header and the tensor table and maps the data with numpy.memmap, so no
full copy of the file is made. It checks almost nothing, so _CheckedReader overrides the parts that
read counts and sizes from the file: the key/value section is read by gguf_meta.py (bounded, every
string UTF-8, errors naming the key and byte), every tensor-table entry is checked before the reader
maps its data (name, dimension count, type, whole blocks, bytes inside the file), and the data must be
laid out as llama.cpp's gguf.cpp requires: each tensor at the running offset of the ones before it,
padded to general.alignment (so no two tensors overlap and a swapped type id cannot go unnoticed).
Every failure becomes one LocalLLMError line.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import LocalLLMError
from .gguf_cache import Header, read_header, write_header
from .gguf_split import join_parts
from .progress import elapsed_spinner
from .gguf_meta import CorruptGGUF, KVReader, PastEnd, check_known_keys, read_kv_section
from .settings import DEFAULT_CPU, DEFAULT_LIMITS, LoaderLimits

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version u32, tensor count u64, key/value count u64
MIN_KV_BYTES = 13  # key length u64, value type u32, one byte of value
MIN_TENSOR_INFO_BYTES = 24  # name length u64, dimension count u32, type u32, data offset u64


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # GGUF key -> plain python value (str, int, float, bool, list)
    tensors: dict[str, gguf.ReaderTensor]  # tensor name -> reader tensor (data is a memmap view)
    parts: tuple[Path, ...] = ()  # a split GGUF's files, path first (gguf_split.py); () for one file
    # GGUF key -> (value type, an array's item type or None), as gguf.GGUFValueType ints; None: unknown
    # (a cache entry written without them)
    value_types: dict[str, tuple[int, int | None]] | None = None


def read_metadata_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value pairs of a plain gguf.GGUFReader as python values; GGUF.* pseudo-keys skipped."""
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
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise LocalLLMError(f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF'): {path}")
    if len(head) == 8:
        version = int.from_bytes(head[4:], "little")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            version = int.from_bytes(head[4:], "big")
        if version not in SUPPORTED_VERSIONS:
            raise LocalLLMError(f"unsupported GGUF version {version} (supported: 2, 3): {path}")


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader with the checks it lacks (see the module docstring); after __init__, `metadata`
    holds the key/value section's values and `kv_end` where it ends."""

    def __init__(self, path: Path, cached: Header | None, limits: LoaderLimits):
        self.cached = cached  # set before the parse, which calls _build_fields
        self.limits = limits
        self.kv_end = 0
        self.metadata: dict[str, Any] = {}
        self.alignment_offset: int | None = None
        self.value_types: dict[str, tuple[int, int | None]] | None = None
        # "c" (copy-on-write): numpy arrays that torch can wrap without a copy; the file is never written.
        super().__init__(path, "c")

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise PastEnd(end, len(self.data))
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs, count):
        n_tensors, n_kv, size = int(self.fields["GGUF.tensor_count"].parts[0][0]), int(count), len(self.data)
        if HEADER_BYTES + MIN_KV_BYTES * n_kv + MIN_TENSOR_INFO_BYTES * n_tensors > size:
            raise CorruptGGUF(
                f"the GGUF header says {n_tensors} tensors and {n_kv} metadata keys, impossible in a file of {size} bytes"
            )
        if self.cached is not None:
            # A cached key/value section: gguf parses only the alignment field (its __init__ reads it).
            if self.cached.alignment_offset is not None:
                super()._build_fields(self.cached.alignment_offset, 1)
            self.metadata, self.kv_end = self.cached.metadata, self.cached.kv_end
            self.value_types = self.cached.types
            return self.kv_end
        kv = KVReader(memoryview(self.data), "<" if self.byte_order == "I" else ">", self.limits.max_metadata_array)
        self.metadata, where, self.kv_end = read_kv_section(kv, int(offs), n_kv)
        self.value_types = {k: (int(t), None if item is None else int(item)) for k, (_, t, item) in where.items()}
        if "general.alignment" in where:
            self._push_alignment(*where["general.alignment"][:2])
        return self.kv_end

    def _push_alignment(self, at: int, vtype: gguf.GGUFValueType) -> None:
        """Hand general.alignment to gguf's own check (its __init__ reads the field) once it is sane."""
        value = self.metadata["general.alignment"]
        if vtype != gguf.GGUFValueType.UINT32 or value <= 0 or value & (value - 1):
            raise CorruptGGUF(
                f"metadata 'general.alignment' at byte {at} is {value!r} ({vtype.name}), expected a power of two (UINT32)"
            )
        self.alignment_offset = at
        field = gguf.ReaderField(at, "general.alignment", [np.array([value], np.uint32)], [0], [vtype])
        self._push_field(field, skip_sum=True)

    def _get_tensor_info_field(self, orig_offs):
        # As GGUFReader's, with the name decoded and the dimension count bounded before use.
        name_len, name_data = self._get_str(orig_offs)
        try:
            name = str(bytes(name_data), encoding="utf-8")
        except UnicodeDecodeError as e:
            bad = orig_offs + 8 + e.start
            raise CorruptGGUF(f"tensor name at byte {orig_offs} is not valid UTF-8 (invalid byte at offset {bad})") from None
        offs = orig_offs + 8 + int(name_data.nbytes)
        n_dims = self._get(offs, np.uint32)
        if int(n_dims[0]) > self.limits.max_dims:
            raise CorruptGGUF(f"tensor {name!r} has {int(n_dims[0])} dimensions, at most {self.limits.max_dims} allowed")
        dims = self._get(offs + 4, np.uint64, n_dims[0])
        offs += 4 + int(dims.nbytes)
        raw_dtype = self._get(offs, np.uint32)
        offset_tensor = self._get(offs + 4, np.uint64)
        parts = [name_len, name_data, n_dims, dims, raw_dtype, offset_tensor]
        return gguf.ReaderField(orig_offs, name, parts, [1, 3, 4, 5])

    def _build_tensors(self, start_offs, fields):
        # Check every tensor before the reader maps any (it maps data eagerly, without bounds).
        check_tensor_table(fields, int(start_offs), len(self.data), int(self.alignment))
        super()._build_tensors(start_offs, fields)


def check_tensor_table(fields: list[gguf.ReaderField], data_start: int, file_size: int, alignment: int) -> None:
    """Raise CorruptGGUF for an unknown type id, a row that is not whole blocks, data past the end of
    the file, or data not at the running offset (gguf.cpp: offset == sum of the padded sizes before)."""
    expected, previous = 0, "the start of the data section"
    for field in fields:
        name, nbytes, offset = _tensor_bytes(field)
        end = data_start + offset + nbytes
        if end > file_size:
            raise CorruptGGUF(
                f"truncated GGUF (data past the end of the file): tensor {name!r} ends at byte {end},"
                f" the file has {file_size} bytes"
            )
        if offset != expected:
            raise CorruptGGUF(
                f"tensor {name!r} has its data at offset {offset}, expected {expected} right after {previous}"
                f" (padded to {alignment} bytes): overlapping tensors, or a wrong type or shape"
            )
        expected += -(-nbytes // alignment) * alignment
        previous = f"tensor {name!r} ({nbytes} bytes)"


def _tensor_bytes(field: gguf.ReaderField) -> tuple[str, int, int]:
    """(name, data bytes, data offset) of one tensor-table entry, its type and row length checked."""
    _, _, _, dims, raw_type, offset = field.parts
    name = field.name
    try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise CorruptGGUF(f"tensor {name!r} has unknown type id {int(raw_type[0])} (not a ggml type)") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = [int(d) for d in dims]  # python ints: a corrupt shape must not overflow into a small size
    if shape and shape[0] % block:
        raise CorruptGGUF(
            f"tensor {name!r} of type {qtype.name} has rows of {shape[0]} values, not a whole number of"
            f" {block}-value blocks"
        )
    return name, math.prod(shape) * type_size // block, int(offset[0])


def open_gguf(
    path: str | Path, cache_dir: Path | None = DEFAULT_CPU.cache_dir, limits: LoaderLimits = DEFAULT_LIMITS
) -> GGUFFile:
    """Open and validate a GGUF file; raise LocalLLMError with one line naming any problem. A split GGUF
    (gguf-split's parts, path the first) opens as one model: localllm/gguf_split.py.
    cache_dir: where a large key/value section is cached once parsed (localllm/gguf_cache.py); None: never."""
    first = open_one_gguf(path, cache_dir, limits)
    return join_parts(first, lambda part: open_one_gguf(part, cache_dir, limits))


def open_one_gguf(path: str | Path, cache_dir: Path | None, limits: LoaderLimits) -> GGUFFile:
    """One GGUF file, opened and validated (a split GGUF's part as it is)."""
    path = Path(path)
    _check_magic(path)
    cached = read_header(path, cache_dir) if cache_dir is not None else None
    # The first parse of a large vocabulary takes seconds (19 s for qwen2's 151k tokens): a spinner after
    # one second, on a terminal only; later opens read the cache (gguf_cache.py).
    slow = elapsed_spinner(f"reading {path.name}'s metadata (once: cached for later runs)", delay=1.0) \
        if cached is None else nullcontext()
    try:
        with slow:
            reader = _CheckedReader(path, cached, limits)
    except PastEnd as e:
        end, size = e.args
        raise LocalLLMError(
            f"truncated GGUF (header or metadata past the end of the file): needs byte {end},"
            f" the file has {size} bytes: {path}"
        ) from None
    except CorruptGGUF as e:
        raise LocalLLMError(f"{e.args[0]}: {path}") from None
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError, OverflowError) as e:
        raise LocalLLMError(f"cannot read GGUF file {path}: {_reason(e)}") from None
    except NotImplementedError as e:
        raise LocalLLMError(f"unsupported GGUF file {path}: {_reason(e)}") from None
    metadata = reader.metadata
    try:
        check_known_keys(metadata)
    except CorruptGGUF as e:
        raise LocalLLMError(f"{e.args[0]}: {path}") from None
    if cached is None and cache_dir is not None and reader.kv_end >= DEFAULT_CPU.header_cache_min_bytes:
        write_header(path, cache_dir, Header(metadata, reader.kv_end, reader.alignment_offset, reader.value_types))
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors}, value_types=reader.value_types)


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
