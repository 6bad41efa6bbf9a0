"""The description every GGUF block format gives of itself (one `Format` per type, quantize/formats/).

A format's stored block is `nbytes` bytes holding `block` values, cut into `fields` (byte offset,
size). The runtimes keep some types split into planar arrays, one per field (kernels/qweight.py's
QWeight, for the Triton kernels), and the integer-dot kernels (kernels/triton_q8.py) also reorder
those arrays block-major by units of values: those facts are here too, so quantize/, the kernels and
the loaders all read one table (quantize.formats.FORMATS), as gguf-py's quants.py keeps one class per
type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gguf
import torch


@dataclass(frozen=True)
class Field:
    """Bytes offset..offset + size of every block. dtype: the planar copy's view of them (fp16 scales,
    int8 Q6_K scales; quants stay uint8, Q8_0's int8 included). unpack: for a field widened at load,
    (B, size) bytes -> {planar name: (B, X)} (the K-quants' 6-bit scales and mins, one byte each)."""

    name: str
    offset: int
    size: int
    dtype: torch.dtype = torch.uint8
    unpack: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None


@dataclass(frozen=True)
class IntDot:
    """How kernels/triton_q8.py's integer-dot products read a type's planar fields.

    unit: values per unit (a Q8_0/Q4_0 block of 32, a 64-value chunk of a Q4_K super-block, a
    128-value half of a Q6_K one); chunks: each planar field's elements per unit in the block-major
    layout (QWeight.to_blocks); args: the fields passed as the kernel's pointers P0..P4 (None: unused)."""

    unit: int
    chunks: Mapping[str, int]
    args: tuple[str | None, ...]


@dataclass(frozen=True)
class Format:
    """One GGUF tensor type: its block geometry, byte layout, encoder and torch decoder.

    encode: dense types: (R, C) float32 -> (R, C * bytes per value) uint8; block types: (B, block)
    float32 values and (B, block) weights or None -> candidate encodings, each (B, nbytes) uint8
    (quantize/blocks.py keeps each block's best). imatrix: the encoder takes the importance itself
    (K-quants), not llama.cpp's per-row weights of the 32-value formats.
    decode: (B, nbytes) uint8 -> (B, block) float32, exactly gguf.quants.dequantize's values.
    gemv: planar fields passed as kernels/triton_gemv.py's pointers P0..P5 (None: unused), or None
    where no Triton kernel reads the type (QWeight keeps its raw blocks, decoded per product).
    int_dot: kernels/triton_q8.py's view, or None. cpu: the C++ products (kernels/cpu.py) read it.
    """

    qtype: gguf.GGMLQuantizationType
    block: int
    nbytes: int
    fields: tuple[Field, ...]
    encode: Callable
    decode: Callable[[torch.Tensor], torch.Tensor]
    dense: bool = False
    imatrix: bool = False
    gemv: tuple[str | None, ...] | None = None
    int_dot: IntDot | None = None
    cpu: bool = True

    @property
    def bits(self) -> float:
        """Stored bits per value, block scales included (Q4_K: 4.5, Q6_K: 6.5625)."""
        return 8 * self.nbytes / self.block

    def planar(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """raw uint8 (N, row bytes) -> planar fields, each (N, X) row-major, every byte as stored
        (widened fields unpacked); {"raw": raw} for a type no Triton kernel reads."""
        if self.gemv is None:
            return {"raw": raw.contiguous()}
        n = raw.shape[0]
        b = raw.reshape(-1, self.nbytes)
        out = {}
        for f in self.fields:
            part = b[:, f.offset:f.offset + f.size]
            if f.unpack is not None:
                out.update({k: v.reshape(n, -1) for k, v in f.unpack(part).items()})
            else:
                out[f.name] = part.contiguous().view(f.dtype).reshape(n, -1)
        return out
