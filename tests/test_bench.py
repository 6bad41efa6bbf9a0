"""`localllm bench` on the CPU with synthetic models: rows for every test of the grid, sane figures,
all three output formats; synthetic weights are non-zero and of the asked types."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

import localllm.synthetic as synthetic
from localllm.cli import app
from localllm.commands.bench import BenchModel, bench_model, format_rows, weight_bytes_per_token
from localllm.config import ModelConfig
from localllm.registry import shape_preset

TINY = ModelConfig(arch="llama", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, head_dim=64,
                   vocab_size=300, context_length=128, norm_eps=1e-5, rope_theta=10000.0)
ROOF = {"bandwidth": 1e10, "flops": 1e11}


def test_synthetic_q4_k_m_types_and_nonzero(monkeypatch):
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 16)
    cfg = shape_preset("llama-3.2-1b")
    assert synthetic.tensor_type("output.weight", "Q4_K_M", cfg).name == "Q6_K"
    picked = [synthetic.tensor_type(f"blk.{i}.ffn_down.weight", "Q4_K_M", cfg).name for i in range(cfg.n_layers)]
    assert picked.count("Q6_K") == sum(synthetic.use_more_bits(i, cfg.n_layers) for i in range(cfg.n_layers))
    rt, types = synthetic.synthetic_model(TINY, "Q4_K_M", "cpu", torch.float32)
    assert set(types) == {"Q4_K", "Q6_K", "float32"}
    assert all(p.abs().sum() > 0 for p in rt.model.parameters())


def test_bench_rows_for_the_grid():
    rt, types = synthetic.synthetic_model(TINY, "f32", "cpu", torch.float32)
    rows = bench_model(BenchModel("tiny", rt, types), [8, 16], [4], [0, 8], 2, ROOF)
    assert [r.test for r in rows] == ["pp8", "tg4 after pp8", "pp16", "tg4 after pp16",
                                      "pp8 @ d8", "tg4 after pp8 @ d8", "pp16 @ d8", "tg4 after pp16 @ d8"]
    assert all(r.tps_mean > 0 and r.roofline_share > 0 for r in rows)
    tg = rows[1]  # bytes read per step: the weights, and k, v of every layer at the mean context 8 + 4 / 2
    kv = 2 * TINY.n_layers * TINY.n_kv_heads * TINY.head_dim * (8 + 4 / 2) * 4
    assert abs(tg.achieved * 1e9 - (weight_bytes_per_token(rt.model) + kv) * tg.tps_mean) < 1e-3 * tg.achieved * 1e9
    assert "| tiny |" in format_rows(rows, ROOF, "md")
    assert len(json.loads(format_rows(rows, ROOF, "json"))["rows"]) == 8
    assert format_rows(rows, ROOF, "csv").count("\n") == 9


def test_bench_batch_rows_and_bytes():
    """-b 2: two prompts at once; tokens/s counts both, the bytes read per step are the weights once and
    both sequences' k, v."""
    rt, types = synthetic.synthetic_model(TINY, "f32", "cpu", torch.float32)
    rows = bench_model(BenchModel("tiny", rt, types), [8], [4], [0], 1, ROOF, batches=[2])
    assert [r.test for r in rows] == ["pp8 b2", "tg4 after pp8 b2"]
    tg = rows[1]
    kv = 2 * 2 * TINY.n_layers * TINY.n_kv_heads * TINY.head_dim * (8 + 4 / 2) * 4
    assert abs(tg.achieved * 1e9 - (weight_bytes_per_token(rt.model) + kv) * tg.tps_mean / 2) < 1e-3 * tg.achieved * 1e9


def test_decode_rows_match_one_sequence_at_a_time():
    """Runtime.prefill / decode of a batch on the CPU: each sequence gets the logits that prefill /
    decode_one give it alone."""
    from localllm.generate import decode_one, prefill

    rt, _ = synthetic.synthetic_model(TINY, "f32", "cpu", torch.float32)
    ids = torch.randint(0, TINY.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = rt.new_cache(8, 2)
        first = rt.prefill(cache, ids[:, :5].tolist())
        step = rt.decode(cache, ids[:, 5])
        for b in range(2):
            one = rt.new_cache(8)
            assert torch.allclose(prefill(rt, one, ids[b, :5].tolist()), first[b], atol=1e-5)
            assert torch.allclose(decode_one(rt, one, ids[b, 5]), step[b], atol=1e-5)


def test_cli_bench_synthetic_json():
    result = CliRunner().invoke(app, ["bench", "--synthetic", "smollm2-135m", "--type", "Q8_0", "-p", "4", "-n", "2",
                                      "-r", "1", "--device", "cpu", "--dtype", "float32", "-o", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [r["test"] for r in out["rows"]] == ["pp4", "tg2 after pp4"]
    assert out["rows"][0]["types"].startswith("Q8_0")


def test_cli_bench_needs_a_model():
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 1
