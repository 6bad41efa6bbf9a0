"""decode_slots' CUDA step (backends/cuda_slots.py: GraphDecoder's kernels over rows that are slots of one
cache, each at its own position; eager here) on the CPU under Triton's interpreter, like
tests/test_triton_kernels.py.

Oracles: each row bit for bit as the same slot decoded alone (bucket 1) and as GraphDecoder's plain
batch-1 step of that sequence (batch invariance: serve's streams equal the request served alone); the
fp32 portable decode_slots (slots.py over model.py) within the tolerance of test_triton_kernels'
decode steps (the reference quantizing integer-product inputs as the kernels do); cache rows written
at (slot, position) only (padding rows and other slots untouched).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gguf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import localllm.synthetic as synthetic  # noqa: E402
from dataclasses import replace  # noqa: E402

from test_triton_kernels import TINY, graph_model, quantize_inputs_like, rel  # noqa: E402  (re-decorates first)
from test_triton_families import GEMMA  # noqa: E402
from localllm import slots as slot_steps  # noqa: E402
from localllm.backends import cuda_slots  # noqa: E402
from localllm.backends.cuda_graph import GraphDecoder  # noqa: E402
from localllm.cache import KVCache, make_cache  # noqa: E402
from localllm.kernels import triton_epilogue  # noqa: E402
from localllm.kernels.linear import dequantize_qweight  # noqa: E402
from localllm.kernels.triton_epilogue import from_fixed  # noqa: E402
from localllm.kernels.qweight import QWeight  # noqa: E402
from localllm.kernels.triton_q8 import gemv_q8  # noqa: E402
from localllm.kernels.triton_quant_act import quantize_act  # noqa: E402
from localllm.load import build_model  # noqa: E402
from localllm.quantize import quantize_tensor  # noqa: E402

# small shapes: interpreted steps cost seconds each (head_dim 32: the attention's int8 output path)
# (one layer: what a layer does to each row is the same in every layer; Gemma's a sliding one)
SMALL = replace(TINY, dim=128, ffn_dim=128, head_dim=32, n_layers=1)
SMALL_GEMMA = replace(GEMMA, dim=128, ffn_dim=128, head_dim=32, n_layers=1, sliding_layers=(True,))
PROMPTS = [3, 6, 1, 4]  # slot s holds PROMPTS[s] positions: the step's rows at different positions
CAP = 9


def prefilled(model, cfg, seqs) -> slot_steps.Slots:
    slots = slot_steps.new_slots(make_cache(cfg, CAP, batch=len(PROMPTS)))
    for s, p in enumerate(PROMPTS):
        model(torch.tensor([seqs[s][:p]]), slot_steps.slot_view(slots.cache, s, 0), 0)
        slots.lengths[s] = p
    return slots


def copy(slots: slot_steps.Slots) -> slot_steps.Slots:
    return slot_steps.Slots(KVCache(slots.cache.k.clone(), slots.cache.v.clone(), 0), list(slots.lengths))


def three_slot_step(cfg, wtype: str, monkeypatch):
    """A synthetic model of cfg as the graph decoder's, random sequences per slot, and one step's inputs:
    slots 2, 0, 3 (slot 1 not in it) at their PROMPTS positions -> (state, model, seqs, which, tokens)."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    state, _ = synthetic.synthetic_state(cfg, wtype, "cpu", seed=5)
    fast = graph_model(state, cfg)
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, cfg.vocab_size, (CAP,), generator=g).tolist() for _ in PROMPTS]
    which = [2, 0, 3]
    return state, fast, seqs, which, torch.tensor([seqs[s][PROMPTS[s]] for s in which])


@pytest.mark.parametrize("cfg,wtype", [(SMALL, "Q8_0"), (SMALL, "f32"), (SMALL_GEMMA, "Q8_0")], ids=["llama-q8", "llama-f32",
                                                                                            "gemma-q8"])
def test_slot_rows_equal_each_slot_alone(cfg, wtype, monkeypatch):
    """A step of 3 slots (bucket 4: one padding row) at positions 1, 4, 3; slot 1 not in it."""
    state, fast, seqs, which, tokens = three_slot_step(cfg, wtype, monkeypatch)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False).model
    with torch.inference_mode():
        slots = prefilled(fast, cfg, seqs)
        before = copy(slots)
        rows = cuda_slots.decode_slots(fast, slots, which, tokens, use_graph=False).clone()
        assert rows.shape == (3, cfg.vocab_size) and rows.dtype == torch.float32
        assert [slots.lengths[s] for s in range(4)] == [4, 6, 2, 5]
        assert set(slots.tables[("cuda", False)]) == {4}  # the bucket of 3 rows
        # only (slot, position) rows written: slot 1 untouched, the others' earlier rows kept
        k, k0 = slots.cache.k, before.cache.k
        assert torch.equal(k[:, 1], k0[:, 1])
        for s in which:
            p = PROMPTS[s]
            assert torch.equal(k[:, s, :, :p], k0[:, s, :, :p]) and torch.equal(k[:, s, :, p + 1:], k0[:, s, :, p + 1:])
            assert not torch.equal(k[:, s, :, p], k0[:, s, :, p])
        alone = copy(before)
        for i, s in enumerate(which):  # each slot alone: bucket 1, the same bits and cache row
            one = cuda_slots.decode_slots(fast, alone, [s], tokens[i:i + 1], use_graph=False)
            assert torch.equal(one[0], rows[i]), s
            assert torch.equal(alone.cache.k[:, s], k[:, s]) and torch.equal(alone.cache.v[:, s], slots.cache.v[:, s])
        # GraphDecoder's batch-1 step of slot 0's sequence (the plain decode path's kernels)
        plain = make_cache(cfg, CAP)
        plain.k[:, 0], plain.v[:, 0], plain.length = before.cache.k[:, 0], before.cache.v[:, 0], PROMPTS[0]
        assert torch.equal(GraphDecoder(fast, plain, use_graph=False).step(tokens[1]), rows[1])
        # the fp32 portable step
        ref_slots = prefilled(ref, cfg, seqs)
        quantize_inputs_like(ref, fast)
        want = slot_steps.decode_slots(ref, ref_slots, which, tokens)
    for i in range(3):
        assert rel(rows[i], want[i]) < (1e-5 if wtype == "f32" else 2e-3), which[i]


def test_buckets():
    assert [cuda_slots.bucket(n) for n in (1, 2, 3, 5, 16, 17, 33, 64, 65, 130)] == [1, 2, 4, 8, 16, 32, 64, 64, 128,
                                                                                     192]


def test_products_of_many_rows_take_groups_of_eight_with_each_row_alone_bits():
    """16 x rows (a bucket of 16 slots): programs of 8 rows (each weight tile read twice, not 16 times),
    every row's sum the bits of that row alone."""
    assert [triton_epilogue.rows_per_program(m) for m in (1, 5, 8, 12, 16, 64, 65)] == [1, 5, 8, 6, 8, 8, 5]
    g = torch.Generator().manual_seed(9)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w = QWeight.from_raw(torch.from_numpy(quantize_tensor(torch.randn(40, 256, generator=g), q8)), q8).to_blocks()
    x = torch.randn(16, 256, generator=g)
    many = gemv_q8(quantize_act(x), w, act_dtype=torch.float32)
    for m in (0, 5, 8, 15):  # rows of both groups of 8
        assert torch.equal(gemv_q8(quantize_act(x[m:m + 1]), w, act_dtype=torch.float32)[0], many[m]), m
    assert rel(many, x @ dequantize_qweight(w).T) < 2e-2  # (int8 x: quantize_act's rounding)
    # the decode step's form: split K into an int64 fixed-point accumulator (tile-major row groups)
    acc = torch.zeros(16, 40, dtype=torch.int64)
    gemv_q8(quantize_act(x), w, residual=acc, inplace=True, split=2, act_dtype=torch.float32)
    for m in (0, 5, 8, 15):  # rows of both groups of 8
        one = torch.zeros(1, 40, dtype=torch.int64)
        gemv_q8(quantize_act(x[m:m + 1]), w, residual=one, inplace=True, split=2, act_dtype=torch.float32)
        assert torch.equal(one[0], acc[m]), m
    assert rel(from_fixed(acc), many) < 1e-5


@pytest.mark.parametrize("gqa", [True, False])
def test_attention_and_rope_rows_read_their_own_slot_and_position(gqa):
    """decode_attention / rope_store with slots: row r is slot slots[r] at pos[r], the bits of a batch-1
    call on that slot's cache at that position (both attention kernels: GQA tiles, one program a head)."""
    from localllm.kernels.triton_attention import decode_attention, rope_store

    g = torch.Generator().manual_seed(3)
    H, HKV, D, S = 4, 2, 16, 80  # 80 rows: two chunks
    kc, vc = torch.randn(3, HKV, S, D, generator=g), torch.randn(3, HKV, S, D, generator=g)
    slots, pos = [2, 0, 1], [70, 1, 33]
    q = torch.randn(3 * H, D, generator=g)
    index, at = torch.tensor(slots, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)
    rows = decode_attention(q, kc, vc, at, HKV, gqa=gqa, slots=index)
    for r, (s, p) in enumerate(zip(slots, pos)):
        one = decode_attention(q[r * H:(r + 1) * H], kc[s], vc[s], torch.tensor([p], dtype=torch.int32), HKV, gqa=gqa)
        assert torch.equal(one[0], rows[r]), r
    if not gqa:
        return
    qkv = torch.randn(3, (H + 2 * HKV) * D, generator=g)
    k2, v2 = kc.clone(), vc.clone()
    freq = torch.rand(D // 2, generator=torch.Generator().manual_seed(3))
    k3, v3 = kc.clone(), vc.clone()
    qr = rope_store(qkv, k2, v2, at, freq, H, HKV, D, slots=index)
    for r, (s, p) in enumerate(zip(slots, pos)):
        one = rope_store(qkv[r:r + 1], k3[s], v3[s], torch.tensor([p], dtype=torch.int32), freq, H, HKV, D)
        assert torch.equal(one, qr[r * H:(r + 1) * H]), r
    assert torch.equal(k2, k3) and torch.equal(v2, v3)  # each row's k, v at (slot, position), nothing else


def test_warm_up_runs_every_bucket_and_leaves_the_slots_as_they_were(monkeypatch):
    """serve's start-up warm-up (cuda_slots.warm_up, eager here: no graphs): a step of 1, 2 and 4 slots
    makes the decoders of buckets 1, 2 and 4; lengths are restored, and the next step's rows are the bits
    of the same step without the warm-up (the rows it wrote are overwritten)."""
    _, fast, seqs, which, tokens = three_slot_step(SMALL, "Q8_0", monkeypatch)
    with torch.inference_mode():
        slots = prefilled(fast, SMALL, seqs)
        cold = copy(slots)
        assert cuda_slots.warm_up(fast, slots, use_graph=False) == 0  # (eager: nothing captured)
        assert set(slots.tables[("cuda", False)]) == {1, 2, 4} and slots.lengths == PROMPTS
        warm = cuda_slots.decode_slots(fast, slots, which, tokens, use_graph=False).clone()
        want = cuda_slots.decode_slots(fast, cold, which, tokens, use_graph=False)
    assert torch.equal(warm, want)


@pytest.mark.parametrize("cfg,wtype,head", [(SMALL, "Q8_0", False), (SMALL, "Q8_0", True), (SMALL, "f32", False),
                                            (SMALL_GEMMA, "Q8_0", False)],
                         ids=["llama-q8", "llama-q8-head", "llama-f32", "gemma-q8"])
def test_dense_steps_multiply_the_decoded_copies(cfg, wtype, head, monkeypatch):
    """A bucket of dense_rows or more rows whose layer weights have dense values (the quantized
    weights' decoded copies, keep_dense_prompt_weights; an f32 model's own) is a dense step: its layer
    products take float x through F.linear, so its rows are the fp32 reference's with only the head's
    input through int8 where the head has no copy (its kernel), well within the kernels' int8 error,
    and it writes the same cache rows only."""
    from localllm.backends.cuda import keep_dense_prompt_weights
    from localllm.quantize.act import dequantize_act, quantize_act as int8_act

    state, fast, seqs, which, tokens = three_slot_step(cfg, wtype, monkeypatch)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False).model
    with torch.inference_mode():
        kept = keep_dense_prompt_weights(fast, torch.float32, 1 << 40, head=head)
        assert (kept > 0) == (wtype != "f32")
        slots = prefilled(fast, cfg, seqs)
        before = copy(slots)
        rows = cuda_slots.decode_slots(fast, slots, which, tokens, use_graph=False, dense_rows=4).clone()
        assert slots.tables[("cuda", False)][4].dense
        kernels = cuda_slots.decode_slots(fast, copy(before), which, tokens, use_graph=False).clone()
        for s in range(4):  # the same rows written as the kernels' step writes, nothing else
            p = PROMPTS[s]
            k, k0 = slots.cache.k[:, s], before.cache.k[:, s]
            assert torch.equal(k[:, :, :p], k0[:, :, :p]) and torch.equal(k[:, :, p + 1:], k0[:, :, p + 1:])
            assert torch.equal(k[:, :, p], k0[:, :, p]) == (s not in which)
        ref_slots = prefilled(ref, cfg, seqs)
        if wtype != "f32" and not head:  # the head's int8 input, as its kernel takes it
            def through_int8(_m, _args, y):
                q, d, _ = int8_act(y.reshape(-1, y.shape[-1]))
                return dequantize_act(q, d).reshape(y.shape)
            ref.output_norm.register_forward_hook(through_int8)
        want = slot_steps.decode_slots(ref, ref_slots, which, tokens)
    for i in range(3):
        assert rel(rows[i], want[i]) < 2e-5, which[i]
        if wtype != "f32":  # the kernels' step: int8 x in every product
            assert rel(kernels[i], want[i]) > 1e-4, which[i]


def test_a_dense_models_many_slots_take_one_dense_pass(monkeypatch):
    """An f32 model's step of 20 slots: with dense_rows 32 one dense pass (bucket 32), else passes of
    DENSE_ROWS (16 + 4: the batch-invariant dense kernel's limit); both the fp32 reference's rows."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 32)
    cfg = SMALL
    state, _ = synthetic.synthetic_state(cfg, "f32", "cpu", seed=5)
    fast = graph_model(state, cfg)
    ref = build_model(cfg, dict(state), "cpu", torch.float32, keep_quantized=False).model
    n, g = 20, torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, cfg.vocab_size, (3,), generator=g).tolist() for _ in range(n)]
    which, tokens = list(range(n)), torch.tensor([s[2] for s in seqs])
    with torch.inference_mode():
        ref_slots = slot_steps.new_slots(make_cache(cfg, 4, batch=n))
        for s in which:
            ref(torch.tensor([seqs[s][:2]]), slot_steps.slot_view(ref_slots.cache, s, 0), 0)
            ref_slots.lengths[s] = 2
        want = slot_steps.decode_slots(ref, ref_slots, which, tokens)
        for rows, buckets in ((32, {32}), (0, {16, 4})):
            slots = slot_steps.new_slots(make_cache(cfg, 4, batch=n))
            for s in which:
                fast(torch.tensor([seqs[s][:2]]), slot_steps.slot_view(slots.cache, s, 0), 0)
                slots.lengths[s] = 2
            got = cuda_slots.decode_slots(fast, slots, which, tokens, use_graph=False, dense_rows=rows)
            found = slots.tables[("cuda", False)]
            assert set(found) == buckets and all(d.dense == (rows > 0) for d in found.values())
            assert rel(got, want) < 1e-5 and slots.lengths == [3] * n
