"""K-quant encoders: the C++ one (kernels/cpu_kencode.cpp) against the torch reference (quantize/kquants.py,
quantize/ksearch.py), and the reference's llama.cpp candidates against llama.cpp's own bytes.

Oracles: tests/data/llamacpp/kquant_quantize.npz holds a 16 x 512 tensor (rows of different scales,
outlier columns, all-positive, all-negative and heavy-tailed rows), an importance vector, and the bytes
llama.cpp's ggml_quantize_chunk (what llama-quantize calls per tensor) made of it for Q2_K..Q6_K with and
without the importance (make_kquant_quantize.py, tests/data/llamacpp/README.md). Our encoders keep, per
block, the best of several candidates, one of which is llama.cpp's own: that candidate must be exactly
llama.cpp's bytes. The C++ encoder must give the reference's bytes bit for bit, on random and
adversarial rows, with and without an importance (one for all rows, or one per row).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from localllm.kernels.cpu import load_extension
from localllm.quantize import dequantize_torch, kquants, quantize_tensor
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
DATA = Path(__file__).parent / "data" / "llamacpp" / "kquant_quantize.npz"
K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# candidate lists of the reference, and the index of llama.cpp's own quantizer in them: without an
# importance quantize_row_*_ref, with one quantize_row_*_impl on its imatrix weights
CANDIDATES = {
    Q.Q2_K: (kquants.q2_k_candidates, 0, 1),
    Q.Q3_K: (kquants.q3_k_candidates, 0, 1),
    Q.Q4_K: (kquants.q4_k_candidates, 0, 2),
    Q.Q5_K: (kquants.q5_k_candidates, 0, 2),
    Q.Q6_K: (kquants.q6_k_candidates, 0, 1),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: small passes run faster on one thread


@pytest.fixture(scope="module")
def sample() -> dict[str, np.ndarray]:
    with np.load(DATA) as d:
        return dict(d)


@pytest.fixture(scope="module")
def ext():
    built = load_extension(DEFAULT_CPU.cache_dir)
    if built is None:
        pytest.skip("the CPU kernels did not build here")
    return built


@pytest.fixture(scope="module")
def reference(sample):
    """(qtype, weighted) -> (x (B, 256), qw (B, 256) or None, the reference's candidates), computed once."""
    x = torch.from_numpy(sample["w"]).reshape(-1, 256)
    qw = torch.from_numpy(sample["imatrix"]).expand(sample["w"].shape).reshape(-1, 256)
    cache = {}

    def get(qtype, weighted):
        if (qtype, weighted) not in cache:
            w = qw if weighted else None
            cache[qtype, weighted] = (x, w, CANDIDATES[qtype][0](x, w))
        return cache[qtype, weighted]
    return get


def blocks_differ(a: np.ndarray, b: np.ndarray, nbytes: int) -> np.ndarray:
    return np.nonzero((a.reshape(-1, nbytes) != b.reshape(-1, nbytes)).any(1))[0]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_llama_cpp_candidate_is_llama_cpp_bytes(sample, reference, qtype, weighted):
    _, plain, with_imatrix = CANDIDATES[qtype]
    ours = reference(qtype, weighted)[2][with_imatrix if weighted else plain][1].numpy()
    theirs = sample[qtype.name.lower() + ("_imatrix" if weighted else "")]
    differ = blocks_differ(ours, theirs, gguf.GGML_QUANT_SIZES[qtype][1])
    assert differ.size == 0, f"{differ.size} blocks differ, first {differ[:8]}"


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_cpp_equals_reference_on_llama_cpp_sample(sample, reference, ext, qtype, weighted):
    x, qw, candidates = reference(qtype, weighted)
    ref = kquants.best_of(x, qw, candidates).numpy()
    w = torch.from_numpy(sample["w"])
    importance = torch.from_numpy(sample["imatrix"]) if weighted else None
    cpp = quantize_tensor(w, qtype, importance, ext=ext)
    differ = blocks_differ(cpp, ref, gguf.GGML_QUANT_SIZES[qtype][1])
    assert differ.size == 0, f"{differ.size} blocks differ, first {differ[:8]}"
    # so the block kept is never worse than llama.cpp's own bytes (error weighted as measured)
    theirs = sample[qtype.name.lower() + ("_imatrix" if weighted else "")]
    cw = torch.ones(w.shape[1]) if importance is None else importance

    def err(raw):
        return (cw * (dequantize_torch(raw, qtype) - w) ** 2).reshape(-1, 256).sum(-1)

    assert (err(cpp) <= err(theirs) * (1 + 1e-5)).all()
    assert (err(cpp) < err(theirs) * (1 - 1e-3)).any()  # and better somewhere: the other candidates count


def adversarial_rows() -> torch.Tensor:
    """(18, 512): each row two blocks of a hard case."""
    g = torch.Generator().manual_seed(7)
    n = torch.randn(18, 512, generator=g)
    rows = [
        torch.zeros(512),                                 # all zero
        torch.full((512,), 0.75),                         # constant positive
        torch.full((512,), -3.0),                         # constant negative
        n[3] * 3e4,                                       # near the fp16 limit of the scales
        n[4] * 1e-30,                                     # below fp16 (scales underflow to 0)
        n[5] * 1e-12,                                     # below GROUP_MAX_EPS in places
        torch.where(torch.arange(512) % 97 == 0, 50.0, 0.0),  # one spike per block, else 0
        n[7].abs(),                                       # all positive
        -n[8].abs(),                                      # all negative
        torch.sign(n[9]),                                 # two values
        torch.round(n[10] * 2) / 2,                       # a few levels, many ties
        n[11] * torch.linspace(0, 10, 512),               # growing scale
        torch.cat((torch.zeros(256), n[12, :256])),       # a zero block beside a live one
        torch.cat((n[13, :16] * 100, n[13, 16:] * 0.01)),  # one loud sub-block
        torch.where(n[14] > 1.5, n[14], 0.0),             # sparse
        n[15] ** 3,                                       # heavy tails
        torch.full((512,), 1e-20),                        # tiny constant
        n[17],
    ]
    return torch.stack(rows).float()


@pytest.mark.parametrize("importance", ["none", "rows"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_cpp_equals_reference_on_adversarial_rows(ext, qtype, importance):
    w = adversarial_rows()
    g = torch.Generator().manual_seed(3)
    # one importance per row (groups = rows), zero in every third column
    imp = None if importance == "none" else torch.rand(w.shape, generator=g) ** 4 * (torch.arange(512) % 3 != 0)
    ref = quantize_tensor(w, qtype, imp)
    cpp = quantize_tensor(w, qtype, imp, ext=ext)
    differ = blocks_differ(cpp, ref, gguf.GGML_QUANT_SIZES[qtype][1])
    assert differ.size == 0, f"{differ.size} blocks differ, first {differ[:8]}"
    assert np.isfinite(dequantize_torch(cpp, qtype).numpy()).all()


def test_cpp_random_rows_of_varied_scales_grouped_importance(ext):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(12, 512, generator=g) * torch.logspace(-3, 2, 12).unsqueeze(1)
    imp = torch.rand(4, 512, generator=g)  # per group of 3 rows (an expert stack's imatrix)
    for qtype in K_TYPES:
        assert np.array_equal(quantize_tensor(w, qtype, imp, ext=ext), quantize_tensor(w, qtype, imp)), qtype.name
