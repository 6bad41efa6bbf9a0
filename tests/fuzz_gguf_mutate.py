"""Mutations of a valid tiny GGUF file, each one deterministic given a random.Random.

Byte level: flips, truncation, splices (a byte range copied within the file or from another seed).
Field level: an edge value written into one number of the header, the metadata or the tensor table
(fuzz_gguf_layout lists them all), invalid UTF-8 written into one string. Entry level (the file is
put back together, so the result stays well-formed and reaches the loader's deeper checks): a key
removed, duplicated or given a value of another type; a tensor-info entry removed, duplicated,
renamed, retyped or pointed at another tensor's data; NaN/Inf written into tensor data.
"""

from __future__ import annotations

import random
import struct

from fuzz_gguf_layout import ARRAY, SCALAR_FMT, STRING, Layout, assemble, encode_value, gguf_string, kv_entry, parse

EDGE_INTS = [0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 10**6, 65536]
EDGE_FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1e-45, 3.4e38, 1e300, -1e300, 0.5]
BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x80", b"\xf8\x88\x80\x80\x80", b"\x00"]
# Names a tensor can be renamed to: no layer part, a layer beyond block_count, an unknown kind, ...
ODD_NAMES = [b"", b"blk", b"blk.", b"blk..attn_q.weight", b"blk.x.attn_q.weight", b"blk.99.attn_q.weight",
             b"blk.-1.attn_q.weight", b"blk.0", b"blk.0.attn_q", b"blk.0.nonsense.weight", b"output.weight",
             b"token_embd", b"weight", b"rope_freqs.weight", b"blk.0.attn_q.bias", b"blk.0.attn_q_norm.weight",
             b"blk.99999999999999999999.ffn_up.weight", b"token_embd.weight\x00", b"model.embed_tokens.weight"]
ARCHES = [b"llama", b"qwen2", b"qwen3", b"mistral", b"gpt2", b"phi3", b"", b"LLAMA", b"llama\x00", b"bert"]
N_GGML_TYPES = 40  # type ids tried: every ggml type id and a few past the end


def edge_int(rng: random.Random, fmt: str, old: int) -> int:
    bits = 8 * struct.calcsize(fmt)
    pick = rng.choice(EDGE_INTS + [old + 1, old - 1, old * 2, old // 2, rng.randrange(2, 64),
                                   rng.getrandbits(bits), -1])
    return pick % (1 << bits)


def write_edge(raw: bytearray, rng: random.Random, offset: int, fmt: str) -> str:
    """An edge value for the number at offset (written as its unsigned bit pattern for ints)."""
    if fmt in ("<f", "<d"):
        value = rng.choice(EDGE_FLOATS)
        struct.pack_into(fmt, raw, offset, value if fmt == "<d" or abs(value) < 3.5e38 or value != value
                         or abs(value) == float("inf") else float("inf"))
        return repr(value)
    (old,) = struct.unpack_from(fmt.upper(), raw, offset)
    value = edge_int(rng, fmt, old)
    struct.pack_into(fmt.upper(), raw, offset, value)
    return str(value)


# ---- byte level


def flip_bytes(raw: bytearray, lay: Layout, rng: random.Random, other: bytes) -> str:
    n = rng.choice([1, 1, 2, 4, 8])
    header = rng.random() < 0.8  # most flips land before the data, where the parser reads
    end = lay.data_start if header else len(raw)
    spots = [rng.randrange(end) for _ in range(n)]
    for i in spots:
        raw[i] = rng.randrange(256) if rng.random() < 0.5 else raw[i] ^ (1 << rng.randrange(8))
    return f"flip bytes at {spots}"


def truncate(raw: bytearray, lay: Layout, rng: random.Random, other: bytes) -> str:
    if rng.random() < 0.3 and lay.slots:
        cut = rng.choice(lay.slots).offset + rng.choice([0, 1])  # at or inside a field
    else:
        cut = rng.randrange(lay.data_start if rng.random() < 0.6 else len(raw))
    del raw[cut:]
    return f"truncate at {cut}"


def splice(raw: bytearray, lay: Layout, rng: random.Random, other: bytes) -> str:
    src = other if rng.random() < 0.3 else bytes(raw)
    n = rng.choice([4, 8, 16, 64, 512, 4096])
    a = rng.randrange(max(1, len(src) - n))
    b = rng.randrange(max(1, min(len(raw), lay.data_start + 64)))
    chunk = src[a:a + n]
    if rng.random() < 0.5:
        raw[b:b + len(chunk)] = chunk
        return f"splice {len(chunk)} bytes from {a} over {b}"
    raw[b:b] = chunk
    return f"insert {len(chunk)} bytes from {a} at {b}"


# ---- field level


def edge_field(raw: bytearray, lay: Layout, rng: random.Random, other: bytes) -> str:
    category = rng.choice(sorted({s.category for s in lay.slots}))  # every kind of field equally often
    slot = rng.choice([s for s in lay.slots if s.category == category])
    value = write_edge(raw, rng, slot.offset, slot.fmt)
    return f"{category} {slot.label!r} = {value}"


def bad_utf8(raw: bytearray, lay: Layout, rng: random.Random, other: bytes) -> str:
    offset, length, label = rng.choice([s for s in lay.strings if s[1]])
    bad = rng.choice(BAD_UTF8)[:length]
    at = offset + rng.randrange(length - len(bad) + 1)
    raw[at:at + len(bad)] = bad
    return f"invalid UTF-8 {bad!r} in {label!r}"


# ---- entry level (file re-assembled)


def _kv_index(lay: Layout, rng: random.Random) -> int:
    # Architecture keys (llama.*) and the tokenizer's scalars matter most; any key sometimes.
    keys = [i for i, (k, _) in enumerate(lay.kvs) if not k.startswith("general.name")]
    return rng.choice(keys)


def random_value(rng: random.Random) -> tuple[int, bytes, str]:
    """(value type, encoded value, description) of a random type: scalars, strings, arrays."""
    vtype = rng.choice(list(SCALAR_FMT) + [STRING, STRING, ARRAY, ARRAY])
    if vtype == STRING:
        text = rng.choice([b"", b"abc", b"64", b"\xff\xfe", b"llama", b"x" * 1000])
        return vtype, encode_value(vtype, text), f"string {text[:20]!r}"
    if vtype == ARRAY:
        etype = rng.choice([4, 5, 10, STRING])
        items = [rng.randrange(0, 100) for _ in range(rng.choice([0, 1, 3]))]
        vals = [str(v).encode() for v in items] if etype == STRING else items
        return vtype, encode_value(vtype, vals, etype), f"array type {etype} of {len(items)}"
    fmt = SCALAR_FMT[vtype]
    if fmt in ("<f", "<d"):
        value = rng.choice(EDGE_FLOATS[:6] + [64.0, 2.5])
        return vtype, struct.pack(fmt, value), f"type {vtype} {value!r}"
    value = edge_int(rng, fmt, 64)
    return vtype, struct.pack(fmt.upper(), value), f"type {vtype} {value}"


def retype_kv(lay: Layout, rng: random.Random) -> str:
    i = _kv_index(lay, rng)
    key = lay.kvs[i][0]
    vtype, payload, what = random_value(rng)
    lay.kvs[i] = (key, kv_entry(key.encode(), vtype, payload))
    return f"key {key!r} := {what}"


def remove_kv(lay: Layout, rng: random.Random) -> str:
    key, _ = lay.kvs.pop(_kv_index(lay, rng))
    return f"remove key {key!r}"


def dup_kv(lay: Layout, rng: random.Random) -> str:
    entry = lay.kvs[_kv_index(lay, rng)]
    lay.kvs.insert(rng.randrange(len(lay.kvs) + 1), entry)
    return f"duplicate key {entry[0]!r}"


def set_arch(lay: Layout, rng: random.Random) -> str:
    arch = rng.choice(ARCHES)
    old = [e for k, e in lay.kvs if k == "general.architecture"]
    if not old:  # removed by an earlier mutation: add it back with the new value
        lay.kvs.insert(0, ("general.architecture", kv_entry(b"general.architecture", STRING, gguf_string(arch))))
        return f"architecture {arch!r} (added)"
    old_arch = old[0][8 + len("general.architecture") + 4 + 8:]
    rename = rng.random() < 0.5 and arch  # also rename the llama.* keys: a consistent other arch
    out = []
    for key, entry in lay.kvs:
        if key == "general.architecture":
            entry = kv_entry(key.encode(), STRING, gguf_string(arch))
        elif rename and key.startswith(old_arch.decode() + "."):
            new_key = arch + key.encode()[len(old_arch):]
            entry = gguf_string(new_key) + entry[8 + len(key.encode()):]
            key = new_key.decode("utf-8", "replace")
        out.append((key, entry))
    lay.kvs = out
    return f"architecture {arch!r}" + (" (keys renamed)" if rename else "")


def _tensor_fields(entry: bytes) -> tuple[bytes, int, list[int], int, int]:
    (n,) = struct.unpack_from("<Q", entry)
    name = entry[8:8 + n]
    (n_dims,) = struct.unpack_from("<I", entry, 8 + n)
    dims = list(struct.unpack_from(f"<{n_dims}Q", entry, 12 + n))
    ttype, offset = struct.unpack_from("<IQ", entry, 12 + n + 8 * n_dims)
    return name, n_dims, dims, ttype, offset


def tensor_entry(name: bytes, dims: list[int], ttype: int, offset: int) -> bytes:
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def edit_tensor(lay: Layout, rng: random.Random) -> str:
    i = rng.randrange(len(lay.tensors))
    name, _, dims, ttype, offset = _tensor_fields(lay.tensors[i][1])
    what = rng.choice(["rename", "retype", "overlap", "dims", "remove", "duplicate"])
    if what == "remove":
        lay.tensors.pop(i)
        return f"remove tensor {name!r}"
    if what == "duplicate":
        lay.tensors.insert(rng.randrange(len(lay.tensors) + 1), lay.tensors[i])
        return f"duplicate tensor {name!r}"
    if what == "rename":
        name = rng.choice(ODD_NAMES + [_tensor_fields(e)[0] for _, e in lay.tensors])
    elif what == "retype":
        ttype = rng.randrange(N_GGML_TYPES)
    elif what == "overlap":
        offset = _tensor_fields(rng.choice(lay.tensors)[1])[4] + rng.choice([0, 0, 32, -32]) % (1 << 64)
        offset %= 1 << 64
    else:
        dims = rng.choice([dims[::-1], dims[:1], dims + [1], dims + [2], [d * 2 for d in dims], [0] + dims[1:],
                           [d // 2 for d in dims]])
    lay.tensors[i] = (name.decode("utf-8", "replace"), tensor_entry(name, dims, ttype, offset))
    return f"tensor {lay.tensors[i][0]!r}: {what} -> dims {dims} type {ttype} offset {offset}"


def nonfinite_data(lay: Layout, rng: random.Random) -> str:
    """NaN or Inf written over a stretch of one tensor's data (F32 values, or F16 scales of blocks)."""
    name, ttype, start = rng.choice(lay.tensor_data)
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    word = struct.pack("<f", value) if ttype == 0 else struct.pack("<e", value)
    data = bytearray(lay.data)
    at = start - lay.data_start
    n = rng.choice([1, 16, 256])
    for k in range(n):
        data[at + k * len(word):at + (k + 1) * len(word)] = word
    lay.data = bytes(data[:len(lay.data)])
    return f"{value} over {n} words of tensor {name!r} (type {ttype})"


BYTE_MUTATORS = [flip_bytes, truncate, splice, edge_field, edge_field, edge_field, bad_utf8]
ENTRY_MUTATORS = [retype_kv, remove_kv, dup_kv, set_arch, edit_tensor, edit_tensor, nonfinite_data]


def mutate(seed_raw: bytes, other: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """A mutated copy of seed_raw and what was done. One to four mutations; entry-level ones first
    (they need a well-formed file), byte-level ones after."""
    n = rng.choices([1, 2, 3, 4], weights=[55, 25, 12, 8])[0]
    n_entry = sum(rng.random() < 0.45 for _ in range(n))
    done = []
    raw = seed_raw
    if n_entry:
        lay = parse(seed_raw)
        counts = None
        for _ in range(n_entry):
            done.append(rng.choice(ENTRY_MUTATORS)(lay, rng))
        if rng.random() < 0.1:  # a count that no longer matches the entries
            counts = dict(n_kv=len(lay.kvs) + rng.choice([-1, 1]))
            done.append(f"kv_count {counts['n_kv']}")
        raw = assemble(lay, **(counts or {}))
    buf = bytearray(raw)
    if n == n_entry:
        return raw, done
    try:
        lay, mutators = parse(raw), BYTE_MUTATORS
    except Exception:  # an entry mutation left counts or lengths the layout parser cannot follow
        lay, mutators = Layout(3, [], [], b"", 32, len(raw)), BYTE_MUTATORS[:3]
    for _ in range(n - n_entry):
        if len(buf) < 64:
            break
        try:
            done.append(rng.choice(mutators)(buf, lay, rng, other))
        except (struct.error, IndexError, ValueError):  # a field an earlier cut removed
            pass
    return bytes(buf), done
