"""The GGUF tensor types localllm reads and writes, and their block geometry, without torch.

quantize/formats/ (FORMATS) holds each type's encoder and torch decoder; these facts are the ones a
plan (quantize/plan.py) and the loader's checks (localllm/validate.py) need, kept importable without
torch for `localllm quantize`'s torch-free preset path (commands/quantize_native.py). formats/__init__.py
checks at import that FORMATS covers exactly these types with these sizes.
"""

from __future__ import annotations

import gguf

Q = gguf.GGMLQuantizationType

# Tensor types the runtime reads (issue: core runtime): FORMATS' keys.
SUPPORTED_TYPES = frozenset((
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS,
))

# type -> (values per block, bytes per block): the gguf package's table.
BLOCK_SIZES = {t: tuple(gguf.GGML_QUANT_SIZES[t]) for t in SUPPORTED_TYPES}


class UnsupportedTypeError(ValueError):
    """A tensor type outside SUPPORTED_TYPES."""


def check_type(qtype: gguf.GGMLQuantizationType) -> None:
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTypeError(f"unsupported tensor type {qtype.name}")


def bits_per_weight(qtype: gguf.GGMLQuantizationType) -> float:
    """Stored bits per value, block scales included (Q4_K: 4.5, Q6_K: 6.5625)."""
    check_type(qtype)
    block, nbytes = BLOCK_SIZES[qtype]
    return nbytes * 8 / block


# The types kernels/cpu_kencode.cpp encodes (quantize.blocks.quantize_tensor's ext).
CPP_K_TYPES = frozenset((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))

# `quantize` writes a tensor with the C++ encoders on all threads from this much work on (values;
# a K-quant value counts 8: its search costs ~4-8x a 32-value type's rule), on one thread below it: a Q8_0
# matrix of 1M values is ~6 ms of work, less than what a parallel region costs on a busy machine (a
# worker waiting for a time slice; measured on the 2-core CI machine: docs/PERFORMANCE.md, h23-qstart).
# (--target-*'s sampled rows keep all threads: quantize_tensor's default.)
PARALLEL_MIN_WORK = 1 << 22


def encode_threads(values: int, qtype: gguf.GGMLQuantizationType, threads: int) -> int:
    """The C++ encoders' threads for a whole tensor of `values` values written to qtype: `threads`, or 1
    below PARALLEL_MIN_WORK (both quantize paths: quantize.blocks.write_threads, commands/quantize_native)."""
    work = values * (8 if qtype in CPP_K_TYPES else 1)
    return threads if work >= PARALLEL_MIN_WORK else 1
