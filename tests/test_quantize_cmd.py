"""`localllm quantize`: llama.cpp's per-tensor types for each preset, files that load and decode
exactly as the gguf package decodes them, metadata copied, all-or-nothing writing, one-line errors.

Oracles: the per-tensor types written out below from llama.cpp's llama_tensor_get_type (and the
default model's own Q4_1 file, made by llama-quantize); gguf.quants.dequantize of the written
blocks; tiny_gguf.write_gguf (what convert_hf_to_gguf writes) for safetensors input.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess

import gguf
import numpy as np
import pytest
import torch

import tiny_gguf
from tiny_hf import write_hf_folder
from tiny_raw import write_raw_gguf
from tiny_spec import TinySpec
from cli_helpers import assert_one_error
from cli_helpers import invoke_quantize as invoke
from localllm.cache import make_cache
from localllm.errors import LocalLLMError
from localllm.load import load_model
from localllm.commands.quantize_cmd import plan_model, quantize_model, read_gguf_metadata, tokenizer_metadata
from localllm.quantize import dequantize_torch, quantize_tensor
from localllm.quantize.plan import TensorInfo, parse_override, plan_table, preset_plan, total_bpw
from localllm.quantize.presets import PRESETS, ModelShape, more_bits, preset_types

Q = gguf.GGMLQuantizationType

# dim 64: every row of 64 values falls back from the K-quants; ffn_down's rows (256) take them.
SMALL = TinySpec("llama", dim=64, ffn_dim=256, n_heads=4, n_kv_heads=2, n_layers=2, seed=11)
IDS = torch.tensor([[1, 5, 9, 30, 40, 100, 200, 300]])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return tiny_gguf.write_gguf(SMALL, tmp_path_factory.mktemp("quantize") / "small-f32.gguf")


def fields(path_or_reader) -> dict:
    """key -> (GGUF types, value) of every metadata field."""
    r = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else gguf.GGUFReader(path_or_reader)
    return {k: (f.types, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}


def logits(path_or_lm) -> torch.Tensor:
    lm = load_model(str(path_or_lm), "cpu", torch.float32) if not hasattr(path_or_lm, "model") else path_or_lm
    return lm.model(IDS, make_cache(lm.config, IDS.shape[1]), 0)


# ---- 1. the plan: llama.cpp's rules

def llama_tensors(n_layers: int, dim=4096, kv=1024, ffn=14336, vocab=32000, tied=False):
    """(name, numpy shape) of a llama model as convert_hf_to_gguf lists them."""
    out = [("token_embd.weight", (vocab, dim))]
    for i in range(n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (dim,)), (p + "attn_q.weight", (dim, dim)), (p + "attn_k.weight", (kv, dim)),
                (p + "attn_v.weight", (kv, dim)), (p + "attn_output.weight", (dim, dim)),
                (p + "ffn_norm.weight", (dim,)), (p + "ffn_gate.weight", (ffn, dim)), (p + "ffn_up.weight", (ffn, dim)),
                (p + "ffn_down.weight", (dim, ffn))]
    out.append(("output_norm.weight", (dim,)))
    if not tied:
        out.append(("output.weight", (vocab, dim)))
    return out


# llama.cpp's use_more_bits(i, 30): i < 3, i >= 26, or (i - 3) % 3 == 2.
MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
SHAPE_30 = ModelShape("llama", 30, 32, 8)  # GQA 4


def expected_30(preset: str, tied: bool = False) -> dict[str, Q]:
    """The types llama-quantize gives a 30-layer llama (all rows multiples of 256), written out."""
    default = {"Q4_K_M": Q.Q4_K, "Q4_K_S": Q.Q4_K, "Q5_K_M": Q.Q5_K, "Q3_K_M": Q.Q3_K, "Q2_K": Q.Q2_K,
               "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q6_K": Q.Q6_K, "F16": Q.F16, "IQ4_NL": Q.IQ4_NL,
               "IQ4_XS": Q.IQ4_XS}[preset]
    out = {}
    for name, shape in llama_tensors(30, tied=tied):
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        t = default
        if len(shape) == 1:
            t = Q.F32
        elif name == "output.weight" or (tied and name == "token_embd.weight"):
            t = {"Q8_0": Q.Q8_0, "F16": Q.F16}.get(preset, Q.Q6_K)
        elif preset in ("Q4_K_M", "Q5_K_M") and ("attn_v" in name or "ffn_down" in name):
            t = Q.Q6_K if i in MORE_BITS_30 else default
        elif preset == "Q4_K_S" and "attn_v" in name:
            t = Q.Q5_K if i < 4 else default
        elif preset == "Q4_K_S" and "ffn_down" in name:
            t = Q.Q5_K if i < 3 else default  # 30 // 8
        elif preset == "Q3_K_M":
            if "attn_v" in name:
                t = Q.Q5_K if i < 2 else Q.Q4_K
            elif "ffn_down" in name:
                t = Q.Q5_K if i < 1 else Q.Q4_K  # 30 // 16
            elif "attn_output" in name:
                t = Q.Q4_K
        elif preset == "Q2_K":
            t = {"attn_v": Q.Q4_K, "ffn_down": Q.Q3_K, "attn_output": Q.Q3_K}.get(name.split(".")[-2], default)
        elif preset in ("IQ4_NL", "IQ4_XS") and "attn_v" in name:
            t = Q.Q5_K  # GQA 4
        elif preset in ("IQ4_NL", "IQ4_XS") and "ffn_down" in name:
            t = Q.Q5_K if i < 3 else default  # no imatrix: the first 30 // 8
        out[name] = t
    return out


def plan_types(tensors, preset: str, shape: ModelShape = SHAPE_30, overrides=()) -> dict[str, Q]:
    infos = [TensorInfo(n, s, Q.F16 if len(s) > 1 else Q.F32) for n, s in tensors]
    rows = preset_plan(PRESETS[preset], infos, shape, [parse_override(o) for o in overrides])
    return {r.name: r.target for r in rows}


def test_more_bits_layers():
    assert {i for i in range(30) if more_bits(i, 30)} == MORE_BITS_30


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q3_K_M", "Q2_K", "Q8_0", "Q4_0", "Q6_K", "F16",
                                    "IQ4_NL", "IQ4_XS"])
def test_plan_30_layers_matches_llama_cpp(preset):
    assert plan_types(llama_tensors(30), preset) == expected_30(preset)


def test_plan_tied_embeddings_and_file_order():
    # Tied: token_embd is quantized as the output. Counters follow layer numbers, not file order
    # (the default model's file lists blk.10 before blk.2).
    tensors = llama_tensors(30, tied=True)
    shuffled = sorted(tensors)
    assert plan_types(shuffled, "Q4_K_M") == expected_30("Q4_K_M", tied=True)
    assert plan_types(tensors, "Q4_K_M")["token_embd.weight"] == Q.Q6_K


def test_plan_70b_attn_v_and_gqa():
    tensors = llama_tensors(80, dim=8192, kv=1024, ffn=28672)
    types = plan_types(tensors, "Q4_K_M", ModelShape("llama", 80, 64, 8))
    assert {types[f"blk.{i}.attn_v.weight"] for i in range(80)} == {Q.Q5_K, Q.Q6_K}  # Q4_K -> Q5_K in a 70B
    assert types["blk.40.ffn_down.weight"] == Q.Q4_K
    # Q2_K: attn_v Q3_K below GQA 4
    assert plan_types(llama_tensors(4), "Q2_K", ModelShape("llama", 4, 32, 16))["blk.0.attn_v.weight"] == Q.Q3_K


def gpt_oss_tensors(n_layers: int = 2, dim=64, heads=4, kv_heads=2, head_dim=16, ffn=96, experts=4, vocab=256):
    """(name, numpy shape) of a gpt-oss model as convert_hf_to_gguf writes it (names: gguf's tables),
    biases and attention sinks included; experts stacked into 3-D tensors (n_expert, rows, cols)."""
    arch = gguf.MODEL_ARCH.GPT_OSS
    name = {t: gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    T = gguf.MODEL_TENSOR
    out = [(name[T.TOKEN_EMBD] + ".weight", (vocab, dim))]
    for i in range(n_layers):
        def n(t, suffix="weight"):
            return name[t].format(bid=i) + "." + suffix
        q, kv = heads * head_dim, kv_heads * head_dim
        out += [(n(T.ATTN_NORM), (dim,)), (n(T.ATTN_Q), (q, dim)), (n(T.ATTN_Q, "bias"), (q,)),
                (n(T.ATTN_K), (kv, dim)), (n(T.ATTN_K, "bias"), (kv,)), (n(T.ATTN_V), (kv, dim)),
                (n(T.ATTN_V, "bias"), (kv,)), (n(T.ATTN_OUT), (dim, q)), (n(T.ATTN_OUT, "bias"), (dim,)),
                (n(T.ATTN_SINKS), (heads,)), (n(T.ATTN_POST_NORM), (dim,)),
                (n(T.FFN_GATE_INP), (experts, dim)), (n(T.FFN_GATE_INP, "bias"), (experts,)),
                (n(T.FFN_GATE_EXP), (experts, ffn, dim)), (n(T.FFN_GATE_EXP, "bias"), (experts, ffn)),
                (n(T.FFN_UP_EXP), (experts, ffn, dim)), (n(T.FFN_UP_EXP, "bias"), (experts, ffn)),
                (n(T.FFN_DOWN_EXP), (experts, dim, ffn)), (n(T.FFN_DOWN_EXP, "bias"), (experts, dim))]
    return out + [(name[T.OUTPUT_NORM] + ".weight", (dim,)), (name[T.OUTPUT] + ".weight", (vocab, dim))]


def test_mxfp4_moe_plan_matches_llama_cpp():
    """llama.cpp's MOSTLY_MXFP4_MOE: expert tensors (3-D, ne[2] > 1) MXFP4; every other quantizable
    tensor Q8_0, output and token_embd included; norms, biases, sinks and the router kept."""
    tensors = gpt_oss_tensors()
    types = plan_types(tensors, "MXFP4_MOE", ModelShape("gpt-oss", 2, 4, 2))
    for name, shape in tensors:
        if "_exps.weight" in name:
            want = Q.MXFP4
        elif len(shape) == 1 or not name.endswith("weight") or "ffn_gate_inp" in name:
            want = Q.F32 if len(shape) == 1 else Q.F16  # kept as stored (plan_types' sources)
        else:
            want = Q.Q8_0
        assert types[name] == want, name
    # a dense model: no experts, all Q8_0; one expert (ne[2] == 1) is not MoE either
    assert set(plan_types(llama_tensors(2, dim=256, kv=64, ffn=512, vocab=512, tied=True), "MXFP4_MOE").values()) == {
        Q.Q8_0, Q.F32}
    assert plan_types([("blk.0.ffn_up_exps.weight", (1, 64, 64))], "MXFP4_MOE")["blk.0.ffn_up_exps.weight"] == Q.Q8_0
    # rows that do not split into 32-value blocks: F16, as for the other 32-value types
    assert plan_types([("blk.0.ffn_up_exps.weight", (4, 64, 48))], "MXFP4_MOE")["blk.0.ffn_up_exps.weight"] == Q.F16


def test_mxfp4_cli_on_a_dense_model(small, tmp_path):
    """`--type MXFP4` (llama-quantize's MXFP4_MOE) on a model without experts: Q8_0 everywhere
    quantizable, general.file_type MOSTLY_MXFP4_MOE."""
    out = tmp_path / "small-mxfp4.gguf"
    result = invoke(small, out, "--type", "mxfp4")
    assert result.exit_code == 0, result.stderr
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) > 1} == {Q.Q8_0}


def test_mxfp4_moe_file_reads_back_through_gguf(tmp_path):
    """quantize's writer with the MXFP4_MOE plan of gpt-oss-shaped tensors: 3-D MXFP4 expert tensors the
    gguf package reads back (type, shape, values = our encoder's decoded values), file type 38."""
    from localllm.commands.quantize_cmd import Source, SourceTensor, write_source

    g = torch.Generator().manual_seed(19)
    values = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in gpt_oss_tensors()}
    tensors = [SourceTensor(TensorInfo(n, tuple(v.shape), Q.F32), lambda v=v: v, lambda idx, v=v: v.reshape(-1, v.shape[-1])[idx],
                            None) for n, v in values.items()]
    src = Source(tmp_path / "in.gguf", [tmp_path / "in.gguf"], "gpt-oss", ModelShape("gpt-oss", 2, 4, 2), tensors,
                 dict, gguf.GGUF_DEFAULT_ALIGNMENT, None)
    plan = preset_plan(PRESETS["MXFP4_MOE"], [t.info for t in tensors], src.model)
    out = write_source(src, plan, PRESETS["MXFP4_MOE"], tmp_path / "out.gguf", "cpu", None, progress=False)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE) == 38
    read = {t.name: t for t in reader.tensors}
    assert {r.name for r in plan if r.target == Q.MXFP4} == {n for n in values if "_exps.weight" in n}
    for row in plan:
        t = read[row.name]
        assert t.tensor_type == row.target and tuple(reversed(t.shape.tolist())) == row.shape, row.name
        x = values[row.name]
        if row.target == Q.MXFP4:
            want = dequantize_torch(quantize_tensor(x.reshape(-1, x.shape[-1]), Q.MXFP4), Q.MXFP4)
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, x.shape[-1])
            np.testing.assert_array_equal(got, want.numpy(), err_msg=row.name)
            assert (want - x.reshape(want.shape)).norm() < 0.2 * x.norm()


def test_imatrix_rule():
    names = [n for n, _ in llama_tensors(16)]
    types = preset_types(PRESETS["Q4_0"], llama_tensors(16), ModelShape("llama", 16, 32, 8), imatrix=True)
    downs = [t for n, t in zip(names, types) if "ffn_down" in n]
    assert downs == [Q.Q4_1, Q.Q4_1] + [Q.Q4_0] * 14


def test_default_model_plan(default_path):
    """Rows of 576 values do not split into 256-value blocks: llama.cpp's fallback types."""
    src, rows = plan_model(str(default_path), "Q4_K_M")
    assert len(rows) == 272
    for r in rows:
        i = int(r.name.split(".")[1]) if r.name.startswith("blk.") else -1
        if len(r.shape) == 1:
            want = Q.F32
        elif r.name == "token_embd.weight":  # tied: the output rule, 576 % 256 != 0 -> Q8_0
            want = Q.Q8_0
        elif "ffn_down" in r.name:  # rows of 1536 = 6 x 256
            want = Q.Q6_K if i in MORE_BITS_30 else Q.Q4_K
        elif "attn_v" in r.name:
            want = Q.Q8_0 if i in MORE_BITS_30 else Q.Q5_0  # Q6_K -> Q8_0, Q4_K -> Q5_0
        else:
            want = Q.Q5_0
        assert r.target == want, (r.name, r.target, want)
    # The default model was made by llama-quantize as Q4_1: our Q4_1 plan gives its very types.
    rows = preset_plan(PRESETS["Q4_1"], [t.info for t in src.tensors], src.model)
    assert [r.target for r in rows] == [t.info.source for t in src.tensors]


# ---- 2. a quantized tiny model: exact blocks, copied metadata, loads and runs

def test_quantized_tiny_model(small, tmp_path):
    out = tmp_path / "small-q4km.gguf"
    result = invoke(small, out, "--type", "Q4_K_M")
    assert result.exit_code == 0, result.stderr
    assert "Q4_K_M" in result.stderr
    assert re.search(r"time: read [\d.]+ s, plan [\d.]+ s, write [\d.]+ s", result.stderr), result.stderr
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == Q.Q5_0  # Q4_K, rows of 64 -> Q5_0
    assert types["output.weight"] == Q.Q8_0
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1)] == [Q.Q5_0, Q.Q8_0]  # more_bits(1, 2)
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)] == [Q.Q4_K, Q.Q6_K]
    assert types["blk.0.attn_norm.weight"] == Q.F32

    source = {t.name: t for t in gguf.GGUFReader(small).tensors}
    assert list(types) == list(source)  # the input's order
    for t in reader.tensors:
        assert t.data_offset % 32 == 0
        ours = dequantize_torch(np.array(t.data), t.tensor_type)
        theirs = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type)).reshape(ours.shape)
        assert torch.equal(ours, theirs), t.name
        # the bytes are the encoder's for the source values (nothing else touched them)
        w = torch.from_numpy(np.array(source[t.name].data, dtype=np.float32))
        blocks = quantize_tensor(w.reshape(-1, w.shape[-1]), t.tensor_type)
        assert np.array_equal(np.array(t.data).reshape(-1).view(np.uint8), blocks.reshape(-1)), t.name

    before, after = fields(small), fields(out)
    assert list(after) == list(before)  # the same keys in the same order
    assert after.pop("general.file_type") == ([gguf.GGUFValueType.UINT32], int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    before.pop("general.file_type")
    assert after == before  # tokenizer, architecture keys, their GGUF types

    lm, ref_lm = load_model(str(out), "cpu", torch.float32), load_model(str(small), "cpu", torch.float32)
    assert lm.tokenizer.encode("Once upon a time") == ref_lm.tokenizer.encode("Once upon a time")
    ref, got = logits(ref_lm), logits(lm)
    assert ((got - ref).norm() / ref.norm()).item() < 0.3


def test_q8_0_close_and_alignment_kept(small, tmp_path):
    """A file with general.alignment 64 keeps it; Q8_0 logits are close to the F32 model's."""
    from localllm.quantize.writer import MetaValue, TensorSlot, write_gguf

    aligned = tmp_path / "aligned.gguf"
    meta = read_gguf_metadata(small, keep=lambda k: True)
    meta["general.alignment"] = MetaValue(64, gguf.GGUFValueType.UINT32)
    tensors = gguf.GGUFReader(small).tensors
    slots = [TensorSlot(t.name, tuple(reversed(t.shape.tolist())), t.tensor_type) for t in tensors]
    write_gguf(aligned, "llama", meta, slots, lambda i: np.array(tensors[i].data), alignment=64, progress=False)
    out = tmp_path / "q8.gguf"
    quantize_model(str(aligned), out, "Q8_0", progress=False)
    reader = gguf.GGUFReader(out)
    assert reader.alignment == 64 and all(t.data_offset % 64 == 0 for t in reader.tensors)
    assert fields(out)["general.alignment"] == ([gguf.GGUFValueType.UINT32], 64)
    ref, got = logits(small), logits(out)
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


# ---- 3. F32 from the default model: the exact decoded weights

def test_f32_of_default_model_is_its_decoded_weights(default_path, tmp_path):
    out = tmp_path / "smollm2-f32.gguf"
    quantize_model(str(default_path), out, "F32", progress=False)
    src, dst = gguf.GGUFReader(default_path), gguf.GGUFReader(out)
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    for a, b in zip(src.tensors, dst.tensors):
        assert b.tensor_type == Q.F32
        want = gguf.quants.dequantize(np.array(a.data), a.tensor_type)
        assert np.array_equal(np.array(b.data).reshape(want.shape), want), a.name
    before, after = fields(src), fields(dst)
    assert list(after) == list(before)
    assert after.pop("general.file_type")[1] == 0
    before.pop("general.file_type")
    assert after == before


# ---- 4. never a partial file, never over the input; one-line errors

def test_out_equal_to_input_refused(small, tmp_path):
    digest = hashlib.sha256(small.read_bytes()).hexdigest()
    link = tmp_path / "same-inode.gguf"
    os.link(small, link)
    sym = tmp_path / "symlink.gguf"
    sym.symlink_to(small)
    for out in (small, small.parent / ".." / small.parent.name / small.name, link, sym):
        assert_one_error(invoke(small, out, "--type", "Q8_0"), "is the input file")
    assert hashlib.sha256(small.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_write_leaves_nothing(small, tmp_path, monkeypatch, exc):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous contents")
    calls = []

    def failing(self, tensor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise exc("stop")
        return real(self, tensor, *args, **kwargs)

    real = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    with pytest.raises(exc):
        quantize_model(str(small), out, "Q8_0", progress=False)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]  # no temporary file left
    assert out.read_bytes() == b"previous contents"
    if exc is KeyboardInterrupt:  # through the command: "interrupted", exit 130, still nothing left
        calls.clear()
        result = invoke(small, tmp_path / "new.gguf", "--type", "Q8_0")
        assert result.exit_code == 130 and "interrupted" in result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


def test_errors(small, tmp_path):
    out = tmp_path / "x.gguf"
    assert_one_error(invoke(small, out, "--type", "Q4_K_X"), "unknown quantization type 'Q4_K_X'")
    assert_one_error(invoke(small, out, "--type", "Q4_K_M", "--tensor-type", "ffn=IQ3_S"),
                     "unknown tensor type 'IQ3_S'")
    assert_one_error(invoke(small, out, "--type", "Q4_K_M", "--tensor-type", "ffn"), "REGEX=TYPE")
    assert_one_error(invoke(small, out, "--type", "Q4_K_M", "--tensor-type", "(=q8_0"), "bad pattern")
    assert_one_error(invoke(tmp_path / "missing.gguf", out, "--type", "Q8_0"), "file not found")
    assert_one_error(invoke(small, tmp_path / "no" / "x.gguf", "--type", "Q8_0"), "output folder does not exist")
    assert_one_error(invoke(small, "--type", "Q8_0"), "missing OUT")
    odd = write_raw_gguf(tmp_path / "iq3.gguf", {"blk.0.ffn_up.weight": (
        np.random.default_rng(0).integers(0, 256, (4, 110), dtype=np.uint8), Q.IQ3_S)})
    assert_one_error(invoke(odd, out, "--type", "Q8_0"), "unsupported type IQ3_S")
    hf = tmp_path / "hf"
    write_hf_folder(SMALL, hf)
    (hf / "tokenizer.json").unlink()  # no tokenizer to build the metadata from
    assert_one_error(invoke(hf, out, "--type", "Q8_0"), "--tokenizer-from")
    assert not out.exists()


# ---- 5. overrides and the --dry-run table

def test_overrides():
    overrides = ["blk\\.1\\.ffn_down=q8_0", "ffn_down=Q5_K", "ATTN_.*=f16"]
    types = plan_types(llama_tensors(30), "Q4_K_M", overrides=overrides)
    assert types["blk.1.ffn_down.weight"] == Q.Q8_0  # the first matching pattern wins
    assert types["blk.0.ffn_down.weight"] == types["blk.7.ffn_down.weight"] == Q.Q5_K
    assert types["blk.3.attn_q.weight"] == types["blk.0.attn_v.weight"] == Q.F16  # lower-cased pattern
    assert types["blk.3.attn_norm.weight"] == Q.F32  # never quantized: no override applies
    assert types["blk.3.ffn_up.weight"] == Q.Q4_K
    # an override still falls back where its blocks do not fit
    assert plan_types(llama_tensors(2, dim=576, kv=192, ffn=1536), "Q8_0",
                      overrides=["attn_q=Q4_K"])["blk.0.attn_q.weight"] == Q.Q5_0


def test_dry_run_table(small, tmp_path):
    out = tmp_path / "never.gguf"
    result = invoke(small, out, "--type", "Q4_K_M", "--dry-run", "--tensor-type", "ffn_up=q8_0",
                    "--tensor-type", "attn_q=Q6_K")
    assert result.exit_code == 0, result.stderr
    assert not out.exists()
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert re.search(r"\bF32\s+Q8_0\s+8\.5\b.*override ffn_up=q8_0", lines["blk.0.ffn_up.weight"])
    assert re.search(r"\bQ8_0\s+8\.5\b.*fallback from Q6_K \(override attn_q=Q6_K\)", lines["blk.1.attn_q.weight"])
    assert re.search(r"\bQ4_K\s+4\.5\b", lines["blk.0.ffn_down.weight"])
    assert re.search(r"\bF32\s+F32\s+32\b.*kept", lines["output_norm.weight"])
    errors = [float(re.search(r"(\d\.\d{4})\s*(?:override|fallback|kept|$)", lines[n]).group(1))
              for n in ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "output_norm.weight")]
    assert 0.01 < errors[1] < errors[0] < 0.2 and errors[2] == 0  # Q6_K beats Q4_K; kept is exact
    _, rows = plan_model(str(small), "Q4_K_M", ["ffn_up=q8_0", "attn_q=Q6_K"])
    assert f"{total_bpw(rows):.4f}" in lines["total"]


def test_table_without_errors():
    from rich.console import Console

    rows = preset_plan(PRESETS["Q8_0"], [TensorInfo("output.weight", (8, 64), Q.F32)], ModelShape("llama", 1, 1, 1))
    console = Console(width=200, record=True)
    console.print(plan_table(rows))
    assert "8.5" in console.export_text()


# ---- safetensors input: the converter's GGUF, then quantized

@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "llama3"])
def test_safetensors_input_matches_converter(tiny, tmp_path, case):
    """F32 from a HF folder = convert_hf_to_gguf's F32 file (tiny_gguf.write_gguf): same tensors
    (q/k permuted for llama), same metadata but general.name/type; the tokenizer from --tokenizer-from."""
    ref = tiny.gguf(case)
    out = tmp_path / f"{case}.gguf"
    quantize_model(str(tiny.hf(case)), out, "F32", tokenizer_from=ref, progress=False)
    want = {t.name: t for t in gguf.GGUFReader(ref).tensors}
    got = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type == Q.F32
        assert np.array_equal(np.array(t.data), np.array(want[name].data)), name
    before, after = fields(ref), fields(out)
    for key in ("general.name", "general.type"):
        before.pop(key, None), after.pop(key, None)
    assert after == before
    assert torch.equal(logits(out), logits(ref))


def test_safetensors_quantized(tiny, tmp_path):
    out = tmp_path / "mistral-q8.gguf"
    result = invoke(tiny.hf("mistral"), out, "--type", "Q8_0", "--tokenizer-from", tiny.gguf("mistral"))
    assert result.exit_code == 0, result.stderr
    ref, got = logits(tiny.gguf("mistral")), logits(out)
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    other = tiny_gguf.write_gguf(TinySpec("llama", n_layers=1), tmp_path / "t.gguf")
    with pytest.raises(LocalLLMError, match="has 384 tokens"):  # a tokenizer of another vocabulary size
        tokenizer_metadata(other, 1000)


def test_cli_help():
    r = subprocess.run(["localllm", "quantize", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    assert r.returncode == 0
    for option in ("--type", "--tensor-type", "--dry-run", "--device", "--tokenizer-from"):
        assert option in r.stdout


def test_writer_packs_arrays_as_gguf_writer(tmp_path):
    """quantize.writer's array packing (one step per array) writes gguf.GGUFWriter's own bytes: strings
    (str and bytes, multi-byte UTF-8, empty), every numeric item type, bools and scalars; then the file
    reads back through gguf's reader."""
    from localllm.quantize.writer import MetaValue, _Writer

    V = gguf.GGUFValueType
    meta = {
        "t.tokens": MetaValue(["a", "", "é漢🙂", b"\xff raw"], V.ARRAY, V.STRING),
        "t.scores": MetaValue([0.5, -1e30, 3.0], V.ARRAY, V.FLOAT32),
        "t.types": MetaValue([1, 6, -3], V.ARRAY, V.INT32),
        "t.u8": MetaValue([0, 255], V.ARRAY, V.UINT8),
        "t.u64": MetaValue([2**63], V.ARRAY, V.UINT64),
        "t.f64": MetaValue([0.1], V.ARRAY, V.FLOAT64),
        "t.flags": MetaValue([True, False], V.ARRAY, V.BOOL),
        "t.name": MetaValue(b"x", V.STRING),
        "t.n": MetaValue(7, V.UINT32),
    }
    for key, v in meta.items():
        ours, theirs = _Writer(None, "llama"), gguf.GGUFWriter(None, "llama")
        assert ours._pack_val(v.value, v.type, True, v.sub_type) == theirs._pack_val(v.value, v.type, True, v.sub_type), key
    out = tmp_path / "m.gguf"
    w = _Writer(out, "llama")
    for key, v in meta.items():
        w.add_key_value(key, v.value, v.type, v.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    field = gguf.GGUFReader(out).fields["t.tokens"]
    assert [bytes(field.parts[i]) for i in field.data] == ["a".encode(), b"", "é漢🙂".encode(), b"\xff raw"]
