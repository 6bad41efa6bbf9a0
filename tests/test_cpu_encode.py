"""The C++ encoders of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (kernels/cpu_encode.cpp) against the oracle,
gguf.quants.quantize (llama.cpp's reference rules), and our torch encoders: the same bytes, on random
rows and on rows made to hit the rules' edges (ties, halves, zeros of either sign, tiny and huge
values)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm.kernels.cpu import load_extension
from localllm.quantize import quantize_tensor
from localllm.quantize.blocks import SIMPLE_CPP
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
TYPES = sorted(SIMPLE_CPP)


@pytest.fixture(scope="module")
def ext():
    module = load_extension(DEFAULT_CPU.cache_dir)
    assert module is not None, "the CPU kernels did not build"
    return module


def adversarial_rows() -> torch.Tensor:
    """(rows, 64) fp32: each row two blocks of an edge case."""
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.zeros(64),
        torch.tensor([0.0, -0.0] * 32),
        torch.tensor([-0.0, 0.0] * 32),
        torch.full((64,), -0.0),
        torch.full((64,), 3.25),  # constant: max == min
        torch.full((64,), -7.0),
        torch.cat([torch.tensor([-3.0, 3.0]), torch.randn(30, generator=g), torch.tensor([3.0, -3.0]),
                   torch.randn(30, generator=g)]),  # |max| ties of opposite sign: the first wins
        torch.arange(64, dtype=torch.float32) - 32,  # integers: halves of the steps
        (torch.arange(64, dtype=torch.float32) - 31.5) / 4,
        torch.arange(64, dtype=torch.float32) * 127 / 63 - 63.5,
        torch.randn(64, generator=g) * 1e-30,  # fp16 scale 0, 1 / d finite
        torch.randn(64, generator=g) * 1e-8,  # fp16 scale underflows
        torch.randn(64, generator=g) * 1e6,  # fp16 scale overflows to inf
        torch.cat([torch.full((31,), 1e-3), torch.tensor([100.0]), torch.full((32,), -1e-3)]),
        torch.tensor([1.0, 2.0, 3.0, 4.0] * 16) * 8 / 7,
    ]
    # values at exact half steps of the row's own scale: x = (k + 0.5) * max / 127 etc.
    steps = torch.arange(64, dtype=torch.float32) % 32
    for nmax in (127.0, 8.0, 15.0, 16.0, 31.0):
        rows.append((steps - 16 + 0.5) * (1.7 / nmax))
    return torch.stack(rows)


# Rows whose zeros of both signs make numpy's min (gguf) differ from ggml's loop (the first smallest
# value: +0 then -0 keeps +0): Q4_1 / Q5_1's m field checked against that rule instead.
SIGNED_ZEROS = {1: b"\x00\x00", 2: b"\x00\x80"}  # row -> m of either block (fp16 +0 / -0)


def oracle(x: torch.Tensor, qtype: Q) -> np.ndarray:
    return gguf.quants.quantize(x.numpy(), qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_cpp_encoder_equals_gguf_and_torch(ext, qtype):
    g = torch.Generator().manual_seed(int(qtype))
    random = torch.randn(37, 96, generator=g) * torch.logspace(-3, 2, 37).unsqueeze(1)
    shifted = torch.rand(11, 160, generator=g) * 5 + 2  # all positive: Q4_1's min above 0
    edges = adversarial_rows()
    for x in (random, shifted, edges):
        got = quantize_tensor(x, qtype, ext=ext)
        np.testing.assert_array_equal(got, quantize_tensor(x, qtype))  # the torch encoder
        want = oracle(x, qtype)
        assert got.dtype == np.uint8 and got.shape == want.shape
        if x is edges and qtype in (Q.Q4_1, Q.Q5_1):
            nbytes = got.shape[1] // 2
            for row, m in SIGNED_ZEROS.items():
                assert got[row, 2:4].tobytes() == got[row, nbytes + 2:nbytes + 4].tobytes() == m
                want[row] = got[row]
        np.testing.assert_array_equal(got, want)
    # subnormal scales: 1 / d overflows (the C reference is undefined there); C++ and torch agree
    tiny = torch.randn(3, 64, generator=g) * 1e-38
    np.testing.assert_array_equal(quantize_tensor(tiny, qtype, ext=ext), quantize_tensor(tiny, qtype))


def test_cpp_encoder_threads_and_large_rows(ext):
    """Rows split over threads give the same bytes as one thread; a long row as the oracle's."""
    x = torch.randn(67, 4096, generator=torch.Generator().manual_seed(7))
    for qtype in (Q.Q8_0, Q.Q5_1):
        one = ext.encode_simple(x, int(qtype), torch.empty(0), 1).numpy()
        np.testing.assert_array_equal(ext.encode_simple(x, int(qtype), torch.empty(0), 3).numpy(), one)
        np.testing.assert_array_equal(one, oracle(x, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_cpp_weighted_encoder_equals_torch(ext, qtype):
    """With an imatrix (one vector, or one row per group of rows): the C++ search and pick equal the
    torch reference (quantize/simple_search.py) byte for byte, and the weighted error is never above
    the reference rule's (the pick keeps the better)."""
    g = torch.Generator().manual_seed(100 + int(qtype))
    x = torch.cat([torch.randn(24, 128, generator=g) * torch.logspace(-2, 1, 24).unsqueeze(1),
                   torch.rand(4, 128, generator=g) * 3 + 1, torch.rand(4, 128, generator=g) * -3 - 1,
                   adversarial_rows().repeat(1, 2)])
    imp = torch.rand(128, generator=g) ** 4 * 10  # a wide spread, some near 0
    imp[5] = 0.0
    groups = torch.rand(x.shape[0] // 2, 128, generator=g) + 0.01  # (G, cols): 2 rows a group
    for importance in (imp, groups):
        got = quantize_tensor(x, qtype, importance, ext=ext)
        np.testing.assert_array_equal(got, quantize_tensor(x, qtype, importance))
    plain = quantize_tensor(x, qtype)
    assert (got != plain).any()  # the search changed some blocks
    qw = groups.repeat_interleave(2, dim=0)
    decode = lambda b: torch.from_numpy(gguf.quants.dequantize(b, qtype)).reshape(x.shape)
    err = lambda b: torch.nan_to_num((qw * (decode(b) - x) ** 2).reshape(-1, 32).sum(-1), nan=float("inf"))
    assert (err(got) <= err(plain) * (1 + 1e-5) + 1e-30).all()  # (an fp16 scale overflowing: inf <= inf)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_fp16_input_and_non_finite_values(ext, qtype):
    """An fp16 tensor (a GGUF file's F16 weights, read in place by `localllm quantize`) gives the bytes of
    its exact fp32 widening, also with an imatrix; a NaN or Inf anywhere, fp16 or fp32, is refused."""
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(4, 256, generator=g) * torch.logspace(-2, 1, 4).unsqueeze(1)).half()
    imp = torch.rand(256, generator=g) + 0.1
    for importance in (None, imp):
        want = quantize_tensor(h.float(), qtype, importance)  # the torch encoders: the oracle's bytes
        np.testing.assert_array_equal(quantize_tensor(h, qtype, importance, ext=ext), want)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for x in (h.clone(), h.float()):
            x[2, 200] = bad
            with pytest.raises(ValueError, match=f"non-finite values to {qtype.name}"):
                quantize_tensor(x, qtype, ext=ext)
