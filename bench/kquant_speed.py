"""K-quant encoder time, ours (kernels/cpu_kencode.cpp) against llama.cpp's ggml_quantize_chunk (what
llama-quantize calls per tensor), on the same tensors, one thread each, CPU seconds in this process.

    LLAMACPP_VENV=... python bench/kquant_speed.py --base base-f16.gguf [--type Q4_K Q6_K] [--rounds 3]

Tensors: every 2-D tensor of the base whose rows split into 256-value blocks (in the default model the
ffn_down matrices: other rows fall back to 32-value types). With --imatrix each is also encoded with an
importance vector (random, the same for both tools). Rounds interleave ours and llama.cpp's, so a
shared machine's load hits both alike; per round the ratio, then the median of the ratios.
libggml-base.so comes from the llama-cpp-python venv of bench/llamacpp_env.py.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_env import ensure_llamacpp  # noqa: E402

from localllm.kernels.cpu import load_extension  # noqa: E402
from localllm.settings import DEFAULT_CPU  # noqa: E402

Q = gguf.GGMLQuantizationType


def libggml() -> ctypes.CDLL:
    python = ensure_llamacpp()
    found = sorted(python.parent.parent.glob("lib/python3*/site-packages/llama_cpp/lib/libggml-base.so"))
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def k_tensors(base: Path) -> list[np.ndarray]:
    reader = gguf.GGUFReader(str(base))
    out = []
    for t in reader.tensors:
        if len(t.shape) == 2 and int(t.shape[0]) % 256 == 0:
            out.append(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--type", nargs="+", default=["Q4_K", "Q6_K"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--imatrix", action="store_true")
    args = ap.parse_args()
    ext = load_extension(DEFAULT_CPU.cache_dir)
    lib = libggml()
    tensors = k_tensors(Path(args.base))
    n_values = sum(t.size for t in tensors)
    rng = np.random.default_rng(0)
    imats = [rng.uniform(0.01, 2, t.shape[1]).astype(np.float32) if args.imatrix else None for t in tensors]
    print(f"{len(tensors)} tensors, {n_values / 1e6:.1f}M values; imatrix {args.imatrix}")
    for name in args.type:
        qtype = Q[name]
        nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
        lib.ggml_quantize_init(int(qtype))
        ratios = []
        for r in range(args.rounds):
            start = time.process_time()
            for t, im in zip(tensors, imats):
                ext.kquant_encode(torch.from_numpy(t), int(qtype), nbytes,
                                  torch.empty(0) if im is None else torch.from_numpy(im), 1)
            ours = time.process_time() - start
            start = time.process_time()
            for t, im in zip(tensors, imats):
                dst = np.empty((t.shape[0], t.shape[1] // 256 * nbytes), np.uint8)
                lib.ggml_quantize_chunk(int(qtype), t.ctypes.data, dst.ctypes.data, 0, t.shape[0], t.shape[1],
                                        None if im is None else im.ctypes.data)
            theirs = time.process_time() - start
            ratios.append(ours / theirs)
            print(f"{name} round {r}: ours {ours:.2f} cpu-s ({n_values / ours / 1e6:.1f}M values/s), llama.cpp "
                  f"{theirs:.2f} cpu-s ({n_values / theirs / 1e6:.1f}M values/s), ratio {ours / theirs:.2f}", flush=True)
        print(f"{name}: median ratio ours / llama.cpp {statistics.median(ratios):.2f} over {args.rounds} rounds")


if __name__ == "__main__":
    main()
