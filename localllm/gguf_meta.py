"""Read a GGUF key/value section into plain python values, trusting nothing in it.

gguf.GGUFReader builds two numpy views per value (a 49k-token vocabulary is 100k views, ~2 s), lets an
array's element count drive a python loop before any bounds check, recurses into arrays of arrays, and
decodes strings only later (a non-UTF-8 string then fails outside any error handling). This reader
walks the same layout (GGUF v2/v3: key string, u32 value type, value) over the file's bytes once, and
turns every inconsistency into CorruptGGUF naming the key and the byte offset.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFValueType as V

# GGUF value type -> struct code of one element (strings and arrays are handled apart).
SCALAR_CODES = {
    V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
    V.FLOAT32: "f", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d", V.BOOL: "?",
}


class CorruptGGUF(Exception):
    """A GGUF header we cannot trust; args: (one line naming the key or tensor and the byte offset,)."""


class PastEnd(Exception):
    """A read that would run past the end of the file; args: (end byte, file size)."""


class KVReader:
    """Reads values from buf (the mapped file) at byte offsets; endian: '<' or '>'."""

    def __init__(self, buf: memoryview, endian: str, max_array_len: int):
        self.buf = buf
        self.endian = endian
        self.max_array_len = max_array_len

    def need(self, offs: int, n: int) -> None:
        if offs + n > len(self.buf):
            raise PastEnd(offs + n, len(self.buf))

    def scalar(self, offs: int, code: str) -> tuple[Any, int]:
        size = struct.calcsize(code)
        self.need(offs, size)
        return struct.unpack_from(self.endian + code, self.buf, offs)[0], offs + size

    def string(self, offs: int, what: str) -> tuple[str, int]:
        n, start = self.scalar(offs, "Q")
        self.need(start, n)
        try:
            return str(self.buf[start:start + n], "utf-8"), start + n
        except UnicodeDecodeError as e:
            raise CorruptGGUF(f"{what} is not valid UTF-8 (invalid byte at offset {start + e.start})") from None

    def value(self, key: str, raw_type: int, offs: int) -> tuple[Any, int]:
        """The value of type raw_type at offs -> (plain python value, offset after it)."""
        vtype = value_type(key, raw_type, offs)
        if vtype == V.STRING:
            return self.string(offs, f"metadata {key!r} (string at byte {offs})")
        if vtype != V.ARRAY:
            return self.scalar(offs, SCALAR_CODES[vtype])
        raw_item, offs = self.scalar(offs, "I")
        count, offs = self.scalar(offs, "Q")
        item = value_type(key, raw_item, offs - 12)
        if item == V.ARRAY:
            raise CorruptGGUF(f"metadata {key!r} at byte {offs - 12} is an array of arrays (not supported)")
        if count > self.max_array_len:
            raise CorruptGGUF(f"metadata {key!r} holds {count} values, more than the {self.max_array_len} we accept")
        if item == V.STRING:
            self.need(offs, 8 * count)  # each string is at least its u64 length: no loop past the file
            out = []
            for i in range(count):
                s, offs = self.string(offs, f"metadata {key!r} item {i} (at byte {offs})")
                out.append(s)
            return out, offs
        code = SCALAR_CODES[item]
        size = struct.calcsize(code) * count
        self.need(offs, size)
        dtype = np.dtype(code).newbyteorder(self.endian)
        return np.frombuffer(self.buf, dtype, count, offs).tolist(), offs + size


def value_type(key: str, raw: int, offs: int) -> V:
    try:
        return V(raw)
    except ValueError:
        raise CorruptGGUF(f"metadata {key!r} at byte {offs} has unknown value type {raw}") from None


def read_kv_section(reader: KVReader, offs: int, count: int) -> tuple[dict[str, Any], dict[str, tuple], int]:
    """count key/value pairs from offs -> (key -> value, key -> (byte offset of its entry, its GGUF value
    type, an array's item type or None), offset where the section ends)."""
    values: dict[str, Any] = {}
    where: dict[str, tuple] = {}
    for _ in range(count):
        at = offs
        key, offs = reader.string(offs, f"metadata key at byte {at}")
        raw_type, offs = reader.scalar(offs, "I")
        if key in values:
            raise CorruptGGUF(f"metadata key {key!r} appears twice (again at byte {at})")
        raw_item = reader.scalar(offs, "I")[0] if raw_type == V.ARRAY else None  # value() checks it
        values[key], offs = reader.value(key, raw_type, offs)
        where[key] = (at, V(raw_type), None if raw_item is None else V(raw_item))
    return values, where, offs


# Keys whose readers (tokenizer/, config_gguf.py) assume a type -> (expected python type, its words).
# Integers exclude bools; floats accept integers. Lists: every item of the type.
_INT, _STR = (int, "an integer", "integers"), (str, "a string", "strings")
_BOOL, _NUM = (bool, "true or false", "booleans"), ((int, float), "a number", "numbers")
KNOWN_KEYS = {
    "general.architecture": _STR, "general.name": _STR,
    "tokenizer.ggml.model": _STR, "tokenizer.ggml.pre": _STR, "tokenizer.chat_template": _STR,
    "tokenizer.ggml.tokens": (list, _STR), "tokenizer.ggml.merges": (list, _STR),
    "tokenizer.ggml.token_type": (list, _INT), "tokenizer.ggml.scores": (list, _NUM),
}
ID_SUFFIX, FLAG_PREFIX = "_token_id", "tokenizer.ggml.add_"
PER_TOKEN = ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")  # one value per token


def _is(value: Any, kind: tuple) -> bool:
    return _is_type(type(value), kind)


def _is_type(t: type, kind: tuple) -> bool:
    types = kind[0]
    return issubclass(t, types) and (types is bool or not issubclass(t, bool))


def check_known_keys(meta: dict[str, Any]) -> None:
    """Raise CorruptGGUF for a known key of the wrong type (an array where an id belongs, a number
    where the vocabulary belongs) or a per-token list whose length is not the vocabulary's."""
    for key, value in meta.items():
        kind = KNOWN_KEYS.get(key)
        if kind is None and key.startswith("tokenizer.ggml."):
            kind = _INT if key.endswith(ID_SUFFIX) else _BOOL if key.startswith(FLAG_PREFIX) else None
        if kind is None:
            continue
        if kind[0] is list:
            item = kind[1]
            # each distinct item type checked once (a vocabulary: 100k+ items of one type)
            if not isinstance(value, list) or not all(_is_type(t, item) for t in set(map(type, value))):
                raise CorruptGGUF(f"metadata {key!r} is {_shown(value)}, expected a list of {item[2]}")
        elif not _is(value, kind):
            raise CorruptGGUF(f"metadata {key!r} is {_shown(value)}, expected {kind[1]}")
    tokens = meta.get("tokenizer.ggml.tokens")
    for key in PER_TOKEN:
        if tokens is not None and key in meta and len(meta[key]) != len(tokens):
            raise CorruptGGUF(f"metadata {key!r} has {len(meta[key])} values for {len(tokens)} tokens")


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}" + (f" {type(value[0]).__name__}s" if value else "")
    return f"{value!r} ({type(value).__name__})"
