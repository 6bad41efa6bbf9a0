"""The C++ encoders (cpu_encode.cpp: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1; cpu_kencode.cpp: Q2_K .. Q6_K) as a
plain shared library called through ctypes on numpy arrays: no torch (`localllm quantize`'s torch-free
preset path, commands/quantize_native.py). The same functions as kernels/cpu.py's extension
(cpu_bind.cpp's encode_simple / kquant_encode): the same bytes.

Built on first use with the system C++ compiler (c++, else g++) and kernels/cpu.py's flags into
CACHE/cpu_encode_lib/<hash of sources, flags and compiler>/ (a few seconds to a minute, once; written under
a temporary name, then renamed). No compiler, or a CPU the sources do not build for (not x86-64 with
AVX2 / F16C): a note, and None (the caller takes the torch path).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np

SOURCES = ("cpu_encode.cpp", "cpu_kencode.cpp", "cpu_encode_capi.cpp")
HEADERS = ("cpu_encode.h", "cpu_kencode.h", "cpu_kencode_avx.h", "cpu_values.h")
# kernels/cpu.py's extension flags (it imports them from here): -std=c++20, -O3, this CPU's ISA, OpenMP.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20")
LIB_NAME = "liblocalllm_encode.so"


def encodes_on(device: str) -> bool:
    """Whether --device DEVICE lets `quantize` take this library (auto or cpu: the CPU's encoders give the
    same bytes wherever the torch path would run them)."""
    return device in ("auto", "cpu")


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def build_dir(cache_dir: Path, cxx: str) -> Path:
    """One folder per version of the sources, flags and compiler: a stale build is never loaded."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha1(" ".join(CFLAGS + (os.path.realpath(cxx),)).encode())
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    return cache_dir / "cpu_encode_lib" / digest.hexdigest()[:16]


@cache
def _load(folder: Path, cxx: str):
    built = folder / LIB_NAME
    if not built.exists():
        here = Path(__file__).resolve().parent
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.parent.iterdir():  # builds of earlier sources: never loaded again
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        print(f"building localllm's CPU encoders into {folder} (once) ...", file=sys.stderr)
        tmp = folder / f".{LIB_NAME}.{os.getpid()}.tmp"
        cmd = [cxx, *CFLAGS, "-shared", "-fPIC", "-o", str(tmp), *(str(here / s) for s in SOURCES)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            done = subprocess.CompletedProcess(cmd, 1, "", str(e))
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            lines = done.stderr.strip().splitlines()
            print(f"note: localllm's CPU encoders did not build ({lines[-1] if lines else 'compiler failed'});"
                  " using the torch path", file=sys.stderr)
            return None
        os.replace(tmp, built)
    try:
        lib = ctypes.CDLL(str(built))
    except OSError as e:
        print(f"note: localllm's CPU encoders did not load ({e}); using the torch path", file=sys.stderr)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("lq_encode_simple", "lq_kquant_encode"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int, ptr, ctypes.c_int, i64, i64, ptr, i64, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.lq_simple_block_bytes.argtypes = lib.lq_kquant_encodes.argtypes = [ctypes.c_int]
    lib.lq_simple_block_bytes.restype = lib.lq_kquant_encodes.restype = ctypes.c_int
    return lib


def load_encoders(cache_dir: Path):
    """The library built for these sources under cache_dir (localllm/settings.py's), or None (a note said why)."""
    cxx = compiler()
    if cxx is None:
        print("note: no C++ compiler (c++ / g++) for localllm's CPU encoders; using the torch path", file=sys.stderr)
        return None
    return _load(build_dir(cache_dir, cxx), cxx)


def encodes(lib, qtype: int) -> bool:
    """Whether encode takes ggml type qtype (the 32-value types and the K-quants of cpu_encode / cpu_kencode)."""
    return bool(lib.lq_simple_block_bytes(int(qtype)) or lib.lq_kquant_encodes(int(qtype)))


def encode(lib, x: np.ndarray, qtype: int, block_bytes: int, threads: int) -> np.ndarray:
    """x (rows, cols) float32 or float16 (any C-contiguous array, a read-only mapping included) -> uint8
    (rows, cols / block * block_bytes), the GGUF blocks of qtype (no importance: llama.cpp's reference
    rules and our refits, as quantize_tensor without an imatrix). ValueError on NaN or Inf."""
    if x.dtype not in (np.float32, np.float16) or x.ndim != 2:
        raise ValueError(f"expected a 2-D float32 or float16 array, got {x.dtype} {x.shape}")
    x = np.ascontiguousarray(x)
    rows, cols = x.shape
    simple = lib.lq_simple_block_bytes(int(qtype))
    block = 32 if simple else 256
    if cols % block:
        raise ValueError(f"rows of {cols} values do not split into blocks of {block}")
    out = np.empty((rows, cols // block * block_bytes), np.uint8)
    fn = lib.lq_encode_simple if simple else lib.lq_kquant_encode
    ok = fn(int(qtype), x.ctypes.data, int(x.dtype == np.float16), rows, cols, None, 0, out.ctypes.data, threads)
    if not ok:
        raise ValueError("non-finite values")
    return out
