"""bench/persistent_probe.py under Triton's interpreter: its stream-K product (a run of (row tile, unit
step) steps per program, partial sums flushed by atomics into int64 fixed point) against
dequantize_torch(W) @ dequantize_act(x), for every type of its presets, with program boundaries inside
row tiles; and its persistent step (one program: the interpreter runs programs one at a time, so the
grid barrier can only be met with one) adds exactly the sums of the products launched one by one,
whatever its barriers and preloads (a probe that skipped or repeated work would differ)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_epilogue", "triton_table16", "triton_units"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import persistent_probe as probe  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402

Q = gguf.GGMLQuantizationType
SHAPE = (1, 256, 256, 64, 512, 128)  # layers, dim, q rows, k rows, ffn, vocab: every tile divides


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_stream_k_product_matches_reference(qtype):
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 128, 512
    w = torch.randn(n, k, generator=g)
    raw = torch.from_numpy(quantize_tensor(w, qtype))
    qw = QWeight.from_raw(raw, qtype).to_blocks()
    x = torch.randn(1, k, generator=g) * 2
    q, d, s = quantize_act(x)
    ref = dequantize_torch(raw, qtype).reshape(n, k).double() @ dequantize_act(q, d)[0].double()
    for grid in (1, 5):  # 5 programs: runs that start and end inside row tiles
        got = probe.product(qw, q[0].contiguous().view(torch.int32), d[0].contiguous(), s[0].contiguous(), grid)
        err = ((from_fixed(got).double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (grid, err)


@pytest.mark.parametrize("preset,light", [("Q4_0", True), ("Q4_K_M", False)])
def test_persistent_step_sums_every_product_once(preset, light):
    p = probe.Probe(SHAPE, preset, torch.device("cpu"), per_sm=1, light=light)
    p.one_by_one()
    want = p.out.clone()
    assert want.abs().sum() > 0
    for kw in ({"extra": 1, "preload": True}, {"extra": 0, "preload": False}, {"barriers": False}):
        p.out.zero_()
        p.step(**kw)
        assert torch.equal(p.out, want), kw
    assert p.done == 2 * SHAPE[0] * 4 + SHAPE[0]  # barriers in two launches of 4 + 1 and 4 a layer
    assert p.bar[0].item() == p.done and p.bar[32].item() == (0 if light else p.done)  # each met once
