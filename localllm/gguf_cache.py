"""A cache of a GGUF file's parsed key/value section, so opening a model does not re-parse its tokenizer.

gguf.GGUFReader walks every array element of the metadata (49k tokens and 49k merges for SmolLM2:
about 2 s on the 2-core CPU). The first open parses as usual and, when the section is large, saves
the plain values (JSON) with where the section ends; later opens of the same file (same path, size
and modification time) skip that walk: the reader still parses the header, the tensor table and the
alignment field itself (gguf_file._CheckedReader).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]  # GGUF key -> plain python value, as gguf_file.read_metadata_fields gives
    kv_end: int  # byte offset where the tensor table starts
    alignment_offset: int | None  # byte offset of the general.alignment key/value, if the file has one


def entry_path(path: Path, folder: Path) -> Path:
    return folder / "gguf" / (hashlib.sha1(str(path.resolve()).encode()).hexdigest() + ".json")


def file_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def read_header(path: Path, folder: Path) -> Header | None:
    """The cached header of this very file (same size and mtime), else None."""
    try:
        entry = json.loads(entry_path(path, folder).read_text())
    except (OSError, ValueError):  # absent or unreadable: parse the file instead
        return None
    if entry.get("key") != file_key(path):
        return None
    return Header(entry["metadata"], entry["kv_end"], entry["alignment_offset"])


def write_header(path: Path, folder: Path, header: Header) -> None:
    """Save atomically; a cache folder that cannot be written only costs the next open its parse time."""
    target = entry_path(path, folder)
    entry = {"key": file_key(path), "kv_end": header.kv_end, "alignment_offset": header.alignment_offset,
             "metadata": header.metadata}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, target)
    except OSError:
        pass
