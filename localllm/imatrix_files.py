"""llama.cpp's importance-matrix files: the GGUF format current llama-imatrix writes, and the legacy `.dat`.

Reference: llama.cpp tools/imatrix/imatrix.cpp (save_imatrix, save_imatrix_legacy), common/imatrix-loader.cpp
(common_imatrix_load) and tools/quantize/quantize.cpp (load_imatrix: how llama-quantize turns a file into
the per-column means its encoders take). Entries are keyed by the weight's GGUF name ("blk.0.attn_q.weight").

GGUF: keys general.type = "imatrix", imatrix.datasets (string array), imatrix.chunk_count and
imatrix.chunk_size (u32); per weight two F32 tensors, sorted by name: NAME.in_sum2 (numpy (nmat, in)),
the raw sums of x_j^2 over the tokens, and NAME.counts (numpy (nmat, 1)), the tokens summed; nmat is 1
for a matrix and the expert count for an expert stack (MUL_MAT_ID). Mean = in_sum2 / count, 1 where a
count is 0 (an expert no token reached).

Legacy .dat (little-endian int32 / float32): n_entries; per entry, sorted by name: name length, name
bytes, ncall, nval, nval floats = mean * ncall (an expert stack's E * in values, expert-major); then,
optionally, the chunk count and the dataset name (length, bytes). Mean = value / ncall.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from localllm.quantize.partial import make_partial, remove_stale_partials

from .settings import DEFAULT_FILES

GGUF_MAGIC = b"GGUF"


@dataclass
class ImatrixStats:
    """Raw statistics as llama-imatrix keeps them: name -> sums (nmat, in) float of x_j^2 over tokens,
    name -> counts (nmat,) tokens per row of sums (nmat = 1 for a matrix, E for an expert stack)."""

    sums: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]
    chunk_count: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)

    @classmethod
    def from_means(cls, means: Mapping[str, torch.Tensor], tokens: int = 1) -> "ImatrixStats":
        """Means (in,) or (E, in) -> the statistics of `tokens` tokens per row with those means."""
        sums = {k: v.double().reshape(-1, v.shape[-1]) * tokens for k, v in means.items()}
        return cls(sums, {k: torch.full((v.shape[0],), float(tokens), dtype=torch.float64) for k, v in sums.items()},
                   1, tokens)

    def means(self) -> dict[str, torch.Tensor]:
        """name -> fp32 means, (in,) for a matrix, (E, in) for an expert stack; 1 where a count is 0."""
        return {name: _means(s, self.counts[name]) for name, s in self.sums.items()}


def _means(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # fp32 sums / fp32 counts, as llama-quantize divides a GGUF file's values: the means of collected
    # statistics equal those of their file, read back
    sums, counts = sums.float(), counts.float().reshape(-1, 1)
    seen = counts > 0
    m = torch.where(seen, sums / torch.where(seen, counts, 1.0), 1.0)
    return m[0] if m.shape[0] == 1 else m


def is_gguf(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# ---- GGUF ------------------------------------------------------------------------------------------


def write_gguf_imatrix(path: str | Path, stats: ImatrixStats) -> Path:
    """stats -> a GGUF imatrix file as llama-imatrix writes it (written whole or not at all)."""
    import gguf

    path = Path(path)
    remove_stale_partials(path, DEFAULT_FILES.stale_partial_seconds)
    partial = make_partial(path)
    try:
        w = gguf.GGUFWriter(partial, arch="")
        w.kv_data[0].pop("general.architecture", None)  # llama-imatrix writes no architecture
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(stats.datasets) or [""])  # gguf-py writes no empty array
        w.add_uint32("imatrix.chunk_count", int(stats.chunk_count))
        w.add_uint32("imatrix.chunk_size", int(stats.chunk_size))
        for name in sorted(stats.sums):
            s = stats.sums[name].detach().float().cpu().reshape(-1, stats.sums[name].shape[-1])
            c = stats.counts[name].detach().float().cpu().reshape(-1, 1)
            if s.shape[0] == 1:  # ggml drops trailing 1-dims: (in,) and (1,) as llama-imatrix's file has them
                s, c = s[0], c[0]
            w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(s.numpy(), np.float32))
            w.add_tensor(f"{name}.counts", np.ascontiguousarray(c.numpy(), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def read_gguf_imatrix(path: str | Path) -> ImatrixStats:
    """A GGUF imatrix file -> its raw statistics (ValueError on a file that is none)."""
    import gguf

    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError on damaged files
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    field_type = r.fields.get("general.type")
    if field_type is not None and field_type.contents() != "imatrix":
        raise ValueError(f"{path} is a GGUF file of type {field_type.contents()!r}, not an imatrix")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        for suffix in ("in_sum2", "counts"):
            if t.name.endswith("." + suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise ValueError(f"{path}: {t.name} is {t.tensor_type.name}, llama.cpp's imatrix tensors are F32")
                parts.setdefault(t.name[: -len(suffix) - 1], {})[suffix] = np.asarray(t.data, np.float32)
    if not parts:
        raise ValueError(f"{path} holds no imatrix entries")
    sums, counts = {}, {}
    for name, p in sorted(parts.items()):
        if len(p) != 2:
            raise ValueError(f"{path}: {name} has {'no counts' if 'counts' in p else 'no in_sum2'}")
        c = torch.from_numpy(p["counts"].reshape(-1).copy()).round()  # common_imatrix_load: lround
        if p["in_sum2"].size % c.numel():
            raise ValueError(f"{path}: {name} has {p['in_sum2'].size} sums for {c.numel()} counts")
        sums[name] = torch.from_numpy(p["in_sum2"].reshape(c.numel(), -1).copy())
        counts[name] = c
    def value(key, default):
        f = r.fields.get(key)
        return f.contents() if f is not None else default
    return ImatrixStats(sums, counts, int(value("imatrix.chunk_count", 0)), int(value("imatrix.chunk_size", 0)),
                        list(value("imatrix.datasets", [])))


# ---- legacy .dat -----------------------------------------------------------------------------------


def write_dat_imatrix(path: str | Path, stats: ImatrixStats) -> Path:
    """stats -> a legacy .dat file as `llama-imatrix --output-format dat` writes it: per entry
    ncall = ceil(max count / chunk_size) and values mean * ncall (1 * ncall where a count is 0)."""
    if stats.chunk_size < 1:
        raise ValueError("a .dat imatrix needs the chunk size")
    path = Path(path)
    remove_stale_partials(path, DEFAULT_FILES.stale_partial_seconds)
    partial = make_partial(path)
    try:
        with open(partial, "wb") as f:
            names = sorted(n for n in stats.sums if bool((stats.counts[n] > 0).any()))  # all-zero: skipped
            f.write(struct.pack("<i", len(names)))
            for name in names:
                b = name.encode()
                ncall = (int(stats.counts[name].max().item()) + stats.chunk_size - 1) // stats.chunk_size
                sums = stats.sums[name].float().reshape(stats.counts[name].numel(), -1)
                count = stats.counts[name].float().reshape(-1, 1)
                # fp32 as llama.cpp: (value / count) * ncall, value = count = 1 where count is 0
                vals = torch.where(count > 0, sums, 1.0) / torch.where(count > 0, count, 1.0) * float(ncall)
                f.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", ncall, vals.numel()))
                f.write(vals.numpy().astype("<f4").tobytes())
            f.write(struct.pack("<i", int(stats.chunk_count)))
            dataset = (stats.datasets[-1] if stats.datasets else "").encode()
            f.write(struct.pack("<i", len(dataset)) + dataset)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def read_dat_imatrix(path: str | Path) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """A legacy .dat file -> (name -> fp32 flat means value / ncall (an expert stack's E * in values),
    chunk count, datasets); ValueError naming the problem on a damaged file."""
    data = Path(path).read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise ValueError(f"{path} is truncated or not an imatrix file (reading {what} at byte {pos})")
        pos += n
        return data[pos - n: pos]

    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1 or n_entries > len(data) // 12:
        raise ValueError(f"{path} is not an imatrix file (GGUF or llama.cpp's legacy .dat)")
    out = {}
    for i in range(n_entries):
        (n,) = struct.unpack("<i", take(4, f"entry {i}'s name length"))
        if n < 1 or n > 4096:
            raise ValueError(f"{path} is not an imatrix file (entry {i} has a name of {n} bytes)")
        try:
            name = take(n, f"entry {i}'s name").decode()
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not an imatrix file (entry {i}'s name is no text)") from None
        ncall, nval = struct.unpack("<ii", take(8, f"{name}'s counts"))
        if nval < 1:
            raise ValueError(f"{path}: {name} has {nval} values")
        v = torch.from_numpy(np.frombuffer(take(4 * nval, f"{name}'s values"), "<f4").astype(np.float32))
        out[name] = v / ncall if ncall > 0 else v  # llama-quantize: an ncall of 0 leaves the values
    chunks, datasets = 0, []
    if pos + 4 <= len(data):  # the trailer is optional
        (chunks,) = struct.unpack("<i", take(4, "the chunk count"))
        if pos + 4 <= len(data):
            (n,) = struct.unpack("<i", take(4, "the dataset name length"))
            if 0 < n <= len(data) - pos:
                datasets.append(take(n, "the dataset name").decode(errors="replace"))
    return out, chunks, datasets


# ---- shapes ----------------------------------------------------------------------------------------


def fit_shapes(imatrix: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """A legacy file's flat expert-stack entries (E * in,) -> (E, in) where the model's weight is (E, F, in)."""
    out = {}
    for name, v in imatrix.items():
        shape = tuple(shapes.get(name, ()))
        if len(shape) == 3 and v.dim() == 1 and v.numel() == shape[0] * shape[-1] and shape[0] > 1:
            v = v.reshape(shape[0], shape[-1])
        out[name] = v
    return out
