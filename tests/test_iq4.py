"""IQ4_NL and IQ4_XS (quantize/iq4.py, quantize/formats/iq_types.py) against llama.cpp's own quantizer.

tests/data/llamacpp/iq4_quantize.npz holds a small tensor (24 x 512: rows of different scales, an
all-zero block, a block of values below GROUP_MAX_EPS, outlier columns), an importance vector, and the
bytes llama.cpp's ggml_quantize_chunk (what llama-quantize calls) made of it for IQ4_NL and IQ4_XS, with
and without the importance (tests/data/llamacpp/README.md says how). Our encoder must give the very same
bytes; the decoders are checked against gguf-py in tests/test_quant_formats.py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.iq4 import KVALUES, best_index

Q = gguf.GGMLQuantizationType
DATA = Path(__file__).parent / "data" / "llamacpp" / "iq4_quantize.npz"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread


@pytest.fixture(scope="module")
def sample() -> dict[str, np.ndarray]:
    with np.load(DATA) as d:
        return dict(d)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
def test_bytes_equal_llama_cpp_quantize(sample, qtype, weighted):
    key = qtype.name.lower() + ("_imatrix" if weighted else "")
    importance = torch.from_numpy(sample["imatrix"]) if weighted else None
    ours = quantize_tensor(torch.from_numpy(sample["w"]), qtype, importance)
    theirs = sample[key]
    assert ours.shape == theirs.shape
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
    differ = np.nonzero((ours.reshape(-1, nbytes) != theirs.reshape(-1, nbytes)).any(1))[0]
    assert differ.size == 0, f"{differ.size} blocks differ, first {differ[:8]}"
    # and their values are gguf's decode of llama.cpp's bytes
    np.testing.assert_array_equal(dequantize_torch(ours, qtype).numpy(), gguf.quants.dequantize(theirs, qtype))


def test_best_index_is_ggml_nearest_with_upper_ties():
    table = np.array(KVALUES, np.float32)
    mids = (table[1:] + table[:-1]) / 2
    x = np.concatenate([table, mids, mids - 1e-3, mids + 1e-3, [-1000, -127.5, 113.5, 1000, 0, -0.0]]).astype(np.float32)
    got = best_index(torch.from_numpy(x)).numpy()
    dist = np.abs(x[:, None] - table[None, :])
    nearest = dist.min(1, keepdims=True)
    upper = (dist == nearest)[:, ::-1].argmax(1)  # the last (upper) nearest entry, as ggml's x - lo < hi - x
    np.testing.assert_array_equal(got, 15 - upper)
