"""The CUDA kernels one by one against their torch references, at Llama 3.1 8B row lengths (was
bench/cuda_check.py's kernels and attention sections):

- dequantize (fp32 and bf16) equal to quantize.dequantize_torch's values;
- the fused dequantize + matvec in fp32 against the fp64 product of those values; in bf16 against
  cuBLAS on the same bf16 values, alone, with the RMSNorm + residual epilogue, and with the GLU
  epilogue (silu(gate) * up of interleaved rows);
- rope_store against model.rope_rotate, decode attention against fp32 SDPA.

Bounds: about 5x the largest error measured on H100 and H200 (docs/PERFORMANCE.md, CUDA correctness).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from .gpu_helpers import rel

SHAPES = [(1024, 4096), (512, 14336)]  # (rows, K): 8B's hidden and FFN row lengths
DEV = "cuda"


def kernel_types():
    from localllm.kernels.qweight import KERNEL_TYPES

    return sorted(KERNEL_TYPES, key=lambda t: t.name)


def random_qweight(n: int, k: int, qtype, seed: int = 0):
    """(raw blocks on the GPU, QWeight) of an (n, k) random matrix quantized to qtype."""
    from localllm.kernels.qweight import QWeight
    from localllm.quantize import quantize_tensor

    g = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.from_numpy(quantize_tensor(torch.randn(n, k, device=DEV, generator=g), qtype)).to(DEV)
    return raw, QWeight.from_raw(raw, qtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantized_matvec_kernels(shape):
    from localllm.kernels import triton_gemv
    from localllm.quantize import dequantize_torch

    n, k = shape
    for qtype in kernel_types():
        raw, qw = random_qweight(n, k, qtype)
        ref = dequantize_torch(raw, qtype)
        assert torch.equal(triton_gemv.dequantize(qw, torch.float32), ref), qtype.name
        assert torch.equal(triton_gemv.dequantize(qw, torch.bfloat16), ref.bfloat16()), qtype.name
        x = torch.randn(1, k, device=DEV)
        assert rel(triton_gemv.gemv(x, qw, act_dtype=torch.float32), x.double() @ ref.double().T) < 1e-6, qtype.name
        xb, res = x.bfloat16(), torch.randn(1, n, device=DEV)
        assert rel(triton_gemv.gemv(xb, qw), F.linear(xb, ref.bfloat16())) < 1.5e-2, qtype.name
        nw = (1 + 0.1 * torch.randn(k, device=DEV)).bfloat16()
        h = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        want = res + F.linear(h, ref.bfloat16())
        assert rel(triton_gemv.gemv(x, qw, residual=res, norm_weight=nw, eps=1e-5), want) < 3e-2, qtype.name
        y = F.linear(xb, ref.bfloat16())  # rows interleaved (gate, up)
        assert rel(triton_gemv.gemv(xb, qw, glu=True), F.silu(y[:, 0::2]) * y[:, 1::2]) < 3e-2, qtype.name


def test_dense_bf16_matvec():
    from localllm.kernels import triton_gemv

    w = torch.randn(4096, 4096, device=DEV).bfloat16()
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    assert rel(triton_gemv.gemv(x, w), F.linear(x, w)) < 1.5e-2


@pytest.mark.parametrize("head_dim", [128, 64])
def test_rope_store_and_decode_attention(head_dim):
    """32 query heads over 8 kv heads at position 639 of a 1024-row bf16 cache."""
    from localllm.kernels import triton_attention
    from localllm.model import rope_rotate

    H, HKV, D, S, pos = 32, 8, head_dim, 1024, 639
    qkv = torch.randn(1, (H + 2 * HKV) * D, device=DEV).bfloat16()
    kc = torch.randn(HKV, S, D, device=DEV).bfloat16()
    vc = torch.randn(HKV, S, D, device=DEV).bfloat16()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    q = triton_attention.rope_store(qkv, kc, vc, p, inv, H, HKV, D)
    ang = pos * inv
    qr, kr, _ = qkv.view(H + 2 * HKV, D).split([H, HKV, HKV])
    assert rel(q, rope_rotate(qr[None, :, None], ang.cos(), ang.sin())[0, :, 0]) < 1e-6
    assert rel(kc[:, pos], rope_rotate(kr[None, :, None], ang.cos(), ang.sin())[0, :, 0]) < 1e-6
    att = triton_attention.decode_attention(q, kc, vc, p, HKV)
    ref = F.scaled_dot_product_attention(q[None, :, None].float(), kc[None, :, :pos + 1].float(),
                                         vc[None, :, :pos + 1].float(), enable_gqa=True).reshape(1, -1)
    assert rel(att, ref) < 1.5e-2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_integer_dot_products(shape):
    """The integer-dot products (kernels/triton_q8.py, dp4a) on x quantized to int8 by quantize_act:
    against the fp64 product of the same int8 x and the reference weights (measured 2e-7: the integer
    sums are exact), and against W @ x (measured 5.6e-3: Q8_0's rounding of x)."""
    from localllm.kernels import triton_q8, triton_quant_act, triton_units
    from localllm.kernels.qweight import QWeight
    from localllm.quantize import dequantize_torch, quantize_tensor
    from localllm.quantize.act import dequantize_act

    n, k = shape
    for qtype in sorted(triton_units.FMT, key=lambda t: t.name):
        g = torch.Generator(device=DEV).manual_seed(0)
        raw = torch.from_numpy(quantize_tensor(torch.randn(n, k, device=DEV, generator=g), qtype)).to(DEV)
        w, ref = QWeight.from_raw(raw, qtype).to_blocks(), dequantize_torch(raw, qtype).double()
        x = torch.randn(2, k, device=DEV) * 3
        q, d, s = triton_quant_act.quantize_act(x)
        xq = dequantize_act(q, d)
        assert rel(xq, x) < 1e-2, qtype.name  # Q8_0 of x: under half a step of 1/127 of a block's max
        y = triton_q8.gemv_q8((q, d, s), w, act_dtype=torch.float32)
        assert rel(y, xq.double() @ ref.T) < 1e-6, qtype.name
        assert rel(y, x.double() @ ref.T) < 3e-2, qtype.name
