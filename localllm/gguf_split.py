"""Split GGUF files (llama.cpp's gguf-split) read as one model.

gguf-split writes PREFIX-00001-of-0000N.gguf ... PREFIX-0000N-of-0000N.gguf (llama.cpp's
llama_split_path: "%s-%05d-of-%05d.gguf"). The first part holds all the metadata; every part holds the
keys split.no (u16, 0-based), split.count (u16) and split.tensors.count (i32, the tensors of all parts)
and its own tensors. llama.cpp's loader (llama-model-loader.cpp) must be given the first part; it opens
the others by name, checks each one's split.no, refuses a tensor name seen twice and checks the total
against split.tensors.count. We do the same, each part read by the `gguf` package's reader
(gguf_file.open_one_gguf), the tensors of all parts in one table (each a view of its own part's data).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from .errors import LocalLLMError

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_path(prefix: str, no: int, count: int) -> str:
    """llama_split_path: the name of part `no` (0-based) of `count`."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def split_parts(path: Path) -> list[Path]:
    """The files of the split set that `path` names by llama.cpp's convention, every part, in order
    (absent ones too); [path] for a name that is not a part's."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) < 1:
        return [path]
    count = int(m["count"])
    return [path.with_name(part_path(m["prefix"], i, count)) for i in range(count)]


def _split_int(f, key: str) -> int | None:
    value = f.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LocalLLMError(f"metadata {key!r} is {value!r}, expected a count: {f.path}")
    return value


def join_parts(first, open_part: Callable[[Path], object]):
    """first: a GGUFFile (the file the user named). Not split (no split.count, or 1): first, less the
    split keys. Split: its parts opened with open_part and joined into one GGUFFile."""
    count = _split_int(first, "split.count") or 1
    metadata = {k: v for k, v in first.metadata.items() if k not in SPLIT_KEYS}
    if count == 1:
        return replace(first, metadata=metadata)
    no = _split_int(first, "split.no") or 0
    if no != 0:
        raise LocalLLMError(
            f"{first.path} is part {no + 1} of {count} of a split GGUF: give the first part"
            f" (…-00001-of-{count:05d}.gguf)"
        )
    paths = split_parts(first.path)
    if len(paths) != count:
        raise LocalLLMError(
            f"{first.path} is the first of {count} parts of a split GGUF, but its name is not gguf-split's"
            f" PREFIX-00001-of-{count:05d}.gguf, so the other parts cannot be found"
        )
    tensors = dict(first.tensors)
    for i, path in enumerate(paths[1:], 1):
        if not path.is_file():
            raise LocalLLMError(f"split GGUF part {i + 1} of {count} is missing: {path}")
        part = open_part(path)
        part_no = _split_int(part, "split.no")
        if part_no != i or _split_int(part, "split.count") != count:
            raise LocalLLMError(
                f"{path} is not part {i + 1} of {count} of {first.path.name} (its split.no is {part_no},"
                f" split.count {part.metadata.get('split.count')})"
            )
        for name, tensor in part.tensors.items():
            if name in tensors:
                raise LocalLLMError(f"tensor {name!r} is in two parts of the split GGUF (again in {path})")
            tensors[name] = tensor
    expected = _split_int(first, "split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise LocalLLMError(
            f"split GGUF {first.path} says {expected} tensors (split.tensors.count), its {count} parts hold"
            f" {len(tensors)}"
        )
    return replace(first, metadata=metadata, tensors=tensors, parts=tuple(paths))
