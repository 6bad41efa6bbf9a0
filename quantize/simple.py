"""Encoders of the float formats and the 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).

Each encoder takes the blocks of a tensor, x (B, 32) float32, and the per-value weights w (B, 32) of
llama.cpp's imatrix search (None without importance), and returns candidate encodings, each (B, bytes
per block) uint8; blocks.py keeps the best candidate of each block. Without weights the only
candidate is llama.cpp's reference rule (quantize_row_*_ref), which gguf-py repeats: the bytes equal
`gguf.quants.quantize`'s. Bit layouts are drawn in formats/legacy_types.py.
"""

from __future__ import annotations

import torch

from .ksearch import make_qkx
from .pack import cat_bytes, fp16_bytes, fp16_round, pack_nibbles
from .simple_search import qx_scale


# ---- float formats: x (R, C) -> (R, C * bytes per value)

def encode_f32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def encode_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8)


def encode_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even on the fp32 bits, NaNs made quiet: ggml_compute_fp32_to_bf16 (and gguf-py)."""
    n = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return torch.stack((n & 0xFF, (n >> 8) & 0xFF), dim=-1).to(torch.uint8).reshape(x.shape[0], -1)


# ---- helpers of the reference rules

def round_away(v: torch.Tensor) -> torch.Tensor:
    """roundf: halves away from zero, computed as gguf-py's np_roundf (exact for every float)."""
    a = v.abs()
    floor = a.floor()
    return torch.sign(v) * (floor + (2 * (a - floor)).floor())


def inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def symmetric_ref(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q4_0_ref / q5_0: d = max / -nmax, q = trunc(x / d + nmax + 0.5) in [0, 2 nmax - 1]."""
    xmax = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    d = xmax / -nmax
    q = torch.trunc(x * inverse(d) + (nmax + 0.5)).clamp(0, 2 * nmax - 1)
    return q.int(), d


def affine_ref(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_row_q4_1_ref / q5_1: d = (max - min) / nmax, m = min, q = trunc((x - m) / d + 0.5)."""
    low = x.amin(-1, keepdim=True)
    d = (x.amax(-1, keepdim=True) - low) / nmax
    q = torch.trunc((x - low) * inverse(d) + 0.5).clamp(0, nmax)
    return q.int(), d, low


# ---- byte layouts

def pack_q4_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return cat_bytes(fp16_bytes(d), pack_nibbles(q[:, :16], q[:, 16:]))


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return cat_bytes(fp16_bytes(d), fp16_bytes(m), pack_nibbles(q[:, :16], q[:, 16:]))


def fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """(B, 32) 5-bit quants -> (B, 4): the uint32 whose bit e is bit 4 of q[e], little-endian."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device, dtype=torch.int32)).sum(-1).to(torch.uint8)


def pack_q5_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return cat_bytes(fp16_bytes(d), fifth_bits(q), pack_nibbles(q[:, :16], q[:, 16:]))


def pack_q5_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return cat_bytes(fp16_bytes(d), fp16_bytes(m), fifth_bits(q), pack_nibbles(q[:, :16], q[:, 16:]))


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return cat_bytes(fp16_bytes(d), q.to(torch.int8).view(torch.uint8))


# ---- with importance: llama.cpp's weighted searches (quantize_row_*_impl, in C's arithmetic order:
# simple_search.py), then every value re-rounded against the fp16 scale (and min) as they decode

def symmetric_weighted(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants' scale -> quants in [0, 2 nmax - 1] (offset by nmax) and d."""
    d = fp16_round(qx_scale(x, w, nmax))
    q = torch.round(x / torch.where(d != 0, d, 1.0)).clamp(-nmax, nmax - 1)
    return torch.where(d != 0, q, 0.0).int() + nmax, d


def affine_weighted(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants' scale and min -> quants in [0, nmax], d and m (x ~ d * q + m)."""
    # make_qkx2_quants(rmin -0.9, rdelta 0.05, nstep 36), as kernels/cpu_encode.cpp's qkx_fit
    scale, the_min = make_qkx(x, w, nmax, -0.9, 0.05, 36, v3=False)
    d, m = fp16_round(scale), fp16_round(-the_min)
    q = torch.round((x - m) / torch.where(d != 0, d, 1.0)).clamp(0, nmax)
    return torch.where(d != 0, q, 0.0).int(), d, m


# ---- encoders: (B, 32) blocks -> candidate (B, bytes) encodings

def encode_q8_0(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    d = x.abs().amax(-1, keepdim=True) / 127
    out = [pack_q8_0(round_away(x * inverse(d)), d)]
    if w is not None:  # llama.cpp ignores an imatrix for Q8_0; the weighted search may use -128 too
        q, d = symmetric_weighted(x, w, 128)
        out.append(pack_q8_0(q - 128, d))
    return out


def encode_q4_0(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    out = [pack_q4_0(*symmetric_ref(x, 8))]
    if w is not None:
        out.append(pack_q4_0(*symmetric_weighted(x, w, 8)))
    return out


def encode_q5_0(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    out = [pack_q5_0(*symmetric_ref(x, 16))]
    if w is not None:
        out.append(pack_q5_0(*symmetric_weighted(x, w, 16)))
    return out


def encode_q4_1(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    out = [pack_q4_1(*affine_ref(x, 15))]
    if w is not None:
        out.append(pack_q4_1(*affine_weighted(x, w, 15)))
    return out


def encode_q5_1(x: torch.Tensor, w: torch.Tensor | None) -> list[torch.Tensor]:
    out = [pack_q5_1(*affine_ref(x, 31))]
    if w is not None:
        out.append(pack_q5_1(*affine_weighted(x, w, 31)))
    return out
