"""The mixture-of-experts decode step on CUDA (kernels/triton_moe.py, backends/cuda_moe.py) under
Triton's interpreter: the expert products against the eager per-expert products (kernels.linear.
linear_rows on the decoded rows), the GLU and combine kernels against model.glu / MoE.forward's sum,
device routing against moe.route, and GraphDecoder's step (eager: no graphs on the CPU) on tiny
Mixtral-, Qwen3-MoE- and gpt-oss-like models against the fp32 torch forward; a verify pass's rows
equal one-token steps bit for bit."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_mma",
              "triton_table16", "triton_units", "triton_quant_act", "triton_q8", "triton_moe"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

from dataclasses import replace  # noqa: E402

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from test_triton_kernels import (TINY, check_verify_rows, graph_model,  # noqa: E402  (re-decorates first)
                                 quantize_inputs_like, rel)
from localllm.backends import runtime_class  # noqa: E402
from localllm.backends.cuda import CudaRuntime, covers  # noqa: E402
from localllm.backends.cuda_graph import GraphDecoder  # noqa: E402
from localllm.cache import make_cache  # noqa: E402
from localllm.kernels.linear import linear_rows  # noqa: E402
from localllm.kernels.qweight import INT_DOT_TYPES, KERNEL_TYPES, QWeight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed, to_fixed  # noqa: E402
from localllm.kernels.triton_moe import combine, expert_glu, expert_products  # noqa: E402
from localllm.load import build_model  # noqa: E402
from localllm.model import glu  # noqa: E402
from localllm.moe import ExpertLinear  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402
from moe_states import experts_as  # noqa: E402

Q = gguf.GGMLQuantizationType
E, N, K, T, KU = 4, 24, 256, 2, 2  # 4 experts of 24 rows (a partial row tile), 2 tokens, top-2


def stack(qtype):
    """(weight as the CUDA backend holds it, decoded (E, N, K) fp32) of a random expert stack."""
    dense = torch.randn(E * N, K, generator=torch.Generator().manual_seed(5))
    if qtype is None:
        return dense.view(E, N, K), dense.view(E, N, K)
    raw = torch.from_numpy(quantize_tensor(dense, qtype))
    return QWeight.from_raw(raw, qtype).to_blocks(), dequantize_torch(raw, qtype).view(E, N, K)


IDS = torch.tensor([[3, 0], [1, 3]], dtype=torch.int64)  # token t's experts (slot s = t k + j)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("qtype", [None, *sorted(KERNEL_TYPES, key=lambda t: t.name)],
                         ids=lambda t: "F32" if t is None else t.name)
def test_expert_products_match_per_expert_rows(qtype, per_slot, split):
    """out[s] = W[ids[s]] @ x[row(s)] + bias[ids[s]] as linear_rows on expert ids[s]'s rows (integer-dot
    types: of x as quantize_act rounds it), in the int64 accumulator, split over K or not."""
    w, dense = stack(qtype)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T * KU if per_slot else T, K, generator=g)
    bias = torch.randn(E, N, generator=g)
    out = torch.zeros(T * KU, N, dtype=torch.int64)
    ids = IDS.reshape(-1)
    int_dot = isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES
    xin = quantize_act(x) if int_dot else x
    expert_products(xin, w, ids, out, KU, bias=bias, per_slot=per_slot, split=split)
    xr = dequantize_act(xin[0], xin[1]) if int_dot else x
    for s in range(T * KU):
        e, row = int(ids[s]), s if per_slot else s // KU
        want = linear_rows(xr[row:row + 1], dense.reshape(E * N, K), e * N, (e + 1) * N, bias[e])[0]
        assert rel(from_fixed(out[s]), want) < 1e-5, (s, e)


def test_router_product_fp32_output_and_dense_bf16_experts():
    """The router as expert 0 of a (1, E, C) fp32 weight into an fp32 output; bf16 dense experts."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=g)
    router, bias = torch.randn(1, 8, K, generator=g), torch.randn(1, 8, generator=g)
    logits = expert_products(x, router, torch.zeros(T, dtype=torch.int32), torch.empty(T, 8), 1, bias=bias)
    assert rel(logits, x @ router[0].T + bias) < 1e-6
    rb, bb = router.bfloat16(), bias.bfloat16()  # a bf16 model's router: its values, multiplied in fp32
    logits = expert_products(x, rb, torch.zeros(T, dtype=torch.int32), torch.empty(T, 8), 1, bias=bb)
    assert rel(logits, x @ rb[0].float().T + bb.float()) < 1e-6
    w, dense = stack(None)
    out = torch.zeros(T * KU, N, dtype=torch.int64)
    xb = x.bfloat16()
    expert_products(xb, w.bfloat16(), IDS.reshape(-1), out, KU)
    for s in range(T * KU):
        want = xb[s // KU].float() @ dense[IDS.reshape(-1)[s]].bfloat16().float().T
        assert rel(from_fixed(out[s]), want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,limit", [("silu", None), ("swiglu_oai", 7.0), ("swiglu_oai", None)])
def test_expert_glu_is_model_glu_and_clears(act, limit, dtype):
    """expert_glu of the fixed-point sums = model.glu on the products rounded to the activation dtype
    (fp32: but for exp's last bits), the sums cleared; quantized: quantize_act of those values. (The
    interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: bf16 within a few of its steps
    here; tests/gpu/test_gpu_moe.py checks bf16 on the GPU.)"""
    cfg = replace(TINY, activation=act, swiglu_limit=limit)
    g = torch.Generator().manual_seed(8)
    gate, up = (torch.randn(3, 64, generator=g) * 4 for _ in range(2))
    ga, ua = to_fixed(gate), to_fixed(up)
    want = glu(cfg, from_fixed(ga).to(dtype), from_fixed(ua).to(dtype))
    got = expert_glu(ga.clone(), ua.clone(), dtype, oai=act == "swiglu_oai", limit=limit)
    assert got.dtype == dtype and rel(got, want) < (1e-6 if dtype == torch.float32 else 3e-2)
    q, d, s = expert_glu(ga, ua, dtype, oai=act == "swiglu_oai", limit=limit, quantize=True)
    assert not ga.any() and not ua.any()
    qr, dr, sr = quantize_act(got.float())
    assert torch.equal(d, dr) and torch.equal(q, qr) and torch.equal(s, sr)


def test_combine_is_the_weighted_sum_in_slot_order():
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        down = to_fixed(torch.randn(T * KU, 64, generator=g))
        w = torch.softmax(torch.randn(T, KU, generator=g), -1)
        x0 = to_fixed(torch.randn(T, 64, generator=g))
        vals = from_fixed(down).to(dtype).float().view(T, KU, 64)
        acc = torch.zeros(T, 64)
        for j in range(KU):
            acc = acc + vals[:, j] * w[:, j, None]
        want = from_fixed(x0) + acc.to(dtype).float()
        x = combine(down, w, x0.clone(), dtype)
        # (bf16: the interpreter truncates where the GPU rounds)
        assert not down.any() and rel(from_fixed(x), want) < (1e-7 if dtype == torch.float32 else 1e-2)


# tiny MoE configs over test_triton_kernels' TINY (dim 256: Q4_K's super-blocks)
MIXTRAL = replace(TINY, n_experts=4, n_experts_used=2, expert_ffn_dim=64)
QWEN3MOE = replace(TINY, n_experts=8, n_experts_used=3, expert_ffn_dim=32, moe_norm_topk=False, qk_norm=True)
GPTOSS = replace(TINY, n_experts=4, n_experts_used=2, expert_ffn_dim=64, activation="swiglu_oai",
                 swiglu_limit=7.0, moe_bias=True, moe_gating="topk_softmax", attn_sinks=True, attn_out_bias=True,
                 qkv_bias=True, sliding_window=3, sliding_layers=(True, False))
MOES = {"mixtral": MIXTRAL, "qwen3moe": QWEN3MOE, "gptoss": GPTOSS}


def test_the_cuda_backend_covers_experts():
    for cfg in MOES.values():
        assert covers(cfg) and runtime_class("cuda", cfg) is CudaRuntime
    assert not covers(replace(MIXTRAL, expert_ffn_dim=48))  # whole 32-value blocks only
    assert not covers(replace(MIXTRAL, activation="gelu_tanh"))


def moe_models(cfg, wtype: str, seed: int):
    """(fp32 reference Transformer, the CUDA backend's model) of one synthetic state (MXFP4: experts
    MXFP4, the rest Q8_0, as gpt-oss's files)."""
    state, _ = synthetic.synthetic_state(cfg, "Q8_0" if wtype == "MXFP4" else wtype, "cpu", seed=seed)
    if wtype == "MXFP4":
        state = experts_as(state, Q.MXFP4)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False).model
    return ref, graph_model(state, cfg)


def route_inputs_like(ref, fast) -> None:
    """The reference's expert products see x as the integer-dot kernels do (quantize_act's rounding)
    wherever fast's expert weight takes them (ExpertLinear: quantize_inputs_like covers Linears)."""
    def through_int8(_m, args):
        x = args[0]
        q, d, _ = quantize_act(x.reshape(-1, x.shape[-1]))
        return (dequantize_act(q, d).reshape(x.shape), *args[1:])

    mods = dict(ref.named_modules())
    for name, m in fast.named_modules():
        if isinstance(m, ExpertLinear) and m.qweight is not None and m.qweight.qtype in INT_DOT_TYPES:
            mods[name].register_forward_pre_hook(through_int8)


@pytest.mark.parametrize("family,wtype", [("mixtral", "f32"), ("mixtral", "Q8_0"), ("qwen3moe", "Q4_K_M"),
                                          ("gptoss", "f32"), ("gptoss", "MXFP4")])
def test_moe_decode_step_matches_model_forward(family, wtype, monkeypatch):
    """GraphDecoder's step with MoE layers gives the fp32 reference model's logits, the reference
    quantizing integer-product inputs as the kernels do (the router stays fp32 in both)."""
    cfg = MOES[family]
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    ref, fast = moe_models(cfg, wtype, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache, ref_cache = make_cache(cfg, 10), make_cache(cfg, 10)
        fast(tokens[:, :5], cache, 0)
        ref(tokens[:, :5], ref_cache, 0)
        quantize_inputs_like(ref, fast)
        for blk in ref.blk:  # the step's router takes fp32 h, not int8 (its weight decoded to fp32)
            blk.moe.ffn_gate_inp._forward_pre_hooks.clear()
        route_inputs_like(ref, fast)
        dec = GraphDecoder(fast, cache, use_graph=False)
        for i in range(5, 8):
            want = ref(tokens[:, i:i + 1], ref_cache, i)[0, -1]
            # quantized: the step's RMSNorm differs from the module's in fp32 rounding, which can move
            # an int8 step of x (then kept in the cache rows): ~1e-2 at most on these tiny models
            # (the float path of the same MXFP4 experts gives 2e-7); a wrong expert or row gives ~1
            assert rel(dec.step(tokens[0, i]), want) < (1e-5 if wtype == "f32" else 1e-2), i


@pytest.mark.parametrize("family", ["mixtral", "gptoss"])
def test_moe_verify_rows_equal_single_steps(family, monkeypatch):
    """A verify pass of 3 tokens gives each row's logits bit for bit as one-token steps."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    check_verify_rows(MOES[family], cache_rows=False)


def test_footprint_counts_the_experts_a_token_reads():
    """bench's roofline (footprint.weight_bytes_per_token) and draft cost count k of E experts' rows;
    what the model holds counts every expert."""
    from localllm.footprint import linear_params, model_stats, weight_bytes_per_token

    state, _ = synthetic.synthetic_state(MIXTRAL, "f32", "cpu", seed=1)
    model = build_model(MIXTRAL, dict(state), "cpu", torch.float32, keep_quantized=False).model
    stack = MIXTRAL.n_experts * MIXTRAL.expert_ffn_dim * MIXTRAL.dim  # values of one expert stack
    share = MIXTRAL.n_experts_used / MIXTRAL.n_experts
    dense = sum(p.numel() for n, p in model.named_parameters() if "_exps" not in n)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    linears = dense - norms - model.token_embd.weight.numel()
    assert weight_bytes_per_token(model) == 4 * (linears + norms + MIXTRAL.dim) + round(4 * 3 * MIXTRAL.n_layers * stack * share)
    assert model_stats(model)[1] == dense + 3 * MIXTRAL.n_layers * stack
    assert linear_params(model)[0] == linears - MIXTRAL.vocab_size * MIXTRAL.dim + round(3 * MIXTRAL.n_layers * stack * share)


@pytest.mark.parametrize("gating,norm,e,k", [("softmax", True, 8, 2), ("softmax", False, 128, 8),
                                             ("topk_softmax", True, 32, 4), ("softmax", True, 6, 3)])
def test_route_rows_is_moe_route_in_expert_order(gating, norm, e, k):
    """The routing kernel chooses moe.route's experts on the same logits, weights within fp32 rounding,
    each row's slots in ascending expert order."""
    from localllm.kernels.triton_moe import route_rows
    from localllm.moe import route

    cfg = replace(TINY, n_experts=e, n_experts_used=k, moe_gating=gating, moe_norm_topk=norm)
    logits = torch.randn(5, e, generator=torch.Generator().manual_seed(e + k)) * 3
    w, experts = route(cfg, logits)
    experts, order = experts.sort(-1)
    got_w, got_ids = route_rows(logits, k, gating, norm)
    assert torch.equal(got_ids.long(), experts)
    assert (got_w - w.gather(-1, order)).abs().max() < 1e-6


@pytest.mark.parametrize("qtype", [None, Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda t: "F32" if t is None else t.name)
def test_stacked_gate_up_products_equal_separate_ones(qtype):
    """Two expert stacks in one weight (backends/cuda_moe.fuse_experts: gate's rows, then up's) in one
    launch give each stack's products bit for bit, in out's two column halves."""
    w, _ = stack(qtype)
    w2 = stack(qtype)[0] if qtype is None else QWeight.cat([w, w.rows(0, E * N)])  # (a second stack)
    w2 = torch.cat([w, w * 0.5]) if qtype is None else w2
    g = torch.Generator().manual_seed(10)
    x = torch.randn(T, K, generator=g)
    bias = torch.randn(2 * E, N, generator=g)
    int_dot = isinstance(w, QWeight) and w.qtype in INT_DOT_TYPES
    xin = quantize_act(x) if int_dot else x
    ids = IDS.reshape(-1)
    both = torch.zeros(T * KU, 2 * N, dtype=torch.int64)
    expert_products(xin, w2, ids, both, KU, bias=bias, stacks=2)
    for j in range(2):
        one = torch.zeros(T * KU, N, dtype=torch.int64)
        wj = w2[j * E:(j + 1) * E] if qtype is None else w2.rows(j * E * N, (j + 1) * E * N)
        expert_products(xin, wj, ids, one, KU, bias=bias[j * E:(j + 1) * E])
        assert torch.equal(both[:, j * N:(j + 1) * N], one), j
