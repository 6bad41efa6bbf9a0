"""Quantized weights on the CPU: GGUF blocks read by C++ kernels, most of them repacked at load.

The C++ sources (kernels/cpu_*.cpp) are compiled on first use with torch.utils.cpp_extension into the
cache folder the loader passes (localllm/settings.py's; about a minute on 2 cores, once; a message
says so). Where they
cannot build (no compiler, not x86-64 with AVX2) every product falls back to the torch reference:
decode the blocks with quantize.dequantize_torch, then F.linear.

Layouts (BlockQWeight.parts): "raw", the file's blocks (N, row bytes); or "tiles", 8-row tiles whose
integer dot products serve 8 rows at a time (kernels/cpu_tiles.h: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, MXFP4 and IQ4_NL keep their size; Q4_K / Q5_K grow by a third, their scales widened to exact
fp32, Q6_K by 7% (its int8 scales and fp16 d kept), IQ4_XS by 18%; MXFP4, IQ4_NL and IQ4_XS keep their 4-bit codes, looked up as integers at unpack).
Products (y = x @ w.T, x (T, K) fp32): x rounded to int16 per 32 values, exact integer dot products
with the quantized weights, fp32 scales (cpu_quant.cpp, cpu_tiles.cpp); for a prompt each unpacked
tile-group serves 4 rows of x. llama.cpp rounds x to int8, which is about 1.5x faster for long
prompts but moves greedy output off the fp32 reference where the top two logits are close; int16
keeps it (error: docs/PERFORMANCE.md) and costs nothing in decode, which is bound by reading the
weights. Untiled quantized weights (Q2_K, Q3_K) of long prompts: decoded to fp32 (bit-identical to
dequantize_torch) one matrix at a time for torch's fp32 GEMM. Dense rows of long prompts: a blocked
fp32 GEMM that decodes 16 rows x 256 values at a time into L1 (cpu_gemm.cpp; faster than torch's GEMM
on a decoded copy, and no (N, K) fp32 copy).
Dense F32/F16/BF16 rows of short inputs: fp32 FMA products, several weight rows and inputs a pass
(decode: one row at a time, the weights read as one prefetched stream). Packed weights live in 2 MiB
pages where Linux gives them (kernels/cpu_memory.py).
A whole decode step (T = 1) runs in C++ without returning to Python: localllm/backends/cpu.py.
MPS (Apple) keeps the file's blocks and runs the torch fallback (dequantize_torch's ops run there).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import torch
import torch.nn.functional as F

from localllm.cores import physical_cores  # noqa: F401 (torch-free home; re-exported)
from localllm.quantize.decode import dequantize_torch
from localllm.quantize.formats import FORMATS

from .cpu_memory import huge_page_copy
from .qweight import QWeight

Q = gguf.GGMLQuantizationType
SOURCES = ("cpu_quant.cpp", "cpu_tiles.cpp", "cpu_decode.cpp", "cpu_moe.cpp", "cpu_bind.cpp")
HEADERS = ("cpu_quant.h", "cpu_simd.h", "cpu_tiles.h", "cpu_decode.h", "cpu_vmath.h", "cpu_moe.h")
SOURCES += ("cpu_encode.cpp",)  # Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 encoders (quantize/blocks.py's C++ path)
HEADERS += ("cpu_encode.h", "cpu_values.h")
SOURCES += ("cpu_kencode.cpp",)  # K-quant encoders (quantize/blocks.py's C++ path)
HEADERS += ("cpu_kencode.h", "cpu_kencode_avx.h")
SOURCES += ("cpu_gemm.cpp",)  # dense rows' prompt products (qlinear past QMATVEC_MAX_ROWS)
HEADERS += ("cpu_gemm.h",)
# Types the C++ products read in place (plus F32/F16/BF16 matrices, multiplied in fp32): Format.cpu.
CPU_TYPES = frozenset(t for t, f in FORMATS.items() if f.cpu and not f.dense)
DENSE_TYPES = frozenset(t for t, f in FORMATS.items() if f.cpu and f.dense)


@dataclass
class BlockQWeight(QWeight):
    """A (N, K) weight of GGUF type qtype for the CPU (or MPS), parts["raw"] uint8 (N, row bytes) as the
    file stores it, or parts["tiles"] uint8 (repacked by pack_for_cpu). dtype: what its products
    return (the activations' dtype: float32 on the CPU). ext: the compiled kernels that run it
    (load_extension), None for the torch fallback."""

    dtype: torch.dtype = torch.float32
    ext: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, qtype: Q, dtype: torch.dtype) -> "BlockQWeight":
        fmt = FORMATS[qtype]
        return cls(qtype, (raw.shape[0], raw.shape[1] // fmt.nbytes * fmt.block), {"raw": raw}, dtype=dtype)

    @property
    def tiled(self) -> bool:
        return "tiles" in self.parts

    @property
    def data(self) -> torch.Tensor:
        return self.parts["tiles" if self.tiled else "raw"]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) values, equal to dequantize_torch of the file's blocks."""
        if not self.tiled:
            return dequantize_torch(self.parts["raw"], self.qtype).to(dtype)
        return dequantize_rows(self, 0, self.shape[0]).to(dtype)


# Weights kept as GGUF blocks (Q2_K, Q3_K) or dense take the integer products up to this many rows
# of x; more (a long prompt) decode the weight to fp32 for torch's GEMM. Tiles always take them.
QMATVEC_MAX_ROWS = 64
# -std=c++20: cpu_tiles.cpp's templates take class-type parameters; torch before 2.13 builds extensions as
# C++17 (on such a torch, without the flag, the kernels did not build and every product took the torch
# fallback, ~40x slower decode: seen on an H100 machine's host with torch 2.11).
from .cpu_encode_lib import CFLAGS  # noqa: E402 (one set of flags for both builds)


def build_dir(cache_dir: Path) -> Path:
    """One folder per version of the sources and flags: a stale build is never loaded."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha1(" ".join(CFLAGS + (torch.__version__,)).encode())
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    return cache_dir / "cpu_ext" / digest.hexdigest()[:16]


@cache
def extension(folder: Path):
    """The compiled module, or None where it cannot build (then the torch fallback runs)."""
    built = folder / "localllm_cpu.so"
    if built.exists():  # importing it directly skips cpp_extension's checks (~2 s)
        spec = importlib.util.spec_from_file_location("localllm_cpu", built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    from localllm.progress import elapsed_spinner

    here = Path(__file__).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    print(f"building localllm's CPU kernels into {folder} (about a minute, once) ...", file=sys.stderr)
    for old in folder.parent.iterdir():  # builds of earlier sources: never loaded again
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    try:
        with elapsed_spinner("building localllm's CPU kernels (once)"):
            return cpp_extension.load(
                name="localllm_cpu",
                sources=[str(here / s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, or a CPU the sources do not support
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"note: localllm's CPU kernels did not build ({reason}); using the slower torch path", file=sys.stderr)
        return None


def load_extension(cache_dir: Path):
    """The kernels built for these sources under cache_dir (localllm/settings.py's), or None."""
    return extension(build_dir(cache_dir))


def encoders_for(device: torch.device | str, cache_dir: Path):
    """The kernels whose encoders quantize_tensor(..., ext=) uses for tensors on `device` (same bytes
    as the torch encoders, faster): the CPU's build, or None (another device, or no build)."""
    return load_extension(cache_dir) if torch.device(device).type == "cpu" else None


def fits_cpp(w: BlockQWeight) -> bool:
    return w.device.type == "cpu" and w.qtype in CPU_TYPES | DENSE_TYPES and w.shape[1] % 32 == 0


def runs_in_cpp(w: BlockQWeight) -> bool:
    return w.ext is not None and fits_cpp(w)


def args(w: BlockQWeight) -> tuple:
    """The (data, type id, N, K, tiled) the C++ functions take for a weight."""
    return w.data, int(w.qtype), w.shape[0], w.shape[1], w.tiled


def pack_for_cpu(w: BlockQWeight, ext) -> BlockQWeight:
    """The weight for the kernels `ext` (None: w itself, for the torch fallback): repacked into 8-row
    tiles where its type has them, else its blocks copied; no view of the file's mapping remains."""
    if ext is None or not fits_cpp(w):
        return w
    # One thread: repacking is bound by memory (0.1 s for the default model), and a load must not
    # wait on a second thread that a busy machine has descheduled.
    tiles = ext.repack(w.parts["raw"].contiguous(), int(w.qtype), w.shape[1], 1)
    parts = {"tiles": huge_page_copy(tiles)} if tiles.numel() else {"raw": huge_page_copy(w.parts["raw"])}
    return BlockQWeight(w.qtype, w.shape, parts, dtype=w.dtype, ext=ext)


def dequantize_rows(w: BlockQWeight, n0: int, n1: int) -> torch.Tensor:
    """Rows [n0, n1) -> (n1 - n0, K) fp32, dequantize_torch's values."""
    if not runs_in_cpp(w):
        return dequantize_torch(w.parts["raw"][n0:n1], w.qtype)
    return w.ext.dequantize(*args(w), n0, n1, torch.get_num_threads())


def row_view(w: BlockQWeight, n0: int, n1: int) -> BlockQWeight | None:
    """Rows [n0, n1) of w as a BlockQWeight viewing w's data (no copy): one expert of a stacked
    (E * F, K) expert tensor (localllm/moe.py). Tiles hold 8 rows each: a tiled weight gives a view
    only from a tile boundary (n0 % 8 == 0; rows past n1 in the last tile are never computed, as
    past N in any last tile), else None."""
    if not w.tiled:
        return BlockQWeight(w.qtype, (n1 - n0, w.shape[1]), {"raw": w.parts["raw"][n0:n1]}, dtype=w.dtype, ext=w.ext)
    if n0 % 8:
        return None
    tiles = w.parts["tiles"]
    tile_bytes = tiles.numel() // ((w.shape[0] + 7) // 8)
    view = tiles[n0 // 8 * tile_bytes:(n1 + 7) // 8 * tile_bytes]
    return BlockQWeight(w.qtype, (n1 - n0, w.shape[1]), {"tiles": view}, dtype=w.dtype, ext=w.ext)


def qlinear_rows(x: torch.Tensor, w: BlockQWeight, n0: int, n1: int, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ w[n0:n1].T + b -> (..., n1 - n0), reading only those rows of w."""
    view = row_view(w, n0, n1)
    if view is not None:
        return qlinear(x, view, b)
    return F.linear(x, dequantize_rows(w, n0, n1).to(x.dtype), b)  # an unaligned tiled range: its rows only


def qlinear(x: torch.Tensor, w: BlockQWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ w.T + b -> (..., N) in x's dtype."""
    if not runs_in_cpp(w):
        return F.linear(x, dequantize_torch(w.parts["raw"], w.qtype).to(x.dtype), b)
    ext = w.ext
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    if w.tiled or x2.shape[0] <= QMATVEC_MAX_ROWS:
        y = ext.qmatmul(x2, *args(w), torch.get_num_threads())
        y = y if b is None else y + b
    elif w.qtype in DENSE_TYPES:  # the rows decoded a panel at a time inside the GEMM (cpu_gemm.cpp)
        y = ext.dense_gemm(x2, w.data, int(w.qtype), *w.shape, torch.get_num_threads())
        y = y if b is None else y + b
    else:
        y = F.linear(x2, fp32_rows(w), b)
    return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


def fp32_rows(w: BlockQWeight) -> torch.Tensor:
    """(N, K) fp32 values of a weight the C++ kernels run, for torch's GEMM: an F32 weight's own rows
    (a view, no copy), others decoded (dequantize_rows)."""
    if w.qtype == Q.F32 and not w.tiled:
        return w.parts["raw"].view(torch.float32)
    return dequantize_rows(w, 0, w.shape[0])


def embed(w: BlockQWeight, tokens: torch.Tensor) -> torch.Tensor:
    """Rows `tokens` (any shape) of the weight -> (*tokens.shape, K) fp32, dequantize_torch's values."""
    if not runs_in_cpp(w):  # the file's blocks of those rows, decoded in one call (MPS, fallback)
        return dequantize_torch(w.parts["raw"][tokens.reshape(-1)], w.qtype).reshape(*tokens.shape, w.shape[1])
    ids = tokens.reshape(-1).tolist()
    rows = [dequantize_rows(w, i, i + 1) for i in ids] if ids else [torch.empty(0, w.shape[1])]
    return torch.cat(rows).reshape(*tokens.shape, w.shape[1])
