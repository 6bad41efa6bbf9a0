"""The Triton kernels (kernels/triton_gemv.py, triton_decode.py, triton_attention.py, ...) against their
torch references, executed on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported here).

References: quantize.dequantize_torch (bit for bit) for the dequantize kernel; x.float() @ w.T in fp32
for the products; model.py's modules for the fused prologues/epilogues and for a whole decode step.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
# re-decorate if imported uninterpreted (the base first: the others read its INTERPRET)
for _name in ("triton_base", "triton_epilogue", "triton_gemv", "triton_dense", "triton_mma", "triton_table16",
              "triton_units", "triton_quant_act", "triton_q8", "triton_decode", "triton_attention", "triton_prefill",
              "triton_rope", "triton_norm_fused"):
    if f"localllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"localllm.kernels.{_name}"])

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from localllm.kernels import triton_attention, triton_epilogue, triton_gemv, triton_prefill  # noqa: E402
from localllm.kernels.qweight import INT_DOT_TYPES, KERNEL_TYPES, QWeight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed, to_fixed  # noqa: E402
from localllm.cache import make_cache  # noqa: E402
from localllm.config import ModelConfig  # noqa: E402
from localllm.backends.cuda import CUDA_OPS, CudaRuntime, fuse  # noqa: E402
from localllm.backends.cuda_graph import GraphDecoder  # noqa: E402
from localllm.load import build_model  # noqa: E402
from localllm.model import Linear  # noqa: E402
from localllm.quantize import dequantize_torch, quantize_tensor  # noqa: E402
from localllm.quantize.act import dequantize_act, quantize_act  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = sorted(KERNEL_TYPES, key=lambda t: t.name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def quantized(request):
    """(qtype, raw (rows, bytes), QWeight) of a random (40, 512) weight; 40 rows: a partial row tile."""
    g = torch.Generator().manual_seed(7)
    raw = torch.from_numpy(quantize_tensor(torch.randn(40, 512, generator=g), request.param))
    return request.param, raw, QWeight.from_raw(raw, request.param)


def test_interpreter_is_on():
    assert type(triton_gemv._gemv_kernel).__name__ == "InterpretedFunction"


def test_dequantize_kernel_is_bit_exact(quantized):
    qtype, raw, qw = quantized
    assert torch.equal(triton_gemv.dequantize(qw, torch.float32), dequantize_torch(raw, qtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # e = 255 times code 12: inf
def test_mxfp4_dequantize_kernel_reads_every_exponent_and_code():
    """Random MXFP4 blocks: every E8M0 byte (0 and 1 the subnormal scales, 255 overflowing to inf in
    the codes' products as in gguf) and every E2M1 code (8: +0) decode to gguf's values, same bits."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (64, 17 * 8), dtype=torch.uint8, generator=g)
    raw.view(64, 8, 17)[:, :, 0] = torch.arange(64 * 8, dtype=torch.int32).reshape(64, 8).remainder(256).to(torch.uint8)
    got = triton_gemv.dequantize(QWeight.from_raw(raw, Q.MXFP4), torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.MXFP4).astype("float32"))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
def test_iq4_dequantize_kernel_reads_every_code_and_scale(qtype):
    """Random IQ4 blocks (finite fp16 d): every code of the table and every IQ4_XS 6-bit scale decode to
    gguf's values, same bits."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (16, 2 * nbytes), dtype=torch.uint8, generator=g)
    d = (torch.rand(16, 2, generator=g) * 2 - 1).to(torch.float16).view(torch.uint8).reshape(16, 2, 2)
    raw.view(16, 2, nbytes)[:, :, :2] = d
    got = triton_gemv.dequantize(QWeight.from_raw(raw, qtype), torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).astype("float32"))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_dequantize_kernel_bf16_is_the_rounded_reference(quantized):
    """Within one bf16 step: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
    (tests/gpu/test_gpu_kernels.py checks the GPU's bf16 values for equality)."""
    qtype, raw, qw = quantized
    ref = dequantize_torch(raw, qtype)
    got = triton_gemv.dequantize(qw, torch.bfloat16).float()
    assert ((got - ref).abs() <= ref.abs() * 2**-7).all()


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_matches_fp32_matmul(quantized, rows):
    qtype, raw, qw = quantized
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = triton_gemv.gemv(x, qw, act_dtype=torch.float32)
    assert rel(got, x @ dequantize_torch(raw, qtype).T) < 1e-5


def test_gemv_dense_with_bias():
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(24, 256, generator=g), torch.randn(2, 256, generator=g), torch.randn(24, generator=g)
    assert rel(triton_gemv.gemv(x, w, bias=b, act_dtype=torch.float32), F.linear(x, w, b)) < 1e-5


def test_fused_norm_and_residual_match_modules(quantized):
    """residual + gemv(RMSNorm(x)) in bf16 activations equals the torch module composition."""
    qtype, raw, qw = quantized
    g = torch.Generator().manual_seed(11)
    x, nw, res = torch.randn(1, 512, generator=g), (1 + 0.1 * torch.randn(512, generator=g)).bfloat16(), torch.randn(1, 40, generator=g)
    xf = x.float()
    h = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    ref = res + (h.float() @ dequantize_torch(raw, qtype).T).bfloat16()
    got = triton_gemv.gemv(x, qw, residual=res, norm_weight=nw, eps=1e-5, act_dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and rel(got, ref) < 1e-2


def test_glu_epilogue_on_interleaved_rows(quantized):
    """gate/up rows interleaved in one weight: output silu(W_gate x) * (W_up x), in fp32 exactly."""
    qtype, raw, qw = quantized
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    y = x @ dequantize_torch(raw, qtype).T  # rows 0, 2, ... are gates, 1, 3, ... ups
    got = triton_gemv.gemv(x, qw, glu=True, act_dtype=torch.float32)
    assert rel(got, F.silu(y[:, 0::2]) * y[:, 1::2]) < 1e-5


def test_interleaved_views_decode_like_their_rows(quantized):
    """QWeight.cat(interleave=True) and strided row views give the original weights' values."""
    qtype, raw, qw = quantized
    fused = QWeight.cat([qw, qw.rows(0, 40)], interleave=True)
    for i in (0, 1):
        view = fused.rows(i, fused.shape[0], 2)
        assert torch.equal(triton_gemv.dequantize(view, torch.float32), dequantize_torch(raw, qtype))


@pytest.mark.parametrize("inplace", [False, True])
def test_split_k_sums_like_one_pass(quantized, inplace):
    """K cut into parts summed by atomics (down projections): into zeros, a residual copy, or in place."""
    qtype, raw, qw = quantized
    g = torch.Generator().manual_seed(6)
    x, res = torch.randn(1, 512, generator=g), torch.randn(1, 40, generator=g)
    ref = res + x @ dequantize_torch(raw, qtype).T
    got = triton_gemv.gemv(x, qw, residual=res.clone() if inplace else res, act_dtype=torch.float32, split=4,
                           inplace=inplace)
    assert rel(got, ref) < 1e-5
    assert rel(triton_gemv.gemv(x, qw, act_dtype=torch.float32, split=2), ref - res) < 1e-5


def test_dense_glu_matches_silu_mul():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 256, generator=g).bfloat16(), torch.randn(32, 256, generator=g).bfloat16()
    y = F.linear(x, w)
    ref = F.silu(y[:, 0::2]) * y[:, 1::2]
    assert rel(triton_gemv.gemv(x, w, glu=True), ref) < 2e-2


def test_rope_store_and_attention_match_torch():
    g = torch.Generator().manual_seed(9)
    H, HKV, D, S, pos = 4, 2, 64, 16, 10
    qkv = torch.randn(1, (H + 2 * HKV) * D, generator=g)
    kc, vc = torch.randn(HKV, S, D, generator=g), torch.randn(HKV, S, D, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    p = torch.tensor([pos], dtype=torch.int32)
    q = triton_attention.rope_store(qkv, kc, vc, p, inv_freq, H, HKV, D)
    ang = pos * inv_freq
    from localllm.model import rope_rotate

    qr, kr, vr = qkv.view(H + 2 * HKV, D).split([H, HKV, HKV])
    assert rel(q, rope_rotate(qr[None, :, None], ang.cos(), ang.sin())[0, :, 0]) < 1e-6
    assert rel(kc[:, pos], rope_rotate(kr[None, :, None], ang.cos(), ang.sin())[0, :, 0]) < 1e-6
    assert torch.equal(vc[:, pos], vr)
    ref = F.scaled_dot_product_attention(q[None, :, None], kc[None, :, :pos + 1], vc[None, :, :pos + 1], enable_gqa=True)
    for chunk in (4, 16, 128):  # chunks past pos are empty and must weigh nothing; 16+: GQA groups
        for gqa in (False, True):
            out = triton_attention.decode_attention(q, kc, vc, p, HKV, chunk=chunk, gqa=gqa)
            assert rel(out, ref.reshape(1, -1)) < 1e-5
    # the combine kernel's int8 form of its output is quantize.act's, for an integer-dot o projection
    out, xq = triton_attention.decode_attention(q, kc, vc, p, HKV, quantize=True)
    assert all(torch.equal(a, b) for a, b in zip(xq, quantize_act(out)))
    # clear: the qkv accumulator is zero once read, the results unchanged
    acc = qkv.clone()
    assert torch.equal(triton_attention.rope_store(acc, kc, vc, p, inv_freq, H, HKV, D, clear=True), q)
    assert not acc.any()


@pytest.mark.parametrize("tokens,batch", [(1, 1), (3, 1), (1, 2)])
def test_attention_with_rope_fused_equals_rope_store_then_attention(tokens, batch):
    """decode_attention(rope=...): the chunk programs rotate q and k and write the current tokens' k, v
    rows themselves: the cache rows rope_store writes, the attention of its q (in the fp32 rounding of
    the same operations), and the q|k|v accumulator zero afterwards. Tokens 3: a verify pass (each
    token sees the earlier ones of the same step); batch 2: two sequences, each its own cache."""
    g = torch.Generator().manual_seed(19)
    H, HKV, D, S, pos = 4, 2, 64, 80, 62  # the 3 tokens straddle the chunk boundary at 64
    rows = tokens * batch
    acc = to_fixed(torch.randn(rows, (H + 2 * HKV) * D, generator=g))
    caches = [torch.randn(batch, HKV, S, D, generator=g) for _ in range(2)]
    kc, vc = caches[0].clone(), caches[1].clone()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    p = torch.tensor([pos], dtype=torch.int32)
    q = triton_attention.rope_store(acc.clone(), caches[0], caches[1], p, inv_freq, H, HKV, D)
    want = triton_attention.decode_attention(q, caches[0], caches[1], p, HKV, quantize=True, tokens=tokens)
    got = triton_attention.decode_attention(None, kc, vc, p, HKV, quantize=True, tokens=tokens, rope=(acc, inv_freq, D))
    assert rel(kc, caches[0]) < 1e-7 and torch.equal(vc, caches[1])
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1][1], want[1][1]) < 1e-5
    assert not acc.any()


def test_glu_rows_matches_modules_and_clears():
    """triton_decode.glu_rows: interleaved gate/up sums in int64 fixed point -> F.silu(gate) * up with
    each op rounded to the activation dtype as the modules round it; the accumulator is left zero."""
    from localllm.kernels.triton_decode import glu_rows

    g = torch.Generator().manual_seed(5)
    acc = to_fixed(3 * torch.randn(3, 2 * 1500, generator=g))  # F = 1500: a partial last block
    sums = from_fixed(acc)
    # fp32 activations: the interpreter rounds fp32 -> bf16 by truncation, not as the GPU does
    got = glu_rows(acc, torch.float32, block=512)
    assert rel(got, F.silu(sums[:, 0::2]) * sums[:, 1::2]) < 1e-6 and not acc.any()


def test_rmsnorm_kernel_matches_module():
    from localllm.model import RMSNorm

    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, 300, generator=g)
    norm = RMSNorm(300, 1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(300, generator=g)
    assert rel(triton_prefill.rmsnorm_rows(x, norm.weight.data, 1e-5), norm(x).detach()) < 1e-6


TINY = ModelConfig(arch="llama", n_layers=2, dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=64,
                   vocab_size=256, context_length=64, norm_eps=1e-5, rope_theta=10000.0)


def quantize_inputs_like(ref: torch.nn.Module, fast: torch.nn.Module) -> None:
    """Make ref's Linears see their input as kernels/triton_q8.py does wherever fast's weight takes
    integer products: x quantized to int8 per 32 values (quantize.act), then dequantized."""
    def through_int8(x: torch.Tensor) -> torch.Tensor:
        q, d, _ = quantize_act(x.reshape(-1, x.shape[-1]))
        return dequantize_act(q, d).reshape(x.shape)

    mods = dict(ref.named_modules())
    for name, m in fast.named_modules():
        if isinstance(m, Linear) and m.qweight is not None and m.qweight.qtype in INT_DOT_TYPES:
            mods[name].register_forward_pre_hook(lambda _m, args: (through_int8(args[0]),))
    if getattr(fast.output_weight(), "qtype", None) in INT_DOT_TYPES:  # the head: output_norm's output
        ref.output_norm.register_forward_hook(lambda _m, _args, y: through_int8(y))


def graph_model(state: dict, cfg: ModelConfig = TINY):
    """The weights as the CUDA backend loads them (QWeights, q|k|v and gate/up fused), on the CPU."""
    model = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=True).model
    fuse(model)
    return model


def check_decode_steps(cfg: ModelConfig, wtype: str) -> GraphDecoder:
    """GraphDecoder (eager here) after a 5-token prompt gives the fp32 reference model's logits for 3
    steps (the reference quantizing integer-product inputs as the kernels do); -> the decoder."""
    state, _ = synthetic.synthetic_state(cfg, wtype, "cpu", seed=1)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False).model
    fast = graph_model(state, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache, ref_cache = make_cache(cfg, 10), make_cache(cfg, 10)
        fast(tokens[:, :5], cache, 0)
        ref(tokens[:, :5], ref_cache, 0)
        quantize_inputs_like(ref, fast)
        dec = GraphDecoder(fast, cache, use_graph=False)
        for i in range(5, 8):
            want = ref(tokens[:, i:i + 1], ref_cache, i)[0, -1]
            assert rel(dec.step(tokens[0, i]), want) < (1e-5 if wtype == "f32" else 2e-3), i
    return dec


def check_verify_rows(cfg: ModelConfig, cache_rows: bool = True) -> None:
    """A verify pass of 3 tokens (Q8_0 weights) gives each row's logits bit for bit as one-token steps
    (speculative decoding's greedy ids are plain decoding's); cache_rows: and the same k cache rows."""
    state, _ = synthetic.synthetic_state(cfg, "Q8_0", "cpu", seed=3)
    fast = graph_model(state, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        caches = [make_cache(cfg, 10) for _ in range(2)]
        for c in caches:
            fast(tokens[:, :5], c, 0)
        rows = GraphDecoder(fast, caches[0], use_graph=False, tokens=3).step(tokens[0, 5:8]).clone()
        one = GraphDecoder(fast, caches[1], use_graph=False)
        for t in range(3):
            assert torch.equal(one.step(tokens[0, 5 + t]), rows[t]), t
        if cache_rows:
            assert torch.equal(caches[0].k[:, :, :, :8], caches[1].k[:, :, :, :8])


@pytest.mark.parametrize("wtype", ["Q4_K_M", "Q8_0", "f32"])
def test_cuda_ops_forward_matches_reference(wtype, monkeypatch):
    """The CUDA backend's prompt forward (as load builds it: QWeights, CUDA_OPS, q|k|v and gate/up
    fused by prepare) gives the reference forward's logits and cache rows: a prompt of 2 sequences,
    then a chunk after it (the masked path), within fp32 rounding."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=11)
    ref = build_model(TINY, dict(state), "cpu", torch.float32, keep_quantized=False)
    fast = build_model(TINY, dict(state), "cpu", torch.float32, backend=CudaRuntime)
    assert isinstance(fast, CudaRuntime) and fast.model.blk[0].attn.ops is CUDA_OPS
    for blk in fast.model.blk:  # fused once at load (a Q4_K_M layer's Q6_K attn_v keeps q, k, v apart)
        assert blk.fused_gate_up is not None and (blk.attn.fused_qkv is not None or wtype == "Q4_K_M")
    tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(12))
    caches = [rt.new_cache(12, batch=2) for rt in (ref, fast)]
    for start, stop in ((0, 6), (6, 9)):
        want, got = (rt.forward(tokens[:, start:stop], c, start) for rt, c in zip((ref, fast), caches))
        assert rel(got, want) < 1e-5, (start, stop)
        assert caches[1].length == caches[0].length == stop
        for layer in range(TINY.n_layers):
            for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
                assert rel(b[layer][:, :, :stop], a[layer][:, :, :stop]) < 1e-5, layer


@pytest.mark.parametrize("wtype", ["Q4_K_M", "Q8_0", "Q4_0", "f32"])
def test_decode_step_matches_model_forward(wtype, monkeypatch):
    """GraphDecoder's step (eager here: no graphs on the CPU) gives the fp32 model's logits, the
    reference quantizing the inputs of integer-product weights as the kernels do."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=1)
    ref = build_model(TINY, dict(state), "cpu", torch.float32, keep_quantized=False).model
    fast = graph_model(state)
    tokens = torch.randint(0, TINY.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache, ref_cache = make_cache(TINY, 8), make_cache(TINY, 8)
        fast(tokens[:, :5], cache, 0)  # the prompt: dense products on the CPU, in both
        ref(tokens[:, :5], ref_cache, 0)
        quantize_inputs_like(ref, fast)
        dec = GraphDecoder(fast, cache, use_graph=False)
        for i in (5, 6):
            want = ref(tokens[:, i:i + 1], ref_cache, i)[0, -1]
            # RMSNorm fused into the quantization differs from the module's in fp32 rounding only,
            # which can move an int8 step rarely
            assert rel(dec.step(tokens[0, i]), want) < (1e-5 if wtype == "f32" else 2e-3)



@pytest.mark.parametrize("wtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_decode_step_takes_integer_products(wtype, monkeypatch):
    """IQ4 weights in the decode step: every quantized product is an integer-dot one (triton_q8.gemv_q8,
    the codes' kvalues against int8 activations), none float-decoded (triton_gemv.gemv), and the steps
    give the fp32 reference's logits as Q4_0's do (check_decode_steps)."""
    from localllm.kernels import triton_q8

    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    seen = {"int": set(), "float": set()}

    def spy(module, name, kind):
        real = getattr(module, name)

        def wrapped(x, w, **kw):
            if isinstance(w, QWeight):
                seen[kind].add(w.qtype)
            return real(x, w, **kw)
        monkeypatch.setattr(module, name, wrapped)  # kernels.linear imports both at each call

    spy(triton_q8, "gemv_q8", "int")
    spy(triton_gemv, "gemv", "float")
    check_decode_steps(TINY, wtype)
    assert seen == {"int": {gguf.GGMLQuantizationType[wtype]}, "float": set()}, seen


@pytest.mark.parametrize("wtype", ["Q8_0", "f32"])
def test_batched_step_rows_equal_single_sequences(wtype, monkeypatch):
    """A step of B = 3 sequences (bench's batches; each its own cache rows, the same position) gives
    each sequence's logits and cache rows bit for bit as a batch-1 step on that sequence alone."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=5)
    fast = graph_model(state)
    tokens = torch.randint(0, TINY.vocab_size, (3, 6), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        batch = make_cache(TINY, 8, batch=3)
        fast(tokens[:, :5], batch, 0)  # three different prompts
        rows = GraphDecoder(fast, batch, use_graph=False).step(tokens[:, 5]).clone()
        assert rows.shape == (3, TINY.vocab_size) and batch.length == 6
        for b in range(3):
            one = make_cache(TINY, 8)
            one.k[:, 0], one.v[:, 0], one.length = batch.k[:, b], batch.v[:, b], 5
            one.k[:, :, :, 5:] = 0
            one.v[:, :, :, 5:] = 0
            assert torch.equal(GraphDecoder(fast, one, use_graph=False).step(tokens[b, 5]), rows[b]), b
            assert torch.equal(one.k[:, 0, :, 5], batch.k[:, b, :, 5]) and torch.equal(one.v[:, 0, :, 5], batch.v[:, b, :, 5])


def test_greedy_ids_are_torch_argmax():
    """greedy_ids against torch.argmax: rows over several programs, masked tails, ties (the first
    index wins, across programs too), all-negative rows, -0.0 against 0.0; its state is left for the
    next call and pos advances once."""
    from localllm.kernels.triton_decode import ARGMAX_BLOCK, greedy_ids, greedy_state

    g = torch.Generator().manual_seed(11)
    t, v = 4, 2 * ARGMAX_BLOCK + 77
    best, count = greedy_state(t, "cpu")
    pos, out = torch.tensor([5], dtype=torch.int32), torch.empty(t, dtype=torch.int64)
    for trial in range(3):
        x = torch.randn(t, v, generator=g)
        x[0, v // 3:] = float("-inf")
        x[1, [v - 1, ARGMAX_BLOCK + 3, 17]] = x[1].max() + 1  # a three-way tie over three programs
        x[2] = -x[2].abs() - 1
        x[3] = -x[3].abs()
        x[3, [ARGMAX_BLOCK + 9, 40]] = torch.tensor([0.0, -0.0])  # equal maxima: the first (40) wins
        greedy_ids(x, out, best, count, pos, 1)
        assert torch.equal(out, x.argmax(-1)) and out[1] == 17 and out[3] == 40, trial
        assert pos.item() == 6 + trial
        assert torch.equal(greedy_state(t, "cpu")[0], best) and not count.any()


@pytest.mark.parametrize("wtype", ["Q4_0", "f32"])
def test_greedy_step_gives_the_argmax_of_plain_steps(wtype, monkeypatch):
    """GraphDecoder(greedy=True).step_greedy of B = 2 sequences: its ids (fed back as they are) are
    the argmax of a plain decoder's logits, step after step, and its logits are those logits."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=8)
    fast = graph_model(state)
    prompt = torch.randint(0, TINY.vocab_size, (2, 5), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        caches = make_cache(TINY, 9, batch=2), make_cache(TINY, 9, batch=2)
        for c in caches:
            fast(prompt, c, 0)
        greedy = GraphDecoder(fast, caches[0], use_graph=False, greedy=True)
        plain = GraphDecoder(fast, caches[1], use_graph=False)
        ids = want = prompt[:, -1]
        for _ in range(3):
            ids = greedy.step_greedy(ids)
            logits = plain.step(want)
            want = logits.argmax(-1)
            assert torch.equal(greedy.logits, logits) and torch.equal(ids, want)
        assert caches[0].length == 8 and greedy.pos.item() == 8 and torch.equal(caches[0].k, caches[1].k)


@pytest.mark.parametrize("wtype", ["Q4_K_M", "Q8_0", "f32"])
def test_verify_step_rows_equal_plain_steps(wtype, monkeypatch):
    """A step of 3 tokens (speculative decoding's verify pass on CUDA) gives each token's logits and
    cache rows bit for bit as 3 one-token steps do: greedy verification keeps plain decoding's ids."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(TINY, wtype, "cpu", seed=3)
    fast = graph_model(state)
    tokens = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        cache = make_cache(TINY, 8)
        fast(tokens[:, :5], cache, 0)
        rows = GraphDecoder(fast, cache, use_graph=False, tokens=3).step(tokens[0, 5:8]).clone()
        k, v = cache.k[:, :, :, 5:8].clone(), cache.v[:, :, :, 5:8].clone()
        cache.length = 5
        cache.k[:, :, :, 5:8] = 0
        one = GraphDecoder(fast, cache, use_graph=False)
        for i in range(3):
            assert torch.equal(one.step(tokens[0, 5 + i]), rows[i]), i
    assert cache.length == 8
    assert torch.equal(cache.k[:, :, :, 5:8], k) and torch.equal(cache.v[:, :, :, 5:8], v)


@pytest.mark.parametrize("dtype,norm,fixed", [(torch.float32, False, True), (torch.float16, False, True),
                                              (torch.float32, True, True), (torch.float32, True, False)])
def test_dense_kernel_rows_are_batch_invariant(dtype, norm, fixed):
    """kernels/triton_dense.py: each x row's output is the same bits whatever the other rows, and
    matches the fp32 product of the values it multiplies (RMSNorm's, with norm) plus the residual:
    added into an int64 fixed-point accumulator with K split between programs (fixed), or finished
    by one program per tile (fp32 residual)."""
    from localllm.kernels import triton_dense

    g = torch.Generator().manual_seed(21)
    w = torch.randn(200, 512, generator=g).to(dtype)
    x, r = torch.randn(6, 512, generator=g), torch.randn(6, 200, generator=g)
    nw = (1 + 0.1 * torch.randn(512, generator=g)) if norm else None
    assert not fixed or triton_dense.dense_split(200, 512, x.device) > 1  # K is cut between programs

    def run(rows):
        if fixed:
            acc = to_fixed(r[rows])
            triton_dense.gemv_dense(x[rows], w, residual=acc, inplace=True, norm_weight=nw, eps=1e-5,
                                    act_dtype=torch.float32)
            return acc
        return triton_dense.gemv_dense(x[rows], w, residual=r[rows], norm_weight=nw, eps=1e-5, act_dtype=torch.float32)

    y = run(slice(None))
    for i in range(6):
        assert torch.equal(run(slice(i, i + 1)), y[i:i + 1]), i
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw if norm else x
    assert rel(from_fixed(y), r + xn.to(dtype).float() @ w.float().T) < 1e-6


def test_split_k_is_deterministic_and_leaves_counters_zero(quantized):
    """Split K sums its parts in part order (triton_epilogue.split_finish): the same call twice gives the
    same bits, one row alone the same bits as in a batch, and the counters are zero afterwards."""
    qtype, _, w = quantized
    from localllm.kernels import triton_q8, triton_quant_act

    def product(x, r, split, counters=None):  # the decode step's kernel for this type
        if qtype in INT_DOT_TYPES:
            return triton_q8.gemv_q8(triton_quant_act.quantize_act(x), w.to_blocks(), residual=r, split=split,
                                     act_dtype=torch.float32, counters=counters)
        return triton_gemv.gemv(x, w, residual=r, split=split, act_dtype=torch.float32, counters=counters)

    g = torch.Generator().manual_seed(22)
    x, r = torch.randn(3, 512, generator=g), torch.randn(3, 40, generator=g)
    counters = torch.zeros(triton_epilogue.COUNTERS, dtype=torch.int32)
    a = product(x, r, 4, counters)
    assert not counters.any()
    assert torch.equal(a, product(x, r, 4, counters))
    assert torch.equal(product(x[1:2], r[1:2], 4), a[1:2])
    assert rel(a, product(x, r, 1)) < 1e-6


def test_fixed_point_accumulators_read_like_fp32_ones():
    """q|k|v and gate/up sums split over K add into int64 fixed-point accumulators (triton_epilogue.FIXED_ONE):
    the parts' sum equals the fp32 product, and their readers (rope_store, quantize_act's GLU form)
    give what they give for fp32 sums, clearing the accumulator."""
    from localllm.kernels import triton_q8, triton_quant_act

    g = torch.Generator().manual_seed(23)
    w = QWeight.from_raw(torch.from_numpy(quantize_tensor(torch.randn(64, 512, generator=g), Q.Q8_0)), Q.Q8_0)
    xa = triton_quant_act.quantize_act(torch.randn(2, 512, generator=g))
    acc = torch.zeros(2, 64, dtype=torch.int64)
    triton_q8.gemv_q8(xa, w.to_blocks(), residual=acc, inplace=True, split=4, act_dtype=torch.float32)
    want = triton_q8.gemv_q8(xa, w.to_blocks(), act_dtype=torch.float32)
    assert rel(acc.double() / triton_epilogue.FIXED_ONE.value, want) < 1e-7

    def fixed(t):
        return (t.double() * triton_epilogue.FIXED_ONE.value).long()

    gu = torch.randn(2, 128, generator=g)
    gi = fixed(gu)
    want = triton_quant_act.quantize_act(gi.double().div(triton_epilogue.FIXED_ONE.value).float(), glu_dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(triton_quant_act.quantize_act(gi, glu_dtype=torch.float32), want))
    assert not gi.any()
    H, HKV, D = 4, 2, 64
    qkv = fixed(torch.randn(1, (H + 2 * HKV) * D, generator=g))
    values = qkv.double().div(triton_epilogue.FIXED_ONE.value).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.tensor([3], dtype=torch.int32)
    caches = [torch.zeros(HKV, 8, D) for _ in range(4)]
    want = triton_attention.rope_store(values, caches[0], caches[1], pos, inv_freq, H, HKV, D)
    got = triton_attention.rope_store(qkv, caches[2], caches[3], pos, inv_freq, H, HKV, D, clear=True)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not qkv.any()
