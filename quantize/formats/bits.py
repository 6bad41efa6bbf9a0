"""Bit-unpacking helpers shared by the torch decoders (quantize/formats/*_types.py) and the loaders.

Each repeats gguf-py's arithmetic so that decoded values are bit-identical to gguf.quants.dequantize.
"""

from __future__ import annotations

import torch


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(B, 1) float32 of the fp16 at this byte offset of each block."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) bytes -> (B, ..., 2, n): low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def bit_planes(bytes_: torch.Tensor, nbits: int) -> torch.Tensor:
    """(B, n) bytes -> (B, 8 // nbits, n): field k of every byte, k = 0 at the low bits."""
    shifts = torch.arange(0, 8, nbits, device=bytes_.device, dtype=torch.uint8)
    return (bytes_.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << nbits) - 1)


def high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """(B, 4) little-endian uint32 -> (B, 32): bit e is the 5th bit of q[e]."""
    return bit_planes(qh, 1).transpose(1, 2).reshape(-1, 32)


def two_bit_quants(qs: torch.Tensor) -> torch.Tensor:
    """(B, 64) bytes -> (B, 256) 2-bit fields in value order (Q2_K and Q3_K low bits)."""
    halves = qs.reshape(-1, 2, 32)
    return bit_planes(halves.reshape(-1, 32), 2).reshape(-1, 256)


def unpack_q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """(B, 12) bytes -> (B, 16) int 6-bit scales minus 32 (Q3_K's pattern: quantize/formats/k_types.py)."""
    low = nibbles(sc[:, :8]).reshape(-1, 16)
    high = bit_planes(sc[:, 8:], 2).reshape(-1, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def unpack_k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 12) bytes -> (B, 8) scales, (B, 8) mins, uint8 (Q4_K and Q5_K; pattern: k_types.py)."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def k_scales_planar(sc: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes widened for the planar layout: sc, mn (B, 8) uint8."""
    scales, mins = unpack_k_scales(sc)
    return {"sc": scales, "mn": mins}
