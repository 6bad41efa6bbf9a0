"""The integer-dot kernels (kernels/triton_q8.py) under Triton's interpreter, against their references:
quantize.act.quantize_act (bit for bit) for the activation quantizer, which itself must be gguf's Q8_0;
dequantize_torch(W) @ dequantize_act(q, d) (within fp32 summation order) for the products, with the
epilogues of triton_gemv (bias, residual, GLU, split K). On the GPU the dp4a instruction replaces the
interpreter's shift emulation; tests/gpu/test_gpu_kernels.py checks the products there.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# re-decorate if imported uninterpreted (the base first: the others read its INTERPRET)
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_mma",
              "triton_table16", "triton_units", "triton_quant_act", "triton_q8"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from localllm.kernels import triton_q8, triton_quant_act, triton_table16  # noqa: E402
from localllm.kernels.qweight import INT_DOT_TYPES, QWeight  # noqa: E402
from localllm.kernels.linear import dequantize_qweight  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402
from ptx_model import run_ptx  # noqa: E402

Q = gguf.GGMLQuantizationType


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_act_reference_is_ggufs_q8_0():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 5
    x[0, :32] = 0.0  # an all-zero block: d = 0
    q, d, s = quantize_act(x)
    raw = gguf.quants.quantize(x.numpy(), Q.Q8_0).reshape(-1, 34)
    assert np.array_equal(raw[:, 2:].view(np.int8).reshape(3, 256), q.numpy())
    assert np.array_equal(raw[:, :2].view(np.float16).reshape(3, -1), d.half().numpy())
    assert torch.equal(s, q.reshape(3, -1, 16).sum(-1).int())


@pytest.mark.parametrize("norm", [False, True])
def test_quantize_act_kernel_matches_reference(norm):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4096, generator=g) * 3
    x[1, 64:96] = 0.0
    nw = 1 + 0.1 * torch.randn(4096, generator=g) if norm else None
    q, d, s = triton_quant_act.quantize_act(x, nw, 1e-5)
    if norm:  # the kernel's rstd sums in another order: compare on the values it normalised with
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
    qr, dr, sr = quantize_act(x)
    if norm:  # one rounding step apart at most, and rarely
        assert (q.int() - qr.int()).abs().max() <= 1 and (q != qr).float().mean() < 1e-3
        assert rel(d, dr) < 1e-6
    else:
        assert torch.equal(q, qr) and torch.equal(d, dr) and torch.equal(s, sr)


@triton.jit
def _e2m1_words_kernel(inp, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, triton_table16.e2m1_bytes(tl.load(inp + i)))


def test_mxfp4_code_bytes_are_the_e2m1_table():
    """Every word of four MXFP4 codes (16^4) -> its four int8 values, gguf's MXFP4.kvalues (code 8: 0)."""
    codes = torch.cartesian_prod(*[torch.arange(16)] * 4).to(torch.uint8).contiguous()  # (65536, 4)
    out = torch.empty(codes.shape[0], dtype=torch.int32)
    _e2m1_words_kernel[(1,)](codes.view(torch.int32).reshape(-1), out, N=codes.shape[0])
    want = torch.tensor(gguf.quants.MXFP4.kvalues, dtype=torch.int8)[codes.long()]
    assert torch.equal(out.view(torch.int8).reshape(-1, 4), want)


@triton.jit
def _iq4_values_kernel(inp, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, triton_table16._table16_values(tl.load(inp + i), triton_table16.IQ4_T0, triton_table16.IQ4_T1,
                                                     triton_table16.IQ4_T2, triton_table16.IQ4_T3))


def test_iq4_code_values_are_the_kvalues_table():
    """The interpreter's lookup (_table16_values, under table16_dot) of every IQ4_NL / IQ4_XS code:
    gguf's IQ4_NL.kvalues."""
    out = torch.empty(16, dtype=torch.int32)
    _iq4_values_kernel[(1,)](torch.arange(16, dtype=torch.int32), out, N=16)
    assert out.tolist() == list(gguf.quants.IQ4_NL.kvalues)


@pytest.mark.parametrize("ptx,table", [("E2M1_PTX", gguf.quants.MXFP4.kvalues),
                                       ("IQ4_PTX", gguf.quants.IQ4_NL.kvalues)], ids=["MXFP4", "IQ4"])
def test_table_lookup_ptx_gives_the_gguf_table(ptx, table):
    """The byte-permute lookups the GPU runs (table16_lookup's PTX, which the interpreter cannot run),
    executed by a model of their instructions: a word of 8 codes -> the int8 values of its low nibbles,
    of its high nibbles, gguf's table's (every code at every position, and random words)."""
    words = [sum(c << (4 * i) for i in range(8)) for c in range(16)]  # one code everywhere
    words += [sum(((c + i) % 16) << (4 * i) for i in range(8)) for c in range(16)]  # every code at every nibble
    words += torch.randint(0, 1 << 32, (500,), generator=torch.Generator().manual_seed(3)).tolist()
    for w in words:
        regs = run_ptx(getattr(triton_table16, ptx).value, {"$2": w})
        lo, hi = regs["$0"], regs["$1"]
        want = [table[(w >> (4 * i)) & 15] for i in range(8)]
        got = list(np.array([lo, hi], dtype=np.uint32).view(np.int8))
        assert got == want[0::2] + want[1::2], hex(w)


@functools.cache
def make_weight(qtype: Q) -> tuple[Q, torch.Tensor, QWeight]:
    """(qtype, reference values (40, 512), QWeight); 40 rows: a partial row tile."""
    g = torch.Generator().manual_seed(7)
    raw = torch.from_numpy(quantize_tensor(torch.randn(40, 512, generator=g), qtype))
    return qtype, dequantize_torch(raw, qtype), QWeight.from_raw(raw, qtype).to_blocks()


@pytest.fixture(scope="module", params=sorted(INT_DOT_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def weight(request):
    return make_weight(request.param)


def act(rows: int, seed: int) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """x (rows, 512), its quantized form, and the values the products see."""
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed)) * 2
    xa = quantize_act(x)
    return x, xa, dequantize_act(xa[0], xa[1])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("config", [None, (8, 2, 4)], ids=["masked", "even"])
def test_gemv_matches_reference(weight, rows, config):
    qtype, ref, qw = weight
    n = 32 if config else 40  # (8, 2, 4) divides 32 rows and 512 columns: the mask-free path
    x, xa, xv = act(rows, rows)
    got = triton_q8.gemv_q8(xa, qw.rows(0, n), act_dtype=torch.float32, config=config)
    assert got.shape == (rows, n) and rel(got, xv.double() @ ref[:n].double().T) < 1e-6
    assert rel(got, x @ ref[:n].T) < 2e-2  # what int8 activations cost against the float product


def test_epilogues(weight):
    """bias + residual in bf16 rounding; GLU on interleaved rows; K split by atomics, in place."""
    qtype, ref, qw = weight
    g = torch.Generator().manual_seed(4)
    _, xa, xv = act(1, 5)
    y = xv @ ref.T
    b, res = torch.randn(40, generator=g), torch.randn(1, 40, generator=g)
    got = triton_q8.gemv_q8(xa, qw, bias=b, residual=res, act_dtype=torch.bfloat16)
    # bf16 rounding of y + b (the interpreter truncates to bf16): at most one bf16 step from the sum
    step = 2.0 ** (torch.floor(torch.log2((y + b).abs())) - 7)
    assert ((got - res - (y + b)).abs() <= step + 1e-6).all()
    glu = triton_q8.gemv_q8(xa, qw, glu=True, act_dtype=torch.float32)
    assert rel(glu, F.silu(y[:, 0::2]) * y[:, 1::2]) < 1e-5
    acc = res.clone()
    triton_q8.gemv_q8(xa, qw, residual=acc, act_dtype=torch.float32, split=2, inplace=True)
    assert rel(acc, res + y) < 1e-6


def test_fused_linear_takes_the_integer_path(weight):
    """kernels.linear.fused_linear routes these types to gemv_q8 with the norm fused into quantize_act."""
    from localllm.kernels.linear import fused_linear

    qtype, ref, qw = weight
    g = torch.Generator().manual_seed(8)
    x, nw = torch.randn(1, 512, generator=g), 1 + 0.1 * torch.randn(512, generator=g)
    got = fused_linear(x, qw, norm=(nw, 1e-5), act_dtype=torch.float32)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
    q, d, _ = quantize_act(h)
    assert rel(got, dequantize_act(q, d) @ ref.T) < 1e-4


def test_block_major_round_trip_and_views(weight):
    """to_blocks reorders bytes only: back to rows, views, interleaved cat all decode to the reference."""
    qtype, ref, qw = weight
    assert qw.blocks and qw.nbytes == qw.to_rows().nbytes
    assert torch.equal(dequantize_qweight(qw, torch.float32), ref)
    fused = QWeight.cat([qw, qw.rows(0, 40)], interleave=True)
    for i in (0, 1):
        assert torch.equal(dequantize_qweight(fused.rows(i, fused.shape[0], 2), torch.float32), ref)
    x, xa, xv = act(1, 9)
    got = triton_q8.gemv_q8(xa, fused.rows(1, fused.shape[0], 2), act_dtype=torch.float32)
    assert rel(got, xv.double() @ ref.double().T) < 1e-6


def test_quantize_act_glu_reads_and_clears_the_sums():
    """glu_dtype: interleaved (gate, up) fp32 sums -> quantize_act(silu(gate) * up) with the modules'
    roundings (fp16 here: the interpreter truncates to bf16 where the GPU rounds); the sums buffer is
    zero afterwards (ready for the next split-K accumulation)."""
    sums = torch.randn(1, 2 * 256, generator=torch.Generator().manual_seed(3)) * 4
    gate, up = sums[:, 0::2].half(), sums[:, 1::2].half()
    want = quantize_act((F.silu(gate) * up).float())
    got = triton_quant_act.quantize_act(sums, glu_dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not sums.any()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_NL])
def test_partial_unit_steps_read_nothing_past_k(qtype):
    """K = 576 (SmolLM2): 18 blocks, not a multiple of the units per step. x's buffers continue past K
    with NaN scales and random words: a product that read them would be NaN or wrong."""
    g = torch.Generator().manual_seed(12)
    raw = torch.from_numpy(quantize_tensor(torch.randn(40, 576, generator=g), qtype))
    w, ref = QWeight.from_raw(raw, qtype).to_blocks(), dequantize_torch(raw, qtype)
    q, d, s = quantize_act(torch.randn(1, 576, generator=g))
    pad = 4 * 32 * 4
    qp = torch.randint(-128, 128, (1, 576 + pad), generator=g, dtype=torch.int8)
    dp = torch.full((1, (576 + pad) // 32), float("nan"))
    sp = torch.randint(-1000, 1000, (1, (576 + pad) // 16), generator=g, dtype=torch.int32)
    qp[:, :576], dp[:, :18], sp[:, :36] = q, d, s
    got = triton_q8.gemv_q8((qp[:, :576], dp[:, :18], sp[:, :36]), w, act_dtype=torch.float32, config=(64, 4, 4))
    assert rel(got, dequantize_act(q, d).double() @ ref.double().T) < 1e-6


# IQ4's unit decoders take Q4_0's loads and MXFP4's lookup (both on the whole grid): the two hardest
# cases only (interpreter time: CI)
PRELOAD_CASES = [(t, p, s) for t in sorted(INT_DOT_TYPES, key=lambda t: t.name) for p in (0, 1, 2) for s in (1, 8)
                 if t not in (Q.IQ4_NL, Q.IQ4_XS) or p == 2]


@pytest.mark.parametrize("qtype,preload,split", PRELOAD_CASES,
                         ids=[f"{t.name}-{p}-{'split' if s > 1 else 'whole'}" for t, p, s in PRELOAD_CASES])
def test_preloaded_steps_give_the_same_sums(qtype, preload, split, monkeypatch):
    """Weights loaded before the PDL wait (PRELOAD steps) sum exactly as loaded in the loop, also on
    the unmasked path whose parts have fewer steps than PRELOAD (split 8: one step each). One x row:
    programs of several rows preload nothing (gemv_q8)."""
    qtype, ref, qw = make_weight(qtype)
    _, xa, xv = act(1, 9)
    w, config = qw.rows(0, 32), (8, 2, 4)  # even: 32 rows, 512 columns
    monkeypatch.setitem(triton_q8.PRELOAD, qtype, 0)
    want = triton_q8.gemv_q8(xa, w, act_dtype=torch.float32, config=config, split=split)
    monkeypatch.setitem(triton_q8.PRELOAD, qtype, preload)
    got = triton_q8.gemv_q8(xa, w, act_dtype=torch.float32, config=config, split=split)
    assert torch.equal(got, want) and rel(got, xv.double() @ ref[:32].double().T) < 1e-6
