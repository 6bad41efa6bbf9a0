"""Byte packing shared by the encoders: the inverses of quantize/formats/bits.py's unpacking helpers."""

from __future__ import annotations

import torch


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(B,) float32 -> (B, 2) uint8, the little-endian fp16 (round to nearest even, like ggml)."""
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    """The float32 value an fp16 field will decode to."""
    return v.to(torch.float16).float()


def pack_nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two int tensors of 4-bit fields -> uint8 bytes low | high << 4."""
    return ((low & 0xF) | ((high & 0xF) << 4)).to(torch.uint8)


def pack_bit_planes(fields: torch.Tensor, nbits: int) -> torch.Tensor:
    """(B, 8 // nbits, n) int fields -> (B, n) uint8: field k at bits nbits*k (formats/bits.bit_planes' inverse)."""
    shifts = torch.arange(0, 8, nbits, device=fields.device, dtype=torch.int32).view(-1, 1)
    packed = ((fields.int() & ((1 << nbits) - 1)) << shifts).sum(dim=-2)
    return packed.to(torch.uint8)


def high_bit_bytes(q: torch.Tensor, bit: int) -> torch.Tensor:
    """(B, 256) quants -> (B, 32): byte e % 32, bit e // 32 = bit `bit` of q[e] (Q3_K hmask, Q5_K qh)."""
    return pack_bit_planes((q >> bit).reshape(-1, 8, 32), 1)


def two_bit_bytes(q: torch.Tensor) -> torch.Tensor:
    """(B, 256) 2-bit quants -> (B, 64): per half of 128, byte l holds q[32k + l] at bits 2k (Q2_K, Q3_K)."""
    return pack_bit_planes(q.reshape(-1, 4, 32), 2).reshape(-1, 64)


def cat_bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.to(torch.uint8) for p in parts], dim=-1)
