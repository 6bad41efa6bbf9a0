"""IQ4_NL / IQ4_XS weights on CUDA against the same weights on the CPU in fp32 (the C++ kernels' values,
equal to gguf's): prefill through kernels/triton_gemv.py decode_tile's table lookup, the decode graph
through the integer-dot products (kernels/triton_q8.py: the codes' int8 kvalues by byte permutes, then
dp4a against int8 activations), as Q4_0's. test_gpu_logits.py's bounds (Q4_0's), the decode steps'
products all integer-dot ones, and the greedy graph and verify pass equal to plain decode steps.
(tests/gpu/test_gpu_kernels.py also runs both types through every product kernel: they are
KERNEL_TYPES and INT_DOT_TYPES; test_integer_dot_products checks their dp4a products against the
decoded weights.)"""

from __future__ import annotations

import gguf
import pytest
import torch
from .gpu_helpers import check_greedy_graph_and_verify, check_logits, random_ids, take_dense_values


def product_types_of_a_step(rt, monkeypatch) -> tuple[set, set]:
    """The weight types of the quantized products one (eager, uncaptured) decode step runs through
    triton_q8.gemv_q8 (integer dot products), and through triton_gemv.gemv (float decoding)."""
    from localllm.backends.cuda_graph import GraphDecoder
    from localllm.kernels import triton_gemv, triton_q8
    from localllm.kernels.qweight import QWeight

    seen = {"int": set(), "float": set()}

    def spy(module, name, kind):
        real = getattr(module, name)

        def wrapped(x, w, **kw):
            if isinstance(w, QWeight):
                seen[kind].add(w.qtype)
            return real(x, w, **kw)
        monkeypatch.setattr(module, name, wrapped)  # kernels.linear imports both at each call

    cache = rt.new_cache(16)
    rt.prefill(cache, [random_ids(rt.cfg.vocab_size, 4, seed=3)], 0)
    spy(triton_q8, "gemv_q8", "int")
    spy(triton_gemv, "gemv", "float")
    GraphDecoder(rt.model, cache, use_graph=False).step(torch.tensor([1], device=rt.device))
    monkeypatch.undo()
    return seen["int"], seen["float"]


@pytest.mark.parametrize("case", [("smollm2-135m", "IQ4_NL", None), ("llama-3.2-1b", "IQ4_XS", 4)],
                         ids=lambda c: c[1])
@torch.inference_mode()
def test_iq4_logits_and_greedy_graph(synthetic_files, case, monkeypatch):
    from localllm.load import load_model

    preset, wtype, layers = case
    path = synthetic_files.gguf(preset, wtype, layers)
    gpu = load_model(str(path), "cuda", torch.bfloat16).runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    assert take_dense_values(ref.model, gpu.model) > 0
    # the decode step's products take the integer-dot kernels (IQ4_XS files: IQ4_NL where rows are not
    # whole 256-value super-blocks, llama.cpp's fallback), none the float decoders
    int_dot, floats = product_types_of_a_step(gpu, monkeypatch)
    assert gguf.GGMLQuantizationType[wtype] in int_dot and not floats, (int_dot, floats)
    check_logits(gpu, ref, prompt=14, steps=6)
    check_greedy_graph_and_verify(gpu, prompt_len=9)
