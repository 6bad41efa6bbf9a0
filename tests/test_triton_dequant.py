"""The block-major decoder (kernels/triton_dequant.py) under Triton's interpreter, against its reference
dequantize_torch (the gguf-exact values): fp32 bit for bit, bf16 within one step, for every block-major
type, a K that is not a multiple of the 128-value step, row views of a fused weight; and the prompt
products' use of it. On the GPU, tests/gpu/test_gpu_dequant.py."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_dequant"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_dequant  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS]


def weight(qtype, n: int, k: int, seed: int = 3) -> tuple[torch.Tensor, QWeight]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[1, : k // 2] *= 40  # scales far apart inside one row
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    return dequantize_torch(raw, qtype), QWeight.from_raw(raw, qtype).to_blocks()


def test_covers_only_block_major_kernel_types():
    _, w = weight(Q.Q4_K, 8, 256)
    assert triton_dequant.covers(w) and not triton_dequant.covers(w.to_rows())
    raw = torch.from_numpy(quantize_tensor(torch.randn(8, 256), Q.Q5_K))
    assert not triton_dequant.covers(QWeight.from_raw(raw, Q.Q5_K).to_blocks())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_the_reference_bit_for_bit(qtype):
    k = 512 if qtype in (Q.Q4_K, Q.Q6_K, Q.IQ4_XS) else 480  # 480: the last step holds 3.75 of 4 blocks
    ref, w = weight(qtype, 40, k, seed=8)
    assert torch.equal(triton_dequant.dequantize(w, torch.float32), ref)
    # bf16: within one step (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest;
    # tests/gpu/test_gpu_dequant.py checks equality there)
    got = triton_dequant.dequantize(w.rows(1, 40, 3), torch.bfloat16).float()
    assert ((got - ref[1:40:3]).abs() <= ref[1:40:3].abs() * 2**-7).all()
    # a slab of rows into a given buffer (bench/prefill_overlap.py's reused scratch)
    out = torch.full((40 * k,), float("nan"))
    assert triton_dequant.dequantize(w.rows(8, 24), torch.float32, out=out[:16 * k].view(16, k)).data_ptr() == out.data_ptr()
    assert torch.equal(out[:16 * k].view(16, k), ref[8:24]) and out[16 * k:].isnan().all()


def test_prompt_products_take_the_block_major_decoder(monkeypatch):
    """kernels.linear decodes a block-major weight with it, in place: no row-major copy (to_rows)."""
    from localllm.kernels import linear

    ref, w = weight(Q.Q6_K, 24, 256, seed=9)
    monkeypatch.setattr(QWeight, "to_rows", lambda self: pytest.fail("row-major copy made"))
    assert torch.equal(linear.dequantize_qweight(w, torch.float32), ref)
