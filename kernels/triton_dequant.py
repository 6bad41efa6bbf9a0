"""Block-major quantized weights decoded to dense for prompt products (kernels/linear.py: a prompt's
product is dequantize + cuBLAS), read where they lie: the CUDA backend keeps the integer-dot types
(Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS) block-major (kernels/qweight.py), and decoding them through a row-major copy
first (QWeight.to_rows, then triton_gemv.dequantize) ran at ~1 TB/s; this kernel writes the dense
values at 2.0-2.7 TB/s on an H100 (bench/qgemm.py, docs/PERFORMANCE.md).

Each program decodes 128 values of BN rows as two (BN, 64) tiles, lo and hi, in the order the bytes
hold them (a byte's low and high nibbles, Q4_K's two sub-blocks of a chunk), with their columns
clo, chi. The values are quantize.dequantize_torch's (fp32, then rounded to the output dtype), bit for
bit. kernels/triton_qgemm.py decodes the same tiles inside its GEMM's K loop (block_tile, shared).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qweight import QWeight
from .triton_base import FUSION
from .triton_gemv import e2m1_value, int_f32, iq4_value

Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS = 0, 1, 2, 3, 4, 5, 6
FMT = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_K": Q4_K, "Q6_K": Q6_K, "MXFP4": MXFP4, "IQ4_NL": IQ4_NL, "IQ4_XS": IQ4_XS}
FIELDS = {Q8_0: ("qs", "d"), Q4_0: ("qs", "d"), Q4_K: ("qs", "d", "dmin", "sc", "mn"), Q6_K: ("ql", "d", "qh", "sc"),
          MXFP4: ("qs", "e"), IQ4_NL: ("qs", "d"), IQ4_XS: ("qs", "d", "scales_h", "scales_l")}
UNIT = {Q8_0: 32, Q4_0: 32, Q4_K: 64, Q6_K: 128, MXFP4: 32, IQ4_NL: 32, IQ4_XS: 32}  # values per block-major unit
STEP = 128  # values of K per loop step
# columns of block_tile's parts that share one scale a row (a Q8_0 block, a Q4_K sub-block, half a 4-bit block)
WIDTH = {Q8_0: 32, Q4_0: 16, Q4_K: 32, Q6_K: 16, MXFP4: 16, IQ4_NL: 16, IQ4_XS: 16}


@triton.jit
def _at(P, U, S, u, r, e):
    """Block-major field element: unit u, row r (row stride S elements), element e of the unit's row."""
    return P + u * U + r * S + e


@triton.jit
def block_tile(FMT: tl.constexpr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, r, rmask, step,
               n_units, part=0, W: tl.constexpr = 64):
    """Rows r (BN, 1) at K step `step` -> lo, hi (BN, W) fp32 values and their columns clo, chi (1, W): part
    `part` of the step's two (BN, 64) tiles (W = 64: all of them). Every index is computed on the 2-D tile
    itself (a reshape of 3-D tiles cost the kernels 10x); integers become floats by the exact 2^23 bit trick
    (triton_gemv.int_f32: an int->float conversion issues at an eighth of the float rate). The GEMM of
    kernels/triton_qgemm.py takes parts of WIDTH[FMT] columns: one scale a row in each tile."""
    c = part * W + tl.arange(0, W)[None, :]
    cs = c  # the columns whose scales are loaded: (1, W); a part of one scale a row loads it once, (BN, 1)
    if W < 64:
        cs = part * W + tl.zeros((1, 1), tl.int32)
    if FMT == 0:  # Q8_0: blocks 4 step + {0, 1} (lo) and {2, 3} (hi); x = d q
        u = 4 * step + c // 32
        e = c % 32
        us = 4 * step + cs // 32
        # the int8 bits b as uint8: q = (b ^ 0x80) - 128
        q_lo = int_f32(tl.load(_at(P0, U0, S0, u, r, e), mask=rmask & (u < n_units), other=0).to(tl.int32) ^ 0x80,
                       128.0)
        q_hi = int_f32(tl.load(_at(P0, U0, S0, u + 2, r, e), mask=rmask & (u + 2 < n_units), other=0).to(tl.int32)
                       ^ 0x80, 128.0)
        lo = q_lo * tl.load(_at(P1, U1, S1, us, r, 0), mask=rmask & (us < n_units), other=0.0).to(tl.float32)
        hi = q_hi * tl.load(_at(P1, U1, S1, us + 2, r, 0), mask=rmask & (us + 2 < n_units), other=0.0).to(tl.float32)
        clo = 32 * u + e
        chi = clo + 64
    elif FMT == 1 or FMT >= 4:  # Q4_0 / MXFP4 / IQ4: blocks (sub-blocks) 4 step + {0..3}; byte e: value e (low
        # nibble), e + 16 (high); Q4_0 x = d (q - 8), MXFP4 x = 2^(e - 128) value(q), IQ4_NL x = d KVALUES[q],
        # IQ4_XS x = (d (scale - 32)) KVALUES[q] (triton_gemv.decode_tile's; triton_q8's IQ4_XS scale bits)
        u = 4 * step + c // 16
        e = c % 16
        us = 4 * step + cs // 16
        ms = rmask & (us < n_units)
        b = tl.load(_at(P0, U0, S0, u, r, e), mask=rmask & (u < n_units), other=0).to(tl.int32)
        if FMT == 1:
            d = tl.load(_at(P1, U1, S1, us, r, 0), mask=ms, other=0.0).to(tl.float32)
            lo = d * int_f32(b & 15, 8.0)
            hi = d * int_f32(b >> 4, 8.0)
        elif FMT == 4:
            x = tl.load(_at(P1, U1, S1, us, r, 0), mask=ms, other=0).to(tl.int32)
            d = tl.where(x < 2, 0x00200000 << tl.minimum(x, 1), (x - 1) << 23).to(tl.float32, bitcast=True)
            lo = d * e2m1_value(b & 15)
            hi = d * e2m1_value(b >> 4)
        else:
            if FMT == 5:
                d = tl.load(_at(P1, U1, S1, us, r, 0), mask=ms, other=0.0).to(tl.float32)
            else:
                sh = tl.load(_at(P2, U2, S2, us // 4, r, 0), mask=ms, other=0).to(tl.int32)
                sl = tl.load(_at(P3, U3, S3, us // 2, r, 0), mask=ms, other=0).to(tl.int32)
                sc = ((sl >> (4 * (us % 2))) & 15) | (((sh >> (2 * (us % 4))) & 3) << 4)
                d = tl.load(_at(P1, U1, S1, us // 8, r, 0), mask=ms, other=0.0).to(tl.float32) * int_f32(sc, 32.0)
            lo = d * iq4_value(b & 15)
            hi = d * iq4_value(b >> 4)
        clo = 32 * u + e
        chi = clo + 16
    elif FMT == 2:  # Q4_K: chunks 2 step + {0, 1}; byte e: value 64u + e (sub-block 2u), 64u + 32 + e (2u + 1)
        u = 2 * step + c // 32
        e = c % 32
        us = 2 * step + cs // 32
        m = rmask & (us < n_units)
        b = tl.load(_at(P0, U0, S0, u, r, e), mask=rmask & (u < n_units), other=0).to(tl.int32)
        d = tl.load(_at(P1, U1, S1, us // 4, r, 0), mask=m, other=0.0).to(tl.float32)
        dmin = tl.load(_at(P2, U2, S2, us // 4, r, 0), mask=m, other=0.0).to(tl.float32)
        sc_lo = int_f32(tl.load(_at(P3, U3, S3, 2 * us, r, 0), mask=m, other=0).to(tl.int32), 0.0)
        sc_hi = int_f32(tl.load(_at(P3, U3, S3, 2 * us + 1, r, 0), mask=m, other=0).to(tl.int32), 0.0)
        mn_lo = int_f32(tl.load(_at(P4, U4, S4, 2 * us, r, 0), mask=m, other=0).to(tl.int32), 0.0)
        mn_hi = int_f32(tl.load(_at(P4, U4, S4, 2 * us + 1, r, 0), mask=m, other=0).to(tl.int32), 0.0)
        lo = (d * sc_lo) * int_f32(b & 15, 0.0) - dmin * mn_lo
        hi = (d * sc_hi) * int_f32(b >> 4, 0.0) - dmin * mn_hi
        clo = 64 * u + e
        chi = clo + 32
    else:  # Q6_K half u = step: ql byte 32a + l: values 32a + l (low nibble), 64 + 32a + l (high); qh byte l:
        # 2 bits of each of values l + 32t; group scales per 16 values; x = d sc (q - 32)
        u = step
        a = cs // 32  # (from the scales' columns: a constant in a part, so the decode stays in registers)
        l = c % 32  # noqa: E741
        m = rmask  # K is whole 256-value super-blocks: every step's half exists
        ql = tl.load(_at(P0, U0, S0, u, r, c), mask=m, other=0).to(tl.int32)
        qh = tl.load(_at(P2, U2, S2, u, r, l), mask=m, other=0).to(tl.int32)
        q_lo = (ql & 15) | (((qh >> (2 * a)) & 3) << 4)
        q_hi = (ql >> 4) | (((qh >> (2 * a + 4)) & 3) << 4)
        d = tl.load(_at(P1, U1, S1, u // 2, r, 0), mask=m, other=0.0).to(tl.float32)
        g = 8 * u + 2 * a + (cs % 32) // 16
        sc_lo = int_f32(tl.load(_at(P3, U3, S3, g, r, 0), mask=m, other=0).to(tl.int32) + 128, 128.0)  # int8
        sc_hi = int_f32(tl.load(_at(P3, U3, S3, g + 4, r, 0), mask=m, other=0).to(tl.int32) + 128, 128.0)
        lo = (d * sc_lo) * int_f32(q_lo, 32.0)
        hi = (d * sc_hi) * int_f32(q_hi, 32.0)
        clo = 128 * u + c
        chi = clo + 64
    return lo, hi, clo, chi


@triton.jit
def _dequant_kernel(out_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, N, K, n_units,
                    FMT: tl.constexpr, BN: tl.constexpr):
    """out (N, K) = the decoded values; grid (N / BN, K / 128): one tile of 128 values of BN rows each."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    r = rn[:, None]
    rmask = r < N
    lo, hi, clo, chi = block_tile(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, r, rmask,
                             tl.program_id(1), n_units)
    row = out_ptr + r.to(tl.int64) * K
    ty = out_ptr.dtype.element_ty
    tl.store(row + clo, lo.to(ty), mask=rmask & (clo < K))
    tl.store(row + chi, hi.to(ty), mask=rmask & (chi < K))


def dequantize(w: QWeight, dtype: torch.dtype = torch.bfloat16, bn: int = 32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """A block-major QWeight -> dense (N, K) of `dtype`: dequantize_torch's values (fp32, then rounded),
    read in place (no row-major copy of the fields first); into `out` (contiguous (N, K)) where given."""
    fmt = FMT[w.qtype.name]
    n, k = w.shape
    ptrs, units, strides = field_args(w)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w.device)
    assert out.shape == (n, k) and out.is_contiguous()
    grid = (triton.cdiv(n, bn), triton.cdiv(k, STEP))
    _dequant_kernel[grid](out, *ptrs, *units, *strides, n, k, k // UNIT[fmt], FMT=fmt, BN=bn, num_warps=4, **FUSION)
    return out


def covers(w: QWeight) -> bool:
    """Whether qgemm takes this weight: block-major fields of a type above."""
    return w.blocks and w.qtype.name in FMT


def field_args(w: QWeight) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """-> five field tensors (unused ones repeat the first), their unit strides and row strides (elements)."""
    names = FIELDS[FMT[w.qtype.name]]
    ptrs = [w.parts[n] for n in names]
    ptrs += [ptrs[0]] * (5 - len(ptrs))
    assert all(p.stride(2) == 1 for p in ptrs), "block-major fields need contiguous units"
    return ptrs, [p.stride(0) for p in ptrs], [p.stride(1) for p in ptrs]
