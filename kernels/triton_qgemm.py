"""Prompt products on quantized weights without a dense copy: y = x @ W.T with W's blocks decoded inside
the GEMM's K loop, straight into the tensor cores (issue 20: prefill was 23-30% of matmul peak because
every forward decoded each weight to a dense bf16 matrix first, then multiplied).

Weights: block-major QWeight fields (kernels/qweight.py; the integer-dot types Q8_0, Q4_0, Q4_K, Q6_K,
as the CUDA backend keeps them). Each K step takes 128 values of a row as two (BN, 64) tiles, lo and hi,
in the order the bytes hold them (a byte's low and high nibbles, Q4_K's two sub-blocks of a chunk), and
loads x's columns in that same order (clo, chi), so no shuffle of the weights is needed. The decoded
values are those of triton_gemv.decode_tile / quantize.dequantize_torch (fp32, then rounded to x's
dtype, as the dense copy was); only the sum order differs from `F.linear(x, dequantize(w))`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qweight import QWeight
from .triton_base import INTERPRET

Q8_0, Q4_0, Q4_K, Q6_K = 0, 1, 2, 3
FMT = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
FIELDS = {Q8_0: ("qs", "d"), Q4_0: ("qs", "d"), Q4_K: ("qs", "d", "dmin", "sc", "mn"), Q6_K: ("ql", "d", "qh", "sc")}
UNIT = {Q8_0: 32, Q4_0: 32, Q4_K: 64, Q6_K: 128}  # values per block-major unit
STEP = 128  # values of K per loop step


@triton.jit
def _at(P, U, S, u, r, e):
    """Block-major field element: unit u, row r (row stride S elements), element e of the unit's row."""
    return P + u * U + r * S + e


@triton.jit
def _tile(FMT: tl.constexpr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, r, rmask, step, n_units):
    """Rows r (BN, 1, 1) at K step `step` -> lo, hi (BN, 64) fp32 values and their columns clo, chi (64,)."""
    if FMT == 0:  # Q8_0: blocks 4 step + {0, 1} (lo) and {2, 3} (hi); x = d q
        u = 4 * step + tl.arange(0, 2)[None, :, None]
        e = tl.arange(0, 32)[None, None, :]
        m_lo = rmask & (u < n_units)
        m_hi = rmask & (u + 2 < n_units)
        q_lo = tl.load(_at(P0, U0, S0, u, r, e), mask=m_lo, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        q_hi = tl.load(_at(P0, U0, S0, u + 2, r, e), mask=m_hi, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        lo = q_lo * tl.load(_at(P1, U1, S1, u, r, 0), mask=m_lo, other=0.0).to(tl.float32)
        hi = q_hi * tl.load(_at(P1, U1, S1, u + 2, r, 0), mask=m_hi, other=0.0).to(tl.float32)
        c = 32 * u + e
        clo = tl.reshape(c, (64,))
        chi = clo + 64
    elif FMT == 1:  # Q4_0: blocks 4 step + {0..3}; byte e: value e (low nibble), e + 16 (high); x = d (q - 8)
        u = 4 * step + tl.arange(0, 4)[None, :, None]
        e = tl.arange(0, 16)[None, None, :]
        m = rmask & (u < n_units)
        b = tl.load(_at(P0, U0, S0, u, r, e), mask=m, other=0).to(tl.int32)
        d = tl.load(_at(P1, U1, S1, u, r, 0), mask=m, other=0.0).to(tl.float32)
        lo = d * ((b & 15) - 8).to(tl.float32)
        hi = d * ((b >> 4) - 8).to(tl.float32)
        clo = tl.reshape(32 * u + e, (64,))
        chi = clo + 16
    elif FMT == 2:  # Q4_K: chunks 2 step + {0, 1}; byte e: value 64u + e (sub-block 2u), 64u + 32 + e (2u + 1)
        u = 2 * step + tl.arange(0, 2)[None, :, None]
        e = tl.arange(0, 32)[None, None, :]
        m = rmask & (u < n_units)
        b = tl.load(_at(P0, U0, S0, u, r, e), mask=m, other=0).to(tl.int32)
        d = tl.load(_at(P1, U1, S1, u // 4, r, 0), mask=m, other=0.0).to(tl.float32)
        dmin = tl.load(_at(P2, U2, S2, u // 4, r, 0), mask=m, other=0.0).to(tl.float32)
        sc_lo = tl.load(_at(P3, U3, S3, 2 * u, r, 0), mask=m, other=0).to(tl.float32)
        sc_hi = tl.load(_at(P3, U3, S3, 2 * u + 1, r, 0), mask=m, other=0).to(tl.float32)
        mn_lo = tl.load(_at(P4, U4, S4, 2 * u, r, 0), mask=m, other=0).to(tl.float32)
        mn_hi = tl.load(_at(P4, U4, S4, 2 * u + 1, r, 0), mask=m, other=0).to(tl.float32)
        lo = (d * sc_lo) * (b & 15).to(tl.float32) - dmin * mn_lo
        hi = (d * sc_hi) * (b >> 4).to(tl.float32) - dmin * mn_hi
        clo = tl.reshape(64 * u + e, (64,))
        chi = clo + 32
    else:  # Q6_K half u = step: ql byte 32a + l: values 32a + l (low nibble), 64 + 32a + l (high); qh byte l:
        # 2 bits of each of values l + 32t; group scales per 16 values; x = d sc (q - 32)
        u = step
        a = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 32)[None, None, :]  # noqa: E741
        m = rmask  # K is whole 256-value super-blocks: every step's half exists
        ql = tl.load(_at(P0, U0, S0, u, r, 32 * a + l), mask=m, other=0).to(tl.int32)
        qh = tl.load(_at(P2, U2, S2, u, r, l), mask=m, other=0).to(tl.int32)
        q_lo = (ql & 15) | (((qh >> (2 * a)) & 3) << 4)
        q_hi = (ql >> 4) | (((qh >> (2 * a + 4)) & 3) << 4)
        d = tl.load(_at(P1, U1, S1, u // 2, r, 0), mask=m, other=0.0).to(tl.float32)
        g = 8 * u + 2 * a + l // 16
        sc_lo = tl.load(_at(P3, U3, S3, g, r, 0), mask=m, other=0).to(tl.float32)
        sc_hi = tl.load(_at(P3, U3, S3, g + 4, r, 0), mask=m, other=0).to(tl.float32)
        lo = (d * sc_lo) * (q_lo - 32).to(tl.float32)
        hi = (d * sc_hi) * (q_hi - 32).to(tl.float32)
        clo = tl.reshape(128 * u + 32 * a + l, (64,))
        chi = clo + 64
    return tl.reshape(lo, (lo.shape[0], 64)), tl.reshape(hi, (hi.shape[0], 64)), clo, chi


@triton.jit
def _qgemm_kernel(x_ptr, out_ptr, bias_ptr, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4,
                  M, N, K, n_units, steps, x_stride, out_stride,
                  FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out (M, N) = x (M, K) @ W.T (+ bias); grid: one program per (BM, BN) tile, GROUP row tiles per sweep
    of the columns (the x tiles stay in L2 while the weights stream)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_m - first, GROUP)
    pid_m = first + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    rm = pid_m * BM + tl.arange(0, BM)
    mmask = rm < M
    rn = pid_n * BN + tl.arange(0, BN)
    r = rn[:, None, None]
    rmask = r < N
    xrow = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    ty = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), tl.float32)
    for step in range(steps):
        lo, hi, clo, chi = _tile(FMT, P0, P1, P2, P3, P4, U0, U1, U2, U3, U4, S0, S1, S2, S3, S4, r, rmask, step,
                                 n_units)
        x_lo = tl.load(xrow + clo[None, :], mask=mmask[:, None] & (clo < K)[None, :], other=0.0)
        x_hi = tl.load(xrow + chi[None, :], mask=mmask[:, None] & (chi < K)[None, :], other=0.0)
        acc = tl.dot(x_lo, tl.trans(lo.to(ty)), acc)
        acc = tl.dot(x_hi, tl.trans(hi.to(ty)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & (rn < N)[None, :])


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


def qgemm(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, bm: int = 128, bn: int = 128,
          group: int = 8, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """x (M, K) contiguous rows, w a block-major QWeight (N, K) -> (M, N) in x's dtype."""
    fmt = FMT[w.qtype.name]
    m, k = x.shape
    n = w.shape[0]
    assert k == w.shape[1] and x.stride(1) == 1
    ptrs, units, rows = field_args(w)
    if INTERPRET:  # the interpreter's time grows with the number of programs, not their size
        bm, bn = 16, 32
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _qgemm_kernel[grid](x, out, bias if bias is not None else out, *ptrs, *units, *rows, m, n, k, k // UNIT[fmt],
                        triton.cdiv(k, STEP), x.stride(0), out.stride(0), FMT=fmt, BM=bm, BN=bn, GROUP=group,
                        HAS_BIAS=bias is not None, num_warps=num_warps, num_stages=num_stages)
    return out
