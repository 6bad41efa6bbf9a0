"""The GGUF header cache (localllm/gguf_cache.py): a corrupt entry is ignored and rewritten, an entry
never outlives a change of the header bytes (even one that keeps the size and mtime), and the folder
is pruned to its caps.

The tiny model's metadata is far below the size worth caching; the tests lower that threshold
(gguf_file's settings) rather than parse the default model's 49k tokens each time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tiny_gguf import write_gguf
from tiny_spec import TinySpec
from localllm import gguf_cache, gguf_file
from localllm.gguf_cache import Header, entry_path, read_header, write_header
from localllm.gguf_file import open_gguf
from localllm.settings import CpuSettings


@pytest.fixture
def model(tmp_path) -> Path:
    return write_gguf(TinySpec("llama", seed=1), tmp_path / "tiny.gguf")


@pytest.fixture
def cache_all(monkeypatch):
    """Cache every header, however small."""
    monkeypatch.setattr(gguf_file, "DEFAULT_CPU", CpuSettings(header_cache_min_bytes=0))


def stamped(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest() + "\n" + body


def valid_entry(model: Path, folder: Path) -> dict:
    open_gguf(model, folder)
    text = entry_path(model, folder).read_text()
    return json.loads(text.partition("\n")[2])


def corruptions(entry: dict, model: Path) -> dict[str, str]:
    """name -> the text of a corrupt entry: torn, foreign, of wrong types, or lying about the file."""
    size = model.stat().st_size
    edited = {**entry, "metadata": {**entry["metadata"], "general.name": "Not Tiny"}}
    good = stamped(json.dumps(entry))
    return {
        "empty": "",
        "torn": good[: len(good) // 2],
        "not json": stamped("{not json"),
        "a list": stamped("[1, 2, 3]"),
        "old format": json.dumps({"key": [size, 0], "kv_end": entry["kv_end"], "alignment_offset": None,
                                  "metadata": entry["metadata"]}),
        "missing keys": stamped(json.dumps({"format": 2, "metadata": entry["metadata"]})),
        "kv_end a string": stamped(json.dumps({**entry, "kv_end": str(entry["kv_end"])})),
        "kv_end beyond the file": stamped(json.dumps({**entry, "kv_end": size + 1})),
        "kv_end zero": stamped(json.dumps({**entry, "kv_end": 0})),
        "alignment past kv_end": stamped(json.dumps({**entry, "alignment_offset": entry["kv_end"] + 5})),
        "metadata a list": stamped(json.dumps({**entry, "metadata": []})),
        "hash of other bytes": stamped(json.dumps({**entry, "sha256": "0" * 64})),
        "body edited, stamp kept": good.partition("\n")[0] + "\n" + json.dumps(edited),
        "not utf-8": "\udcff",
    }


def test_corrupt_entries_ignored_and_rewritten(model, tmp_path, cache_all):
    folder = tmp_path / "cache"
    fresh = open_gguf(model, None).metadata
    entry = valid_entry(model, folder)
    for name, text in corruptions(entry, model).items():
        path = entry_path(model, folder)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        assert read_header(model, folder) is None, name
        assert open_gguf(model, folder).metadata == fresh, name  # parsed from the file, no error
        assert read_header(model, folder) is not None, name  # and the entry written again
        assert read_header(model, folder).metadata == fresh, name


def test_same_size_edit_with_mtime_kept(model, tmp_path, cache_all):
    """An in-place edit of the same size, the mtime set back: the cache must serve the new header."""
    folder = tmp_path / "cache"
    assert open_gguf(model, folder).metadata["general.name"] == "Tiny Llama"
    st = model.stat()
    data = model.read_bytes()
    model.write_bytes(data.replace(b"Tiny Llama", b"Tiny Camel", 1))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model.stat().st_size == st.st_size and model.stat().st_mtime_ns == st.st_mtime_ns
    assert open_gguf(model, folder).metadata["general.name"] == "Tiny Camel"


def test_entry_follows_content_not_path(model, tmp_path, cache_all):
    """A cached open is the very metadata of a fresh parse."""
    folder = tmp_path / "cache"
    first = open_gguf(model, folder)
    second = open_gguf(model, folder)
    assert read_header(model, folder) is not None
    assert second.metadata == first.metadata == open_gguf(model, None).metadata


def test_pruned_to_the_caps(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setattr(gguf_cache, "DEFAULT_CPU", CpuSettings(header_cache_max_entries=3))
    files = []
    for i in range(5):
        f = tmp_path / f"f{i}.gguf"
        f.write_bytes(b"GGUF" + bytes([i]) * 100)
        files.append(f)
        write_header(f, folder, Header({"i": i}, 50, None))
        t = 1_000_000 + i  # one second apart: the order of use is the order of writing
        os.utime(entry_path(f, folder), (t, t))
    assert read_header(files[0], folder) is None and read_header(files[1], folder) is None  # the oldest
    assert [read_header(f, folder).metadata["i"] for f in files[2:]] == [2, 3, 4]
    # a read marks an entry used: f2 is kept, f3 (least recently used now) goes
    os.utime(entry_path(files[3], folder), (1, 1))
    write_header(files[0], folder, Header({"i": 0}, 50, None))
    assert read_header(files[3], folder) is None
    assert sorted(read_header(f, folder).metadata["i"] for f in (files[0], files[2], files[4])) == [0, 2, 4]


def test_pruned_to_the_byte_cap(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setattr(gguf_cache, "DEFAULT_CPU", CpuSettings(header_cache_max_bytes=3000))
    for i in range(10):
        f = tmp_path / f"f{i}.gguf"
        f.write_bytes(b"GGUF" + bytes([i]) * 100)
        write_header(f, folder, Header({"pad": "x" * 1000}, 50, None))
    sizes = [p.stat().st_size for p in (folder / "gguf").iterdir()]
    assert 0 < sum(sizes) <= 3000 and len(sizes) == 2


def test_stale_temporary_entries_pruned(tmp_path):
    folder = tmp_path / "cache" / "gguf"
    folder.mkdir(parents=True)
    dead = folder / "abc.123.tmp"
    dead.write_text("half an entry")
    os.utime(dead, (1, 1))
    f = tmp_path / "f.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    write_header(f, tmp_path / "cache", Header({}, 50, None))
    assert [p.suffix for p in folder.iterdir()] == [".json"]
