"""MXFP4's encoder (gpt-oss's expert weights): 32 values share one power-of-two scale, each value a
4-bit E2M1 float. Bit layout and decoder: quantize/formats/mx_types.py.

Reference rule (llama.cpp's quantize_row_mxfp4_ref, which gguf-py's MXFP4.quantize_blocks repeats;
llama.cpp's quantize_mxfp4 ignores an imatrix and uses it too):
    e = floor(log2(max |x|)) - 2 + 127 (0 for an all-zero block),  d = 2^(e - 128),
    q = the E2M1 code whose value d * KVALUES[q] is nearest x, the lowest code on ties.
So the largest code (12 d = 1.5 * 2^floor(log2 max)) may clip a block's largest values. With importance
weights two more candidates, e + 1 (nothing clips) and e - 1 (finer steps), are offered; quantize/blocks.py
keeps each block's least weighted error.
"""

from __future__ import annotations

import torch

from .pack import pack_nibbles

# E2M1 values doubled (the code's magnitude in its low 3 bits, the sign in bit 3): gguf's
# MXFP4.kvalues, ggml's kvalues_mxfp4.
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(e - 128), built from the bits as ggml_e8m0_to_fp32_half (gguf's
    MXFP4.e8m0_to_fp32_half): e < 2 gives the subnormals 2^-128, 2^-127."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e.clamp(max=1), (e - 1) << 23)
    return bits.view(torch.float32)


def scale_exponent(x: torch.Tensor) -> torch.Tensor:
    """(B, 32) -> (B, 1) int32 e of the reference rule, computed as gguf-py does (float32 log2).
    A block whose max is below 2^-125 would need e < 0, where llama.cpp's uint8 cast is undefined
    (numpy wraps): clamped to 0 here, the smallest scale."""
    amax = x.abs().amax(-1, keepdim=True)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) + 125
    return torch.where(amax > 0, e, torch.zeros_like(e)).clamp(0, 255).to(torch.int32)


def nearest_codes(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x (B, 32), d (B, 1) -> (B, 32) int32 codes: argmin over the 16 codes of |d * KVALUES[q] - x|,
    the first on ties (best_index_mxfp4). The error of code q and of its negative 8 + q mirror each
    other exactly (negation is exact), so the search runs over the 8 magnitudes of |x|: a negative x
    takes 8 + q, except for the value 0, which code 0 already gives (code 0 precedes code 8)."""
    ax = x.abs()
    best = torch.zeros_like(x, dtype=torch.int32)
    best_err = ax.clone()  # |d * 0 - |x||
    for q in range(1, 8):
        err = (d * KVALUES[q] - ax).abs()
        better = err < best_err
        best = torch.where(better, q, best)
        best_err = torch.where(better, err, best_err)
    return torch.where((x < 0) & (best > 0), best + 8, best)


def pack_mxfp4(e: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """e (B, 1), q (B, 32) codes -> (B, 17) bytes: e, then q[j] | q[j + 16] << 4."""
    return torch.cat((e.to(torch.uint8), pack_nibbles(q[:, :16], q[:, 16:])), dim=-1)


def encode_with_exponent(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    e = e.clamp(0, 254)  # 255 is the largest scale too (2^127); the rule never reaches it
    return pack_mxfp4(e, nearest_codes(x, e8m0_half(e)))


def encode_mxfp4(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    """(B, 32) blocks -> candidate (B, 17) encodings: the reference rule, and with weights its
    neighbouring exponents."""
    e = scale_exponent(x)
    out = [encode_with_exponent(x, e)]
    if w is not None:
        out += [encode_with_exponent(x, e + 1), encode_with_exponent(x, e - 1)]
    return out


def from_hf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Hugging Face MXFP4 checkpoint's tensor (gpt-oss: `*_blocks`, `*_scales`) -> GGUF MXFP4 rows,
    the bytes llama.cpp's converter writes (its GptOssModel.repack_mxfp4).

    blocks (..., G, 16) uint8: byte i of a 32-value block holds value 2i (low nibble) and 2i + 1 (high);
    scales (..., G) uint8 E8M0: value = FP4(code) * 2^(s - 127) (transformers' convert_moe_packed_tensors),
    which is KVALUES[code] * 2^(s - 128): the GGUF exponent byte is s itself, and the codes move to
    GGUF's order (byte j: values j and j + 16). -> (..., G * 17) uint8, rows as the checkpoint's
    (output features), blocks along the row; gpt-oss's interleaved gate/up rows stay interleaved.
    Code 8 decodes to +0 here, -0 in transformers."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 or \
            blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks (..., G, 16) and scales (..., G) uint8, got {tuple(blocks.shape)} "
                         f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    qs = pack_nibbles(values[..., :16], values[..., 16:])
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).reshape(*blocks.shape[:-2], -1)
