"""write_synthetic_gguf (the files bench/vs_llamacpp_gpu.py gives llama-bench): the gguf package's reader
sees the asked file type, tensor types and the vocabulary's own tokenizer keys; our loader reads back
synthetic_state's very tensors (quantized blocks byte for byte, dense ones as the stored dtype rounds
them, q/k rows un-permuted) and the config they were made from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch

from localllm import synthetic
from localllm.config import ModelConfig, RopeScaling
from localllm.gguf_file import open_gguf
from localllm.load import load_model, read_gguf_model
from localllm.commands.quantize_cmd import read_gguf_metadata
from localllm.synthetic import synthetic_state, write_synthetic_gguf
from localllm.weights import QuantizedTensor

Q = gguf.GGMLQuantizationType
VOCAB = Path(__file__).resolve().parent / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"
# Llama-shaped, small; dim 256 keeps K-quants whole, head_dim 64 with llama3 rope scaling (rope_freqs).
TINY = ModelConfig(arch="llama", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, head_dim=64,
                   vocab_size=32000, context_length=4096, norm_eps=1e-5, rope_theta=500000.0,
                   rope_scaling=RopeScaling(factor=8.0))
STORED = {"F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(scope="module")
def tokenizer() -> dict:
    assert VOCAB.is_file(), f"vocab test data missing: {VOCAB}"
    return read_gguf_metadata(VOCAB, keep=lambda key: key.startswith("tokenizer."))


@pytest.mark.parametrize("wtype", ["F16", "BF16", "Q8_0", "Q4_K_M", "MXFP4"])
def test_written_file_reads_back_as_synthetic_state(tmp_path, monkeypatch, tokenizer, wtype):
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 16)  # K-quant encoding on the CPU is slow
    path = write_synthetic_gguf(TINY, wtype, tmp_path / f"tiny-{wtype}.gguf", tokenizer)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left

    reader = gguf.GGUFReader(path)
    file_type = reader.fields["general.file_type"]
    want_type = {"MXFP4": "MOSTLY_MXFP4_MOE"}.get(wtype, f"MOSTLY_{wtype}")  # llama-quantize's name
    assert int(file_type.parts[file_type.data[0]][0]) == gguf.LlamaFileType[want_type]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]) for i in tokens.data] == tokenizer["tokenizer.ggml.tokens"].value
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" in types and types["rope_freqs.weight"] == Q.F32
    assert types["blk.0.attn_norm.weight"] == Q.F32

    f = open_gguf(path)
    cfg, got, _ = read_gguf_model(f, "blocks")  # quantized tensors stay as their blocks
    # llama3 scaling travels as the rope_freqs tensor; the epsilon as a float32
    assert replace(cfg, norm_eps=TINY.norm_eps) == replace(TINY, rope_scaling=None)
    assert cfg.norm_eps == pytest.approx(TINY.norm_eps)
    want, _ = synthetic_state(TINY, wtype, "cpu")
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, QuantizedTensor):
            assert isinstance(g, QuantizedTensor) and g.qtype == w.qtype, name
            assert torch.equal(g.data, w.data), name
        else:
            stored = STORED.get(wtype, torch.float16) if w.dim() == 2 else torch.float32
            assert torch.equal(g.float(), w.to(stored).float()), name


def test_written_file_loads_and_runs(tmp_path, tokenizer):
    path = write_synthetic_gguf(TINY, "Q8_0", tmp_path / "tiny.gguf", tokenizer)
    lm = load_model(str(path), "cpu", torch.float32, keep_quantized=False)
    assert lm.tensor_types == {"Q8_0": 7 * TINY.n_layers + 1, "F16": 1, "F32": 2 * TINY.n_layers + 2}
    ids = lm.tokenizer.encode("Hello world", add_bos=True, parse_special=False)
    assert ids[0] == 1 and len(ids) > 2
    from localllm.cache import make_cache

    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), make_cache(lm.config, 16, dtype=torch.float32), 0)
    assert logits.shape == (1, len(ids), TINY.vocab_size) and torch.isfinite(logits).all()


def small_family(preset: str) -> ModelConfig:
    """A family preset's fields (windows, soft-caps, post norms, rope sets, LongRoPE) on small widths."""
    from localllm.registry import shape_preset

    cfg = shape_preset(preset)
    small = dict(n_layers=6, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=32000)
    if cfg.sliding_layers:
        small["sliding_layers"] = cfg.sliding_layers[:6]
    if cfg.rotary_dim:
        small["rotary_dim"] = 48
    if cfg.embed_scale != 1.0:  # Gemma: sqrt(dim), and the scale of its key length (what a GGUF implies)
        small |= {"embed_scale": 256**0.5, "attn_scale": 64**-0.5}
    if cfg.n_experts:
        small |= {"n_experts": 8, "n_experts_used": 2, "expert_ffn_dim": 256}
    return replace(cfg, **small)


@pytest.mark.parametrize("preset", ["gemma-3-4b", "phi-4-mini", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_family_file_reads_back_as_its_config_and_weights(tmp_path, monkeypatch, tokenizer, preset):
    """The family's keys (Gemma's sliding window and linear rope scaling; Phi-3's rotated dims, LongRoPE
    tensors and attention factor, q|k|v and gate|up fused as its checkpoints hold them; the experts'
    counts, 3-D stacks and gpt-oss's YaRN, sinks and windows) read back as the config, and the loader's
    tensors are synthetic_state's."""
    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 16)
    cfg = small_family(preset)
    path = write_synthetic_gguf(cfg, "Q4_K_M", tmp_path / "f.gguf", tokenizer)
    if cfg.arch == "phi3":
        names = {t.name for t in gguf.GGUFReader(path).tensors}
        assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    _, got, _ = read_gguf_model(open_gguf(path), "blocks")
    read = load_model(str(path), "cpu").config
    for field in ("norm_eps", "rope_attn_factor"):  # float32 keys
        assert getattr(read, field) == pytest.approx(getattr(cfg, field), rel=1e-6)
    assert replace(read, norm_eps=cfg.norm_eps, rope_attn_factor=cfg.rope_attn_factor) == cfg
    want, _ = synthetic_state(cfg, "Q4_K_M", "cpu")
    for name, w in want.items():
        if isinstance(w, QuantizedTensor):
            assert got[name].qtype == w.qtype and torch.equal(got[name].data, w.data), name


@pytest.mark.parametrize("preset,wtype", [("qwen3-30b-a3b", "Q4_K_M"), ("gpt-oss-20b", "Q4_K_M"),
                                          ("gpt-oss-20b", "MXFP4_MOE"), ("llama-3.2-1b", "Q4_K_M")])
def test_synthetic_types_are_llama_quantizes(monkeypatch, preset, wtype):
    """The synthetic files' tensor types are what our port of llama-quantize's rules (quantize/presets.py,
    tested against llama.cpp's choices) gives the same tensors: the benchmarks compare like with like
    (the router stays dense, experts' ffn_down follows ffn_down's rule, MXFP4_MOE's experts MXFP4)."""
    from localllm.quantize.presets import ModelShape, fallback, find_preset, preset_types
    from localllm.weights import gguf_name

    monkeypatch.setattr(synthetic, "SAMPLE_ROWS", 16)
    cfg = small_family(preset) if preset != "llama-3.2-1b" else replace(TINY, n_layers=9)
    state, _ = synthetic_state(cfg, wtype, "cpu")
    tensors = [(gguf_name(n), tuple(v.shape) if not isinstance(v, QuantizedTensor) else None, v)
               for n, v in state.items() if n != "token_embd.weight"]
    shapes = [(n, s if s is not None else quantized_shape(n, cfg)) for n, s, _ in tensors]
    want = preset_types(find_preset(wtype), shapes, ModelShape(cfg.arch, cfg.n_layers, cfg.n_heads,
                                                               cfg.n_kv_heads, cfg.n_experts))
    for (name, _, v), (_, shape), t in zip(tensors, shapes, want):
        t = None if t is None or t == Q.F32 else fallback(t, shape[-1])
        got = v.qtype if isinstance(v, QuantizedTensor) else None
        assert got == t or (t is not None and got is None and len(shape) < 2), (name, got, t)


def quantized_shape(name: str, cfg) -> tuple[int, ...]:
    """The (numpy-order) shape of a linear weight the synthetic state holds as raw blocks."""
    from localllm.validate import expected_shapes

    return tuple(expected_shapes(cfg)[name])


def test_random_blocks_file_holds_synthetic_states_blocks(tmp_path, tokenizer):
    """write_synthetic_gguf(random_blocks=True) (bench/tp_vs_llamacpp.py's files): the state's random
    blocks byte for byte, as the quantized path's are."""
    path = write_synthetic_gguf(TINY, "Q4_K_M", tmp_path / "r.gguf", tokenizer, random_blocks=True)
    _, got, _ = read_gguf_model(open_gguf(path), "blocks")
    want, _ = synthetic_state(TINY, "Q4_K_M", "cpu", random_blocks=True)
    quantized = [n for n, w in want.items() if isinstance(w, QuantizedTensor)]
    assert len(quantized) > 10
    for name in quantized:
        assert got[name].qtype == want[name].qtype and torch.equal(got[name].data, want[name].data), name
