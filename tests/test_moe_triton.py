"""One expert's rows of a stacked quantized expert tensor (localllm/moe.py) through the CUDA backend's
QWeight kernels, under Triton's interpreter: row views starting past row 0 (expert e of E * F rows),
row-major and block-major, against the dense product of those decoded rows (quantize.dequantize_torch).
"""

from __future__ import annotations

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
import pytest  # noqa: E402
import torch  # noqa: E402

from localllm.kernels import triton_gemv, triton_q8  # noqa: E402
from localllm.kernels.linear import linear_rows  # noqa: E402
from localllm.kernels.qweight import INT_DOT_TYPES, KERNEL_TYPES, QWeight  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402

Q = gguf.GGMLQuantizationType
E, F, K = 3, 16, 256  # 3 experts of 16 rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def stacked(qtype) -> tuple:
    """(qtype, raw (E * F, row bytes), decoded rows) of a random stacked expert tensor."""
    raw = torch.from_numpy(quantize_tensor(torch.randn(E * F, K, generator=torch.Generator().manual_seed(5)), qtype))
    return qtype, raw, dequantize_torch(raw, qtype)


# Q5_0, MXFP4: types without a Triton kernel (their QWeight holds raw rows, decoded per product)
@pytest.fixture(scope="module", params=sorted(KERNEL_TYPES | {Q.Q5_0, Q.MXFP4}, key=lambda t: t.name), ids=lambda t: t.name)
def experts(request):
    return stacked(request.param)


@pytest.mark.parametrize("blocks", [False, True], ids=["rows", "block-major"])
def test_linear_rows_of_a_qweight(experts, blocks):
    """kernels.linear.linear_rows on each expert (the CPU runs the dequantize kernel on the view)."""
    qtype, raw, dense = experts
    w = QWeight.from_raw(raw, qtype)
    w = w.to_blocks() if blocks else w
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(6))
    for e in range(E):
        got = linear_rows(x, w, e * F, (e + 1) * F)
        assert got.shape == (2, F) and rel(got, x @ dense[e * F:(e + 1) * F].T) < 1e-6


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_gemv_on_expert_rows(qtype):
    """The decode kernels CUDA runs (rows <= 4): the fused dequantize gemv on row-major views, the
    integer-dot gemv_q8 on block-major views."""
    qtype, raw, dense = stacked(qtype)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(7))
    w = QWeight.from_raw(raw, qtype)
    for e in (1, 2):
        ref = dense[e * F:(e + 1) * F]
        got = triton_gemv.gemv(x, w.rows(e * F, (e + 1) * F), act_dtype=torch.float32)
        assert rel(got, x @ ref.T) < 1e-5
        if qtype in INT_DOT_TYPES:
            xa = quantize_act(x)
            got = triton_q8.gemv_q8(xa, w.to_blocks().rows(e * F, (e + 1) * F), act_dtype=torch.float32)
            assert rel(got, dequantize_act(xa[0], xa[1]).double() @ ref.double().T) < 1e-6
