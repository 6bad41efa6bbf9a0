"""Raw GGUF data of every tensor type the runtime reads: random blocks for the types gguf.quants cannot
quantize (the K-quants), and a model whose 2-D tensors take every type (mixed_type_raw).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_gguf import add_tensor, gguf_tensors
from tiny_spec import Q, TinySpec

# type -> byte offsets of the fp16 scale fields inside one block (ggml-common.h block_qN_K).
K_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
}


# type -> largest |sub-block scale x quant| a block can reach; super-block scales are drawn so that
# decoded values stay below ~0.3 (realistic weights, finite logits).
K_RANGE = {Q.Q2_K: 15 * 3, Q.Q3_K: 32 * 4, Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 128 * 32}


def raw_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks whose fp16 scales are finite and small."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    top = 0.3 / K_RANGE[qtype]
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.3 * top, top, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * nbytes)


def random_tensor_data(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF data of one tensor of this type: quantized by gguf where it can, else raw blocks."""
    if qtype in K_SCALE_OFFSETS:
        return raw_blocks(qtype, rows, cols, rng)
    return encode_exact((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)


def encode_exact(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x (rows, cols) fp32 in this type's raw GGUF form (gguf.quants where it is not plain numpy)."""
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):  # gguf cannot quantize them: ours, llama.cpp's bytes (tests/test_iq4.py)
        from localllm.quantize import quantize_tensor

        return quantize_tensor(torch.from_numpy(np.ascontiguousarray(x, np.float32)), qtype)
    return gguf.quants.quantize(x, qtype)


def write_raw_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A GGUF holding only these (raw data, type) tensors, no model metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, t) in tensors.items():
        add_tensor(w, name, raw, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# every tensor type the runtime reads, in the order mixed_type_raw gives them to the 2-D tensors
ALL_TYPES = [Q[n] for n in "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K MXFP4 IQ4_NL IQ4_XS".split()]


def mixed_type_raw(spec: TinySpec, seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF name -> (raw data, type): the i-th 2-D tensor takes ALL_TYPES[i % 16]; the model's own
    (already permuted) weights encoded where gguf can quantize the type, random blocks for K-quants."""
    rng = np.random.default_rng(seed)
    two_d = [(name, data) for name, data in gguf_tensors(spec).items() if data.ndim == 2]
    out = {}
    for i, (name, data) in enumerate(two_d):
        t = ALL_TYPES[i % len(ALL_TYPES)]
        out[name] = (raw_blocks(t, *data.shape, rng) if t in K_SCALE_OFFSETS else encode_exact(data, t), t)
    return out
