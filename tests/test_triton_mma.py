"""The tensor-core products (kernels/triton_mma.py) under Triton's interpreter: for each type, against
the fp64 product of gguf's dequantization of the weights with the int8 activations' values (the
oracle), and bit for bit against the dp4a kernel (triton_q8.gemv_q8 with mma=False) over the same
rows, and against each row computed alone (one row: the dp4a kernel): a row's bits do not depend on
the bucket. The epilogues the decode step uses: an int64 fixed-point accumulator split over K, and an
unsplit fp32 / bf16 output with bias and residual. Each kind of config (triton_mma.CONFIGS entries):
both MMA orientations, one program or several along K, masked and whole tiles. tests/gpu/test_gpu_mma.py
repeats the bit checks on the GPU (real tensor cores and FMA contraction).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_mma",
              "triton_table16", "triton_units", "triton_quant_act", "triton_q8"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_bytes, triton_mma, triton_q8  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed, to_fixed  # noqa: E402
from localllm.quantize import quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402
from ptx_model import run_ptx  # noqa: E402

Q = gguf.GGMLQuantizationType
N, K = 40, 512  # 40 rows: a partial weight tile


@functools.cache
def make_weight(qtype: Q) -> tuple[np.ndarray, QWeight]:
    """(gguf's dequantized values (N, K) fp64, the block-major QWeight)."""
    g = torch.Generator().manual_seed(11)
    raw = quantize_tensor(torch.randn(N, K, generator=g), qtype)
    ref = gguf.quants.dequantize(np.asarray(raw), qtype).astype(np.float64).reshape(N, K)
    return ref, QWeight.from_raw(torch.from_numpy(raw), qtype).to_blocks()


@pytest.fixture(scope="module", params=sorted(triton_mma.MMA_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def weight(request):
    return make_weight(request.param)


def act(rows: int, seed: int):
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)) * 2
    x[1, 32:64] = 0.0  # an all-zero block
    xa = quantize_act(x)
    return xa, dequantize_act(xa[0], xa[1]).double().numpy()


def rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (BM, BN, warps, stages, TRANS, registers, programs per SM: one SM under the interpreter, so programs
# along K)
CONFIGS = [(16, 64, 4, 1, 0, 0, 0),  # one program takes all of K (its parts added as integers), stores
           (32, 32, 4, 1, 1, 128, 2),  # weight rows on the MMA's M axis, two programs along K (atomics)
           (16, 32, 4, 1, 1, 0, 99)]  # one dp4a part a program (atomics), two weight tiles (one partial)


def test_threshold_is_one_constant():
    assert triton_mma.MMA_ROWS == 16


def test_k_groups_and_buckets():
    cpu = torch.device("cpu")
    assert triton_mma.k_groups(16, 96, 0, cpu) == (1, 16)  # all of K in one program
    assert triton_mma.k_groups(3, 1, 2, cpu) == (2, 2)  # parts 0, 1 and 2: uneven
    assert triton_mma.k_groups(4, 1, 99, cpu) == (4, 1)  # at most one program a part
    table = {16: "a", 64: "b"}
    triton_mma.CONFIGS[Q.Q8_0], old = table, triton_mma.CONFIGS[Q.Q8_0]
    try:
        assert [triton_mma.config_for(Q.Q8_0, m) for m in (16, 32, 63, 64, 128)] == ["a", "a", "a", "b", "b"]
    finally:
        triton_mma.CONFIGS[Q.Q8_0] = old


def test_accumulator_split_k_matches_oracle_and_dp4a_bits(weight):
    """The decode step's use: += into an int64 fixed-point accumulator, K split in 2 (atomics); 20 rows
    (a partial row tile)."""
    ref, qw = weight
    rows = 20
    xa, xv = act(rows, rows)
    g = torch.Generator().manual_seed(3)
    res, b = to_fixed(torch.randn(rows, N, generator=g)), torch.randn(N, generator=g)  # (Qwen's q|k|v bias)
    got, want = res.clone(), res.clone()
    triton_q8.gemv_q8(xa, qw, bias=b, residual=got, inplace=True, split=2, act_dtype=torch.float32)
    triton_q8.gemv_q8(xa, qw, bias=b, residual=want, inplace=True, split=2, act_dtype=torch.float32, mma=False)
    assert torch.equal(got, want)
    assert rel(from_fixed(got - res).numpy(), xv @ ref.T + b.double().numpy()) < 1e-6
    for r in (0, rows - 1):  # each row alone (the dp4a kernel of one row): the same bits
        alone = res[r:r + 1].clone()
        triton_q8.gemv_q8(tuple(t[r:r + 1] for t in xa), qw, bias=b, residual=alone, inplace=True, split=2,
                          act_dtype=torch.float32)
        assert torch.equal(alone, got[r:r + 1])


@functools.cache
def accumulated(qtype: Q, rows: int, n: int, split: int, mma) -> torch.Tensor:
    """rows x rows += W[:n] x with bias into an int64 accumulator, K split by the dp4a launch at the
    GPU's units a step (triton_q8.CONFIGS on CUDA: 1 for Q6_K, else 2); mma as gemv_q8's."""
    xa, _ = act(rows, 9)
    g = torch.Generator().manual_seed(5)
    out, b = to_fixed(torch.randn(rows, n, generator=g)), torch.randn(n, generator=g)
    bk = 1 if qtype == Q.Q6_K else 2
    triton_q8.gemv_q8(xa, make_weight(qtype)[1].rows(0, n), bias=b, residual=out, inplace=True, split=split,
                      act_dtype=torch.float32, config=(64, bk, 4), mma=mma)
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_configs_split_in_three_match_dp4a_bits(weight, config):
    """Every way a config cuts K (the dp4a launch's 3 parts: one program, or 2, or 3 along K) and both
    MMA orientations give the dp4a kernel's bits; 20 rows and 40 weight rows: partial tiles (masked)."""
    qtype = weight[1].qtype
    assert torch.equal(accumulated(qtype, 20, N, 3, config), accumulated(qtype, 20, N, 3, False))


@pytest.mark.parametrize("config", [(32, 32, 4, 1, 1, 0, 0), (16, 32, 4, 1, 0, 0, 2)], ids=lambda c: "x".join(map(str, c)))
def test_whole_tiles_unmasked_match_dp4a_bits(weight, config):
    """Tiles that cover the product exactly (EVEN: no masks): 32 rows, a 32-row view of the weight
    (its unit stride still the 40-row tensor's), K in 2 parts."""
    qtype = weight[1].qtype
    assert torch.equal(accumulated(qtype, 32, 32, 2, config), accumulated(qtype, 32, 32, 2, False))


@pytest.mark.parametrize("config", [None, (16, 32, 4, 1, 1, 0, 0)], ids=["default", "trans"])
def test_output_with_bias_and_residual(weight, config):
    """An unsplit fp32 output (the head's logits) with bias and residual, the sum rounded to bf16 first
    (triton_epilogue.epilogue's order)."""
    ref, qw = weight
    xa, xv = act(16, 5)
    g = torch.Generator().manual_seed(4)
    b, res = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
    kw = dict(bias=b, residual=res, act_dtype=torch.bfloat16, out_dtype=torch.float32)
    got = triton_q8.gemv_q8(xa, qw, mma=config or True, **kw)
    assert got.dtype == torch.float32 and torch.equal(got, triton_q8.gemv_q8(xa, qw, mma=False, **kw))
    assert rel((got - res).numpy(), xv @ ref.T + b.double().numpy()) < 1e-2  # bf16 rounding


def test_rows_are_independent(weight):
    """Rows 0..15 of a 32-row product equal the same rows in a 16-row one with other rows around."""
    ref, qw = weight
    xa, _ = act(32, 7)
    full = triton_q8.gemv_q8(xa, qw, act_dtype=torch.float32)
    other, _ = act(16, 8)
    mixed = tuple(torch.cat([a[:8], o[:8]]) for a, o in zip(xa, other))
    part = triton_q8.gemv_q8(mixed, qw, act_dtype=torch.float32)
    assert torch.equal(part[:8], full[:8])


def test_packed_byte_ptx_equals_the_elementwise_widening():
    """The GPU's byte widening (inline PTX on 4 bytes a register, which the interpreter cannot run),
    run by tests/ptx_model.py on random words, gives the interpreter's elementwise values: Q4_K's
    nibbles, Q4_0's selected nibbles minus 8, Q6_K's 6-bit values minus 32 and their group mask."""
    words = torch.randint(0, 1 << 32, (3, 400), generator=torch.Generator().manual_seed(12)).tolist()

    def run(ptx, *args) -> list[int]:
        return list(run_ptx(ptx.value, {f"${i + 1}": a for i, a in enumerate(args)})["$0"].to_bytes(4, "little"))

    for w, h, k in zip(*words):
        b, c = list(w.to_bytes(4, "little")), list(h.to_bytes(4, "little"))
        keep = [0xFF if (k >> (8 * i)) & 1 else 0 for i in range(4)]
        keep_word = int.from_bytes(bytes(keep), "little")
        assert run(triton_bytes.NIB_LO, w) == [v & 15 for v in b]
        assert run(triton_bytes.NIB_HI, w) == [v >> 4 for v in b]
        assert run(triton_bytes.Q4_0_PTX, w, keep_word) == [((v >> 4 if s else v & 15) - 8) & 255 for v, s in zip(b, keep)]
        for t, ptx in enumerate((triton_bytes.Q6_T0, triton_bytes.Q6_T1, triton_bytes.Q6_T2, triton_bytes.Q6_T3)):
            q = run(ptx, w, h)
            assert q == [((((v >> (4 * (t // 2))) & 15) | (((x >> (2 * t)) & 3) << 4)) - 32) & 255 for v, x in zip(b, c)]
            assert run(triton_bytes.AND, int.from_bytes(bytes(q), "little"), keep_word) == [v & s for v, s in zip(q, keep)]
