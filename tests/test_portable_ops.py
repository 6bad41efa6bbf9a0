"""The portable torch backend (runtime.Runtime: model.py with TORCH_OPS), the one MPS runs, exercised
on the CPU: it gives the reference forward's logits, and it dispatches only torch ops that torch
implements on MPS, so the only code CI leaves unexercised for Apple GPUs is torch's own MPS kernels.

MPS_OPS lists aten ops with MPS kernels (torch's native_functions.yaml "MPS:" dispatch entries, or
CompositeImplicitAutograd ops that decompose into such; float64 is avoided: MPS has none). A new op in
the portable path must be checked against torch's MPS support before it is added here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_spec import Q
from localllm.backends.cpu import CpuRuntime
from localllm.generate import generate
from localllm.load import load_model
from localllm.runtime import Runtime
from localllm.sampling import Sampler
from localllm.settings import SamplingSettings

MPS_OPS = {
    # tensors, views and copies
    "aten.arange", "aten.cat", "aten.chunk", "aten.contiguous", "aten.copy_", "aten.detach_", "aten.empty_like",
    "aten.full_like", "aten.index", "aten.lift_fresh", "aten.reshape", "aten.select", "aten.slice", "aten.stack",
    "aten.to", "aten.transpose", "aten.unsqueeze", "aten.view", "aten.zeros", "aten.zeros_like",
    "aten._local_scalar_dense", "aten.embedding",
    # arithmetic, comparisons, reductions
    "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.pow", "aten.reciprocal", "aten.rsqrt", "aten.cos",
    "aten.sin", "aten.mean", "aten.max", "aten.all", "aten.isfinite", "aten.ge", "aten.lt", "aten.masked_fill",
    "aten.cumsum", "aten.argmax",
    # block decoding of GGUF weights (uint8 bit fields: kernels/cpu.py's torch path)
    "aten.__and__", "aten.__rshift__",
    # the layer: products, activation, attention
    "aten.linear", "aten.silu", "aten.scaled_dot_product_attention", "aten._softmax",
    # sampling (sampling.py): top-k / top-p, draws
    "aten.topk", "aten.sort", "aten.scatter", "aten.exponential_",
}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


SAMPLED = SamplingSettings(temperature=0.8, top_k=20, top_p=0.9, seed=1)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "llama3"])
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_portable_backend_uses_mps_ops_only(tiny, case, qtype):
    """Prefill, decode and sampling of every architecture, dense and block-quantized weights, float16 (the
    MPS default dtype)."""
    lm = load_model(str(tiny.gguf(case, qtype)), "cpu", torch.float16, backend=Runtime)
    assert type(lm.runtime) is Runtime
    rec = RecordOps()
    with rec:
        ids = list(generate(lm.runtime, lm.runtime.new_cache(32), [1, 2, 3, 4, 5], Sampler(SAMPLED), 4))
    assert len(ids) == 4
    assert rec.ops <= MPS_OPS, f"ops outside the MPS list: {sorted(rec.ops - MPS_OPS)}"


def test_op_recorder_sees_ops_outside_the_list():
    """The check can fail: an op MPS lacks (float64 cumulative product, say) is reported."""
    rec = RecordOps()
    with rec:
        torch.arange(4, dtype=torch.float64).cumprod(0)
    assert "aten.cumprod" in rec.ops - MPS_OPS


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_portable_backend_matches_the_cpu_backend(tiny, case):
    """The portable backend on the CPU and the CPU backend (C++ products, int8-rounded activations) give
    the same logits to that rounding, step by step, and the same greedy ids."""
    path = str(tiny.gguf(case, Q.Q8_0))
    portable = load_model(path, "cpu", torch.float32, backend=Runtime).runtime
    cpu = load_model(path, "cpu", torch.float32).runtime
    assert isinstance(cpu, CpuRuntime) and type(portable) is Runtime
    prompt = torch.randint(0, portable.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    caches = portable.new_cache(16), cpu.new_cache(16)
    assert cpu.cpp_decoder(caches[1]) is not None  # the CPU backend's one-call-per-token path
    with torch.inference_mode():
        a, b = (rt.prefill(c, prompt.tolist(), 0) for rt, c in zip((portable, cpu), caches))
        for _ in range(4):
            assert (a - b).norm() / b.norm() < 2e-2
            token = b.argmax(-1)
            assert torch.equal(a.argmax(-1), token)
            a, b = (rt.decode(c, token).clone() for rt, c in zip((portable, cpu), caches))
