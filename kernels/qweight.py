"""QWeight: a quantized weight kept quantized on the device, as planar arrays of the GGUF block fields.

A GGUF row of a (N, K) weight is K / block blocks of interleaved fields (scales, quants). For 16-byte
loads the fields are split into one array each, row-major (N, ...), every byte kept as stored, so
the decoded values are those of `quantize.dequantize_torch` bit for bit:

| type | planar fields (each (N, X)) |
| --- | --- |
| Q8_0 | qs (N, K) (the int8 bits as uint8), d fp16 (N, K/32) |
| Q4_0 | qs uint8 (N, K/2) (the block's nibble bytes in order), d fp16 (N, K/32) |
| Q4_1 | qs, d, m fp16 (N, K/32) |
| Q4_K | qs (N, K/2), d, dmin fp16 (N, K/256), sc, mn uint8 (N, K/32) (the 6-bit scales unpacked) |
| Q5_K | as Q4_K, plus qh uint8 (N, K/8) |
| Q6_K | ql (N, K/2), qh (N, K/4), sc int8 (N, K/16), d fp16 (N, K/256) |
| MXFP4 | qs uint8 (N, K/2) (as Q4_0's), e uint8 (N, K/32) (the E8M0 exponent byte) |
| IQ4_NL | qs uint8 (N, K/2) (as Q4_0's: codes into ggml's kvalues_iq4nl), d fp16 (N, K/32) |
| IQ4_XS | qs (N, K/2), d fp16 (N, K/256), scales_h uint8 (N, K/128), scales_l uint8 (N, K/64) (as stored) |
| others (Q5_0, Q5_1, Q2_K, Q3_K) | raw uint8 (N, row bytes): decoded to dense before each product |

Q4_K/Q5_K store 16 instead of 12 scale bytes per 256 values (4.625 instead of 4.5 bits per weight).
Each type's fields, which types a Triton kernel reads, and the block-major units are its Format's
(localllm.quantize.formats.FORMATS: fields, gemv, int_dot); the type sets here are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType

# Types with fused Triton kernels (kernels/triton_gemv.py); the rest are decoded to dense per product.
KERNEL_TYPES = frozenset(t for t, f in FORMATS.items() if f.gemv is not None)
# Types whose decode products take integer dot products against int8 activations (kernels/triton_q8.py),
# with each planar field's elements per unit of values (a Q8_0/Q4_0 block of 32, a 64-value chunk of a
# Q4_K super-block, a 128-value half of a Q6_K one) in the block-major layout; 1: per 16/32/256 values.
BLOCK_MAJOR = {t: dict(f.int_dot.chunks) for t, f in FORMATS.items() if f.int_dot is not None}
INT_DOT_TYPES = frozenset(BLOCK_MAJOR)
QUANTIZED_TYPES = frozenset(t for t, f in FORMATS.items() if not f.dense)


def planar_fields(raw: torch.Tensor, qtype: Q) -> dict[str, torch.Tensor]:
    """raw uint8 (N, row bytes) -> the planar fields of the table above (Format.planar)."""
    return FORMATS[qtype].planar(raw)


@dataclass
class QWeight:
    """A (N, K) weight of GGUF type `qtype`, held as `parts` (planar fields, see the module doc).

    blocks: the fields are block-major, each (X / c, N, c) for c of BLOCK_MAJOR (a field of the table
    above transposed by units): a warp's threads then read consecutive rows of one unit, one contiguous
    run, and share its x values (kernels/triton_q8.py). The bytes are the same, reordered."""

    qtype: Q
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor]
    blocks: bool = False
    # (N, K) values decoded once, which many-row products (prompts) multiply instead of decoding the
    # parts each time; kept by a runtime where memory allows (backends/cuda.keep_dense_prompt_weights)
    dense: torch.Tensor | None = None

    @classmethod
    def from_raw(cls, raw: torch.Tensor, qtype: Q) -> "QWeight":
        """raw: uint8 (N, row bytes), the GGUF tensor data, on the device it will run on."""
        fmt = FORMATS[qtype]
        n, row_bytes = raw.shape
        return cls(qtype, (n, row_bytes // fmt.nbytes * fmt.block), fmt.planar(raw))

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def has_kernel(self) -> bool:
        return self.qtype in KERNEL_TYPES

    def to_blocks(self) -> "QWeight":
        """The block-major form (INT_DOT_TYPES); others, and a weight in that form already, as they are."""
        if self.blocks or self.qtype not in BLOCK_MAJOR:
            return self
        n = self.shape[0]
        parts = {k: v.reshape(n, -1, BLOCK_MAJOR[self.qtype][k]).transpose(0, 1).contiguous()
                 for k, v in self.parts.items()}
        return QWeight(self.qtype, self.shape, parts, blocks=True)

    def to_rows(self) -> "QWeight":
        """The row-major planar form (a copy when block-major)."""
        if not self.blocks:
            return self
        parts = {k: v.transpose(0, 1).reshape(self.shape[0], -1).contiguous() for k, v in self.parts.items()}
        return QWeight(self.qtype, self.shape, parts)

    def rows(self, start: int, stop: int, step: int = 1) -> "QWeight":
        """Rows start:stop:step as views (the row axis of every field: 0, or 1 when block-major;
        kernels take row strides)."""
        parts = {k: v[:, start:stop:step] if self.blocks else v[start:stop:step] for k, v in self.parts.items()}
        return QWeight(self.qtype, (len(range(start, stop, step)), self.shape[1]), parts, self.blocks)

    @staticmethod
    def cat(ws: list["QWeight"], interleave: bool = False) -> "QWeight":
        """Stack weights of one type and K along rows (fused q|k|v), or interleave their rows
        (a0, b0, a1, b1, ...: fused gate/up for the GLU epilogue; all of one shape)."""
        qtype, k, blocks = ws[0].qtype, ws[0].shape[1], ws[0].blocks
        assert all(w.qtype == qtype and w.shape[1] == k and w.blocks == blocks for w in ws)
        axis = 1 if blocks else 0  # the row axis
        if interleave:
            join = lambda ts: torch.stack(ts, axis + 1).flatten(axis, axis + 1)  # noqa: E731
        else:
            join = lambda ts: torch.cat(ts, axis)  # noqa: E731
        parts = {name: join([w.parts[name] for w in ws]) for name in ws[0].parts}
        return QWeight(qtype, (sum(w.shape[0] for w in ws), k), parts, blocks)
