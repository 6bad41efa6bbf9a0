"""The mixture-of-experts prompt on CUDA (kernels/triton_moe_gemm.py, backends/cuda_moe_prefill.py)
under Triton's interpreter: the slot grouping (every slot once, padding skipped), the grouped GEMM
against per-expert products of the decoded stacks, the weighted sum against MoE.forward's, the whole
MoE layer (both paths: grouped GEMM, decode kernels) against MoE.forward on the same weights, the
CUDA backend's prompt forward against the fp32 reference model, and no host-syncing op inside."""

from __future__ import annotations

import functools
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_mma",
              "triton_table16", "triton_units", "triton_quant_act", "triton_q8", "triton_moe", "triton_moe_gemm"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from test_triton_kernels import rel  # noqa: E402  (re-decorates first)
from test_triton_moe_decode import MOES  # noqa: E402
from localllm.backends import cuda_moe_prefill  # noqa: E402
from localllm.backends.cuda import CUDA_OPS, CudaRuntime  # noqa: E402
from localllm.backends.cuda_moe_prefill import moe_prefill  # noqa: E402
from localllm.kernels.qweight import INT_DOT_TYPES  # noqa: E402
from localllm.kernels.triton_moe_gemm import align_slots, combine_rows, grouped_products  # noqa: E402
from localllm.load import build_model  # noqa: E402
from localllm.moe import ExpertLinear  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402
from moe_states import experts_as  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("s,e,bm", [(10, 6, 4), (37, 5, 16), (3, 8, 16)])
def test_align_slots_groups_every_slot_once(s, e, bm):
    """Each slot in exactly one block of its expert, in slot order; padding -1; blocks past the end -1."""
    ids = torch.randint(0, e, (s,), generator=torch.Generator().manual_seed(s))
    ids[0] = e - 1  # the last expert used, some expert likely unused
    slots, block_expert = align_slots(ids.int(), e, bm)
    assert block_expert.numel() == -(-s // bm) + e and slots.numel() == block_expert.numel() * bm
    blocks = slots.view(-1, bm)
    seen = []
    for b, be in enumerate(block_expert.tolist()):
        valid = [v for v in blocks[b].tolist() if v >= 0]
        if be < 0:
            assert not valid
            continue
        assert valid and all(ids[v] == be for v in valid), b
        assert blocks[b].tolist() == valid + [-1] * (bm - len(valid))  # padding at the run's end only
        seen += valid
    assert sorted(seen) == list(range(s))
    assert seen == sorted(range(s), key=lambda v: (int(ids[v]), v))  # by expert, then slot order
    assert block_expert[block_expert >= 0].diff().ge(0).all()


@pytest.mark.parametrize("per_slot,bm", [(False, 16), (True, 16), (False, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_match_per_expert_products(per_slot, bm, dtype):
    """out[s] = W[j, ids[s]] @ x[row(s)] + bias for both stacks, K not a multiple of the tile (80)."""
    E, N, K, T, k = 4, 24, 80, 7, 2
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(2 * E, N, K, generator=g).to(dtype), torch.randn(2 * E, N, generator=g).to(dtype)
    x = torch.randn(T * k if per_slot else T, K, generator=g).to(dtype)
    ids = torch.randint(0, E, (T * k,), generator=g, dtype=torch.int32)
    ids[:3] = 2  # a run of several slots of one expert
    slots, block_expert = align_slots(ids, E, bm)
    out = torch.full((T * k, 2 * N), float("nan"), dtype=dtype)
    grouped_products(x, w, slots, block_expert, out, k, bm, bias=bias, per_slot=per_slot, stacks=2)
    for s in range(T * k):
        e, row = int(ids[s]), s if per_slot else s // k
        for j in range(2):
            want = x[row].float() @ w[j * E + e].float().T + bias[j * E + e].float()
            # bf16: the output rounded once (the interpreter truncates where the GPU rounds)
            assert rel(out[s, j * N:(j + 1) * N], want) < (1e-6 if dtype == torch.float32 else 1e-2), (s, j)


def test_combine_rows_is_moe_forward_sum():
    """sum_j w[t, j] down[t k + j] in slot order from zero (MoE.forward's index_add_), rounded."""
    T, k, C = 5, 3, 40
    g = torch.Generator().manual_seed(4)
    down, w = torch.randn(T * k, C, generator=g), torch.softmax(torch.randn(T, k, generator=g), -1)
    want = torch.zeros(T, C)
    for j in range(k):
        want.index_add_(0, torch.arange(T), down.view(T, k, C)[:, j] * w[:, j, None])
    assert rel(combine_rows(down, w, torch.float32), want) < 1e-7
    assert combine_rows(down, w, torch.bfloat16).dtype == torch.bfloat16


CASES = [("mixtral", "f32"), ("mixtral", "Q8_0"), ("qwen3moe", "Q4_K_M"), ("gptoss", "f32"), ("gptoss", "MXFP4")]


@functools.cache
def runtimes(family: str, wtype: str):
    """(fp32 dense reference runtime, CudaRuntime on the CPU (QWeights, fused stacks, CUDA_OPS)) of one
    synthetic state (MXFP4: experts MXFP4, the rest Q8_0)."""
    cfg = MOES[family]
    mp = pytest.MonkeyPatch()
    mp.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(cfg, "Q8_0" if wtype == "MXFP4" else wtype, "cpu", seed=5)
    mp.undo()
    if wtype == "MXFP4":
        state = experts_as(state, Q.MXFP4)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False)
    fast = build_model(cfg, dict(state), "cpu", torch.float32, backend=CudaRuntime)
    assert fast.model.blk[0].ops is CUDA_OPS and fast.model.blk[0].moe.fused_gate_up is not None
    return ref, fast


def int8_inputs(moe, fast_moe):
    """Hooks making moe's ExpertLinears see x as quantize_act rounds it (the decode kernels' inputs)
    where fast_moe's are integer-dot -> their handles."""
    def through_int8(_m, args):
        q, d, _ = quantize_act(args[0].reshape(-1, args[0].shape[-1]))
        return (dequantize_act(q, d).reshape(args[0].shape), *args[1:])

    mods = dict(moe.named_modules())
    return [mods[name].register_forward_pre_hook(through_int8) for name, m in fast_moe.named_modules()
            if isinstance(m, ExpertLinear) and m.qweight is not None and m.qweight.qtype in INT_DOT_TYPES]


class SyncOps(TorchDispatchMode):
    """Records aten ops that make a CUDA stream wait for the host (a value or size read back)."""
    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_dim", "bincount", "masked_select",
               "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tokens", [2, 12])  # 2: the decode kernels (few slots) where they apply; 12: the GEMM
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_moe_layer_matches_moe_forward(case, tokens, monkeypatch):
    """moe_prefill == MoE.forward on the same weights (the reference's exact fp32 decoding; the same
    experts chosen), fp32 activations: the grouped path within fp32 summation order; the decode
    kernels' path against MoE.forward with x rounded to int8 where those kernels take integer
    products. And moe_prefill runs no op that reads a device value back (what stops a CUDA graph's
    capture; the interpreter's own launches aside): MoE.forward does (the check can fail).
    Q4_K_M's layer 0 has a Q5_0 down stack (no decode kernel: the GEMM path at 2 tokens too)."""
    import triton.runtime.interpreter as interp

    launch = interp.InterpretedFunction.__call__

    def unrecorded(self, *args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interp.InterpretedFunction, "__call__", unrecorded)
    ref, fast = runtimes(*case)
    layer = 0 if tokens > 2 else -1
    moe, ref_moe = fast.model.blk[layer].moe, ref.model.blk[layer].moe
    cfg = moe.cfg
    h = torch.randn(1, tokens, cfg.dim, generator=torch.Generator().manual_seed(tokens))
    few = cuda_moe_prefill.few_slots(moe, tokens * cfg.n_experts_used)
    assert few == (tokens == 2)
    with torch.inference_mode():
        with SyncOps() as rec:
            got = moe_prefill(moe, h)
        assert rec.seen == []
        hooks = int8_inputs(ref_moe, moe) if few else []
        with SyncOps() as rec:
            want = ref_moe(h)
        assert rec.seen
        for hk in hooks:
            hk.remove()
    assert got.shape == h.shape and rel(got, want) < 1e-5


def test_q4_k_m_layer_0_has_no_decode_kernel_path():
    moe = runtimes("qwen3moe", "Q4_K_M")[1].model.blk[0].moe
    assert not cuda_moe_prefill.few_slots(moe, 2)


def test_cuda_prompt_forward_matches_reference():
    """CudaRuntime's prompt forward (CUDA_OPS with moe_prefill) gives the fp32 reference model's logits:
    11 tokens (the grouped GEMM), then a chunk of 2 after them (the decode kernels, x rounded to int8
    for MXFP4's integer products). gpt-oss: the MoE layer with most options (router and expert biases,
    top-k softmax, clamped SwiGLU); tests/gpu/test_gpu_moe_prefill.py runs every family's at real widths."""
    ref, fast = runtimes("gptoss", "MXFP4")
    cfg = ref.cfg
    assert not cuda_moe_prefill.few_slots(fast.model.blk[-1].moe, 11 * cfg.n_experts_used)
    ids = torch.randint(0, cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(6))
    caches = [rt.new_cache(16) for rt in (ref, fast)]
    int_dot = any(m.qweight is not None and m.qweight.qtype in INT_DOT_TYPES
                  for m in fast.model.modules() if isinstance(m, ExpertLinear))
    for start, stop in ((0, 11), (11, 13)):
        want, got = (rt.forward(ids[:, start:stop], c, start) for rt, c in zip((ref, fast), caches))
        assert rel(got, want) < (2e-2 if int_dot and stop == 13 else 1e-5), (start, stop)
