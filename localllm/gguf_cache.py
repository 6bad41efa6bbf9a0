"""A cache of a GGUF file's parsed key/value section, so opening a model does not re-parse its tokenizer.

gguf.GGUFReader walks every array element of the metadata (49k tokens and 49k merges for SmolLM2:
about 2 s on the 2-core CPU). The first open parses as usual and, when the section is large, saves
the plain values (JSON) with where the section ends; later opens of the same file skip that walk:
the reader still parses the header, the tensor table and the alignment field itself
(gguf_file._CheckedReader).

"The same file" is decided by content, not by path, size and mtime (which an in-place edit of the same
size within the mtime's resolution keeps): an entry holds the sha256 of the file's first kv_end bytes,
which are all the bytes its metadata was parsed from, and is used only when the file's bytes hash the
same. Reading them costs about a millisecond per MiB of metadata. An entry is one file, `SHA256\\n`
then its JSON body, SHA256 being the body's own hash: a torn, edited or otherwise corrupt entry (bad
JSON, wrong types, missing keys, an offset beyond the file) is ignored and rewritten, never trusted.
The folder keeps the most recently used entries only (CpuSettings.header_cache_max_*).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import DEFAULT_CPU, DEFAULT_FILES

FORMAT = 3  # entries of another format are ignored (and pruned in time); 3 added each key's value type


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]  # GGUF key -> plain python value, as gguf_file.read_metadata_fields gives
    kv_end: int  # byte offset where the tensor table starts
    alignment_offset: int | None  # byte offset of the general.alignment key/value, if the file has one
    # GGUF key -> (value type, an array's item type or None): what a copy of the key writes (quantize)
    types: dict[str, tuple[int, int | None]] | None = None


def entry_path(path: Path, folder: Path) -> Path:
    """One entry per path and format: localllm versions that share the folder do not overwrite each
    other's entries (prune removes the unused ones in time)."""
    return folder / "gguf" / f"{hashlib.sha1(str(path.resolve()).encode()).hexdigest()}.v{FORMAT}.json"


def content_hash(path: Path, kv_end: int) -> str | None:
    """sha256 of the file's first kv_end bytes; None when the file is shorter or unreadable."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            left = kv_end
            while left > 0:
                block = f.read(min(left, 1 << 20))
                if not block:
                    return None
                digest.update(block)
                left -= len(block)
    except OSError:
        return None
    return digest.hexdigest()


def parse_entry(text: str, file_size: int) -> tuple[Header, str] | None:
    """(header, content hash) of an entry's text, or None unless it is whole and well-formed."""
    stamp, _, body = text.partition("\n")
    if hashlib.sha256(body.encode()).hexdigest() != stamp:
        return None
    try:
        entry = json.loads(body)
    except ValueError:
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    kv_end, align, meta, digest = (entry.get(k) for k in ("kv_end", "alignment_offset", "metadata", "sha256"))
    if type(kv_end) is not int or not 0 < kv_end <= file_size or not isinstance(digest, str):
        return None
    if align is not None and (type(align) is not int or not 0 <= align < kv_end):
        return None
    if not isinstance(meta, dict):
        return None
    types = entry.get("types")
    if types is not None and not (isinstance(types, dict) and types.keys() == meta.keys() and all(
            isinstance(t, list) and len(t) == 2 and type(t[0]) is int and (t[1] is None or type(t[1]) is int)
            for t in types.values())):
        return None
    types = None if types is None else {k: (t[0], t[1]) for k, t in types.items()}
    return Header(meta, kv_end, align, types), digest


def read_header(path: Path, folder: Path) -> Header | None:
    """The cached header of a file with these very header bytes, else None (then parse the file)."""
    entry = entry_path(path, folder)
    try:
        text = entry.read_text(encoding="utf-8")
        size = path.stat().st_size
    except (OSError, ValueError):  # absent, unreadable, not UTF-8: parse the file instead
        return None
    parsed = parse_entry(text, size)
    if parsed is None or content_hash(path, parsed[0].kv_end) != parsed[1]:
        return None
    try:
        os.utime(entry)  # recently used: pruned last
    except OSError:
        pass
    return parsed[0]


def write_header(path: Path, folder: Path, header: Header) -> None:
    """Save atomically, then prune; a cache folder that cannot be written only costs the next open its
    parse time."""
    target = entry_path(path, folder)
    digest = content_hash(path, header.kv_end)
    if digest is None:
        return
    body = json.dumps({"format": FORMAT, "sha256": digest, "kv_end": header.kv_end,
                       "alignment_offset": header.alignment_offset, "metadata": header.metadata,
                       "types": header.types})
    stamp = hashlib.sha256(body.encode()).hexdigest()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(stamp + "\n" + body, encoding="utf-8")
        os.replace(tmp, target)
    except (OSError, ValueError):  # ValueError: a metadata string JSON cannot encode
        return
    prune(target.parent, DEFAULT_CPU.header_cache_max_entries, DEFAULT_CPU.header_cache_max_bytes)


def prune(folder: Path, max_entries: int, max_bytes: int) -> None:
    """Delete the least recently used entries beyond max_entries or max_bytes in all, and temporary
    entries left by writers that died."""
    entries, doomed = [], []
    now = time.time()
    try:
        for p in folder.iterdir():
            st = p.stat()
            if p.suffix == ".tmp" and now - st.st_mtime > DEFAULT_FILES.stale_partial_seconds:
                doomed.append(p)
            elif p.suffix == ".json":
                entries.append((st.st_mtime, st.st_size, p))
    except OSError:  # a file gone meanwhile, an unreadable folder: prune next time
        return
    entries.sort(key=lambda e: e[0], reverse=True)  # most recently used first
    total = 0
    for i, (_, size, p) in enumerate(entries):
        total += size
        if i >= max_entries or total > max_bytes:
            doomed.append(p)
    for p in doomed:
        try:
            p.unlink()
        except OSError:
            continue
