"""The byte layout of a (valid) GGUF v3 file, for the fuzzer: where every number and string lives,
and the file cut into key/value entries, tensor-info entries and data so that entries can be removed,
duplicated or replaced and the file put back together.

Layout (little endian, ggml/docs/gguf.md): magic "GGUF", version u32, tensor count u64, kv count
u64; each kv: key (u64 length + bytes), value type u32, value; each tensor info: name (u64 length +
bytes), n_dims u32, dims u64 x n_dims, type u32, offset u64 (relative to the data start); padding to
the alignment (general.alignment, default 32); tensor data. Only the fuzzer's own seed files are
parsed here (they are valid); mutated files go to the loader, never back through this parser.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF value type id -> struct format of a scalar (8 string, 9 array are handled apart)
SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
ARRAY_SAMPLE = 4  # array elements listed as numeric slots per array (first, last and a few between)


@dataclass(frozen=True)
class Slot:
    """One number in the file: where, its struct format, and what it is (category, label)."""

    offset: int
    fmt: str
    category: str  # header, key_len, value_type, value, str_len, array_type, array_count, array_elem,
    #                name_len, n_dims, dim, tensor_type, tensor_offset
    label: str


@dataclass
class Layout:
    version: int
    kvs: list[tuple[str, bytes]]  # (key, whole entry bytes)
    tensors: list[tuple[str, bytes]]  # (name, whole tensor-info bytes)
    data: bytes  # everything from the (aligned) data start
    alignment: int
    data_start: int
    slots: list[Slot] = field(default_factory=list)
    strings: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, length, label) of text bytes
    tensor_data: list[tuple[str, int, int]] = field(default_factory=list)  # (name, type id, file offset)


class _Cursor:
    def __init__(self, raw: bytes, lay: Layout):
        self.raw, self.pos, self.lay = raw, 0, lay

    def num(self, fmt: str, category: str, label: str, record: bool = True) -> int | float:
        (value,) = struct.unpack_from(fmt, self.raw, self.pos)
        if record:
            self.lay.slots.append(Slot(self.pos, fmt, category, label))
        self.pos += struct.calcsize(fmt)
        return value

    def text(self, category: str, label: str, record: bool = True) -> str:
        n = self.num("<Q", category, label, record)
        if record:
            self.lay.strings.append((self.pos, n, label))
        out = self.raw[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return out


def _sampled(count: int) -> set[int]:
    return {0, count - 1} | {count * k // ARRAY_SAMPLE for k in range(1, ARRAY_SAMPLE - 1)}


def _value(cur: _Cursor, vtype: int, label: str, record: bool = True) -> object:
    if vtype == STRING:
        return cur.text("str_len", label, record)
    if vtype == ARRAY:
        etype = cur.num("<I", "array_type", label, record)
        count = cur.num("<Q", "array_count", label, record)
        keep = _sampled(count) if record else set()
        return [_value(cur, etype, f"{label}[{i}]", i in keep) for i in range(count)]
    return cur.num(SCALAR_FMT[vtype], "value" if record and not label.endswith("]") else "array_elem", label, record)


def parse(raw: bytes) -> Layout:
    lay = Layout(0, [], [], b"", 32, 0)
    cur = _Cursor(raw, lay)
    assert raw[:4] == b"GGUF", "the fuzzer parses only valid seed files"
    cur.pos = 4
    lay.version = cur.num("<I", "header", "version")
    n_tensors = cur.num("<Q", "header", "tensor_count")
    n_kv = cur.num("<Q", "header", "kv_count")
    for _ in range(n_kv):
        start = cur.pos
        key = cur.text("key_len", "key")
        vtype = cur.num("<I", "value_type", key)
        value = _value(cur, vtype, key)
        if key == "general.alignment":
            lay.alignment = int(value)
        lay.kvs.append((key, raw[start:cur.pos]))
    infos = []
    for _ in range(n_tensors):
        start = cur.pos
        name = cur.text("name_len", "tensor name")
        n_dims = cur.num("<I", "n_dims", name)
        for d in range(n_dims):
            cur.num("<Q", "dim", f"{name} dim {d}")
        ttype = cur.num("<I", "tensor_type", name)
        offset = cur.num("<Q", "tensor_offset", name)
        lay.tensors.append((name, raw[start:cur.pos]))
        infos.append((name, ttype, offset))
    lay.data_start = -(-cur.pos // lay.alignment) * lay.alignment
    lay.data = raw[lay.data_start:]
    lay.tensor_data = [(n, t, lay.data_start + o) for n, t, o in infos]
    return lay


def assemble(lay: Layout, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """The file again from its entries (counts from the lists unless given); data re-aligned."""
    head = b"GGUF" + struct.pack("<IQQ", lay.version, len(lay.tensors) if n_tensors is None else n_tensors,
                                 len(lay.kvs) if n_kv is None else n_kv)
    body = head + b"".join(e for _, e in lay.kvs) + b"".join(e for _, e in lay.tensors)
    pad = -len(body) % max(1, lay.alignment)
    return body + b"\0" * pad + lay.data


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def kv_entry(key: bytes, vtype: int, payload: bytes) -> bytes:
    """One key/value entry; payload is the value's encoding (see encode_value)."""
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def encode_value(vtype: int, value: object, etype: int = 0) -> bytes:
    """A scalar, bytes (string), or list (array of etype) in GGUF encoding."""
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        return struct.pack("<IQ", etype, len(value)) + b"".join(encode_value(etype, v) for v in value)
    return struct.pack(SCALAR_FMT[vtype], value)
