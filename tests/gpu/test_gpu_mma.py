"""The tensor-core products (kernels/triton_mma.py) on the GPU: real int8 MMA and the compiler's FMA
contraction. For each type, llama-3.1-8b-like shapes and 16 / 64 x rows: the decode step's use
(+= into an int64 fixed-point accumulator, K split as auto_split splits it) and the head's (fp32
logits, bf16 rounding) are bit for bit the dp4a kernel's (gemv_q8 with mma=False: what a slot decoded
alone runs), each row is the bits of that row's one-row product, and the result is within fp32
summation order of the fp64 product of the dequantized weights with the int8 activations' values.
(Slots decoded in a bucket of 16 against each decoded alone, through the whole model:
tests/gpu/test_gpu_slot_graphs.py.)"""

from __future__ import annotations

import functools

import gguf
import pytest
import torch

Q = gguf.GGMLQuantizationType
SHAPES = [(1024, 4096), (4096, 14336), (6144, 4096)]  # (N, K): k / v, down, q|k|v


# each type's block bytes and the offsets of its fp16 scales in a block (d; Q4_K's d, dmin)
def weight(qtype, n: int, k: int, seed: int):
    """Random GGUF rows (quantizing 8B-sized rows on the CPU takes minutes): synthetic.RandomBlocks' valid
    random blocks -> (raw uint8 (N, row bytes), block-major QWeight on the GPU)."""
    from localllm.kernels.qweight import QWeight
    from localllm.synthetic import RandomBlocks

    raw = RandomBlocks("cpu", torch.Generator().manual_seed(seed)).get(n, k, qtype)
    return raw, QWeight.from_raw(raw.cuda(), qtype).to_blocks()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mma_bits_equal_dp4a(qtype, shape):
    from localllm.kernels import triton_q8, triton_quant_act
    from localllm.kernels.triton_epilogue import from_fixed, to_fixed
    from localllm.quantize import dequantize_torch
    from localllm.quantize.act import dequantize_act

    n, k = shape
    raw, qw = weight(qtype, n, k, 5)
    ref = dequantize_torch(raw, qtype).double().cuda()
    for m in (16, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float32).cuda()
        xa = triton_quant_act.quantize_act(x)
        res = to_fixed(torch.randn(m, n, device="cuda"))
        got, want = res.clone(), res.clone()
        triton_q8.gemv_q8(xa, qw, residual=got, inplace=True, split=None, act_dtype=torch.bfloat16)
        triton_q8.gemv_q8(xa, qw, residual=want, inplace=True, split=None, act_dtype=torch.bfloat16, mma=False)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"m={m}: {(got != want).sum().item()} of {got.numel()} differ"
        for r in (0, m // 2, m - 1):
            alone = res[r:r + 1].clone()
            triton_q8.gemv_q8(tuple(t[r:r + 1] for t in xa), qw, residual=alone, inplace=True, split=None,
                              act_dtype=torch.bfloat16)
            assert torch.equal(alone, got[r:r + 1])
        xv = dequantize_act(xa[0], xa[1]).double()
        y = xv @ ref.T
        err = ((from_fixed(got - res).double() - y).norm() / y.norm()).item()
        assert err < 1e-6
        logits = triton_q8.gemv_q8(xa, qw, act_dtype=torch.bfloat16, out_dtype=torch.float32)
        assert torch.equal(logits, triton_q8.gemv_q8(xa, qw, act_dtype=torch.bfloat16, out_dtype=torch.float32,
                                                     mma=False))


# configs of every kind bench/mma_products.py sweeps: both MMA orientations, K in one program or
# shared (atomics), 4 / 8 warps, stages 1-3, a register cap, row tiles of 16-64
CONFIGS = [(64, 64, 4, 2, 0, 0, 2), (64, 64, 4, 2, 1, 128, 0), (16, 128, 4, 3, 1, 0, 8), (32, 64, 8, 1, 1, 128, 1),
           (64, 32, 4, 3, 0, 0, 99)]


@functools.cache
def down_weight(qtype):
    return weight(qtype, 4096, 14336, 7)[1]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_mma_configs_bits_equal_dp4a(qtype, config):
    """Each config's product of 64 rows (the down shape: K in 16 parts) += into an int64 accumulator
    with a bias is the dp4a kernel's bits."""
    from localllm.kernels import triton_q8, triton_quant_act
    from localllm.kernels.triton_epilogue import to_fixed

    qw = down_weight(qtype)
    n, k = qw.shape
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2), dtype=torch.float32).cuda()
    xa = triton_quant_act.quantize_act(x)
    res, b = to_fixed(torch.randn(64, n, device="cuda")), torch.randn(n, device="cuda")
    got, want = res.clone(), res.clone()
    triton_q8.gemv_q8(xa, qw, bias=b, residual=got, inplace=True, split=None, act_dtype=torch.bfloat16, mma=config)
    triton_q8.gemv_q8(xa, qw, bias=b, residual=want, inplace=True, split=None, act_dtype=torch.bfloat16, mma=False)
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"
