"""Mutations of a valid tiny Hugging Face model folder (config.json, model*.safetensors, optional
model.safetensors.index.json, tokenizer.json, tokenizer_config.json), held as {file name: bytes}.

A file's value None means the file is deleted. JSON files are mutated as JSON (a key removed, set to
a value of another type or an edge value, the whole document replaced by a list or a number) or as
bytes (truncated, invalid UTF-8, flipped). A .safetensors file is an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data;
its header is mutated the same ways, its length field set to edge values, the file cut short.
"""

from __future__ import annotations

import json
import random
import struct

from fuzz_gguf_mutate import BAD_UTF8, EDGE_FLOATS, EDGE_INTS

ODD_VALUES = [0, -1, 1, 2, 2**31, 2**63, 2**64, 10**6, 1e308, 2.5, "abc", "64", "", None, True, False, [], [64],
              {}, {"a": 1}]
DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "Q4", "", "f32"]
Folder = dict[str, "bytes | None"]


def _json_edit(doc: object, rng: random.Random, depth: int = 0) -> tuple[object, str]:
    """One edit somewhere in a JSON document: a value replaced, a key removed or added."""
    if isinstance(doc, dict) and doc and (depth == 0 or rng.random() < 0.7):
        key = rng.choice(sorted(doc, key=str))
        roll = rng.random()
        if roll < 0.2:
            return {k: v for k, v in doc.items() if k != key}, f"remove {key!r}"
        if roll < 0.6 and isinstance(doc[key], (dict, list)) and doc[key]:
            inner, what = _json_edit(doc[key], rng, depth + 1)
            return {**doc, key: inner}, f"{key!r}: {what}"
        value = rng.choice(ODD_VALUES + [rng.choice(EDGE_INTS), rng.choice(EDGE_FLOATS)])
        return {**doc, key: value}, f"{key!r} = {value!r}"
    if isinstance(doc, list) and doc:
        i = rng.randrange(len(doc))
        if isinstance(doc[i], (dict, list)) and doc[i] and rng.random() < 0.6:
            inner, what = _json_edit(doc[i], rng, depth + 1)
        else:
            inner = rng.choice(ODD_VALUES + [rng.choice(EDGE_INTS)])
            what = f"= {inner!r}"
        return doc[:i] + [inner] + doc[i + 1:], f"[{i}] {what}"
    return rng.choice(ODD_VALUES), "replaced"


def _dump(doc: object) -> bytes:
    return json.dumps(doc).encode()  # NaN/Infinity written as JSON extensions, as python reads them


def mutate_json(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    roll = rng.random()
    if roll < 0.7:
        doc, what = _json_edit(json.loads(raw), rng)
        return _dump(doc), what
    if roll < 0.78:
        doc = rng.choice([[], [1, 2], 7, "x", None, [json.loads(raw)]])
        return _dump(doc), f"document = {doc!r:.40}"
    return mutate_bytes(raw, rng)


def mutate_bytes(raw: bytes, rng: random.Random, end: int | None = None) -> tuple[bytes, str]:
    buf = bytearray(raw)
    end = len(buf) if end is None else end
    roll = rng.random()
    if roll < 0.35 or not buf:
        cut = rng.randrange(max(1, end))
        return bytes(buf[:cut]), f"truncate at {cut}"
    at = rng.randrange(max(1, end))
    if roll < 0.7:
        bad = rng.choice(BAD_UTF8)
        buf[at:at + len(bad)] = bad
        return bytes(buf), f"bytes {bad!r} at {at}"
    buf[at] ^= 1 << rng.randrange(8)
    return bytes(buf), f"flip bit at {at}"


def _header_edit(header: dict, rng: random.Random) -> tuple[dict, str]:
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = dict(header[name])
    what = rng.choice(["dtype", "shape", "offsets", "overlap", "rename", "json"])
    if what == "dtype":
        entry["dtype"] = rng.choice(DTYPES)
    elif what == "shape":
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([shape[::-1], shape[:1], shape + [1], [], [0] + shape[1:], [2**63] + shape[1:],
                                     [-1] + shape[1:], [d * 2 for d in shape], [str(d) for d in shape]])
    elif what == "offsets":
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, a], [a, a], [a, b + 2], [a, 2**64], [-1, b], [a], [a + 1, b + 1]])
    elif what == "overlap":
        entry["data_offsets"] = list(header[rng.choice(names)]["data_offsets"])
    elif what == "rename":
        new = rng.choice(["", "lm_head", "model.layers.x.mlp.up_proj.weight", "model.layers.99.mlp.up_proj.weight",
                          "model.embed_tokens", "model.layers.0.self_attn.q_proj.bias", "foo.weight"])
        header = {(new if k == name else k): v for k, v in header.items()}
        return header, f"tensor {name!r} renamed {new!r}"
    else:
        doc, w = _json_edit(header, rng)
        return doc, f"header {w}"
    return {**header, name: entry}, f"tensor {name!r} {what} -> {entry}"


def mutate_safetensors(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", raw)
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    roll = rng.random()
    if roll < 0.55:
        header, what = _header_edit(header, rng)
        text = _dump(header)
        return struct.pack("<Q", len(text)) + text + data, what
    if roll < 0.7:
        value = rng.choice(EDGE_INTS + [n + 1, n - 1, 0, len(raw)]) % (1 << 64)
        return struct.pack("<Q", value) + raw[8:], f"header length {value}"
    return mutate_bytes(raw, rng, end=8 + n if rng.random() < 0.6 else None)


def mutate_folder(seed: Folder, rng: random.Random) -> tuple[Folder, list[str]]:
    """A mutated copy of a folder and what was done: one to three edits, config.json most often."""
    out = dict(seed)
    done = []
    for _ in range(rng.choices([1, 2, 3], weights=[60, 28, 12])[0]):
        names = sorted(k for k, v in out.items() if v is not None)
        weights = [6 if n == "config.json" else 3 if n.endswith(".safetensors") else 2 if "index" in n else 1
                   for n in names]
        name = rng.choices(names, weights=weights)[0]
        raw = out[name]
        try:
            if rng.random() < 0.04:
                out[name], what = None, "deleted"
            elif name.endswith(".safetensors"):
                out[name], what = mutate_safetensors(raw, rng)
            elif name.endswith(".json"):
                out[name], what = mutate_json(raw, rng)
            else:
                out[name], what = mutate_bytes(raw, rng)
        except (ValueError, struct.error, KeyError, TypeError, AttributeError):  # an earlier edit broke the format
            out[name], what = mutate_bytes(raw, rng)
        done.append(f"{name}: {what}")
    return out, done
