"""synthetic's random valid blocks (speed runs, bench/tp_speed.py): every type's blocks decode, by the gguf
package's dequantization (the oracle), to finite values of randn(K) / sqrt(K)'s scale and zero mean; a tiny
Q4_K_M state of them has the mix's types and shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm.config import ModelConfig
from localllm.model import Transformer
from localllm.synthetic import RANDOM_BLOCK_TYPES, RandomBlocks, is_linear, synthetic_state, tensor_type
from localllm.weights import QuantizedTensor

TINY = ModelConfig(arch="llama", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, head_dim=64,
                   vocab_size=300, context_length=128, norm_eps=1e-5, rope_theta=10000.0)


@pytest.mark.parametrize("qtype", sorted(RANDOM_BLOCK_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_random_blocks_decode_to_sane_values(qtype):
    rows, cols = 64, 1024
    raw = RandomBlocks("cpu", torch.Generator().manual_seed(1)).get(rows, cols, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.shape == (rows, cols // block * size) and raw.dtype == torch.uint8
    w = gguf.quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    assert w.shape == (rows, cols) and np.isfinite(w).all()
    rms = np.sqrt((w**2).mean()) * cols**0.5  # randn(K) / sqrt(K) rows: 1
    assert 0.5 < rms < 2.0, rms
    assert abs(w.mean()) < 0.1 * np.sqrt((w**2).mean())


def test_random_blocks_refuse_other_types():
    with pytest.raises(ValueError, match="random blocks of MXFP4"):
        RandomBlocks("cpu", torch.Generator()).get(4, 64, gguf.GGMLQuantizationType.MXFP4)


def test_state_of_random_blocks_has_the_mixs_types_and_shapes():
    """The speed path changes the blocks' bytes only: each linear weight has llama.cpp's Q4_K_M type
    (tensor_type) and its shape's whole rows of blocks; the rest is the module's dense tensors."""
    fast, types = synthetic_state(TINY, "Q4_K_M", "cpu", seed=2, random_blocks=True)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(TINY).state_dict().items()}
    assert set(fast) == set(shapes) and types["Q6_K"] > 0 and types["Q4_K"] > 0
    for name, v in fast.items():
        want = tensor_type(name.replace(".attn.", "."), "Q4_K_M", TINY) if is_linear(name, shapes[name]) else None
        if want is None:
            assert not isinstance(v, QuantizedTensor) and tuple(v.shape) == shapes[name], name
            continue
        block, size = gguf.GGML_QUANT_SIZES[want]
        rows, cols = shapes[name]
        assert v.qtype == want and tuple(v.data.shape) == (rows, cols // block * size), name
