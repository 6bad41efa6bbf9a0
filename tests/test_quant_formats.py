"""quantize/ encoders: exact round trips through the gguf package, and quality against llama.cpp;
the registry quantize.formats.FORMATS as the one source of every type's facts (end of file).

Oracles: `gguf.quants.dequantize` (decoding), `gguf.quants.quantize` (llama.cpp's reference rule for
the formats it implements), and RMSE figures of llama.cpp's own quantizers (ggml_quantize_chunk)
measured on these exact tensors (LLAMA_CPP_RMSE below).
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from conftest import default_model_path
from localllm.quantize import SUPPORTED_TYPES, bits_per_weight, dequantize, dequantize_torch, quantize_tensor
from localllm.quantize.formats import FORMATS

Q = gguf.GGMLQuantizationType
FLOATS = [Q.F32, Q.F16, Q.BF16]
LEGACY = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
MX = [Q.MXFP4]
IQ = [Q.IQ4_NL, Q.IQ4_XS]
QUANTIZED = LEGACY + K_QUANTS + MX + IQ
ALL = FLOATS + QUANTIZED


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The searches are many small ops: on 2 shared cores OpenMP's barriers cost more than they give,
    and the results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- test tensors (deterministic: llama.cpp's figures below were measured on exactly these)

def synthetic(seed: int = 1234) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((64, 1024)).astype(np.float32)
    zero_blocks = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    zero_blocks[0] = 0  # a whole row
    zero_blocks[1::2, 256:512] = 0  # whole super-blocks
    zero_blocks[2, 32:64] = 0  # one 32-block inside a super-block
    return {
        "normal": normal * 0.02,
        "student_t": (rng.standard_t(3, (64, 1024)) * 0.02).astype(np.float32),
        "zero_blocks": zero_blocks,
        "tiny": (rng.standard_normal((8, 512)) * 1e-6).astype(np.float32),
        "huge": (rng.standard_normal((8, 512)) * 2e3).astype(np.float32),
    }


def importance_for(cols: int, seed: int = 99) -> np.ndarray:
    """imatrix-like per-column mean of x^2: log-normal, a few columns dominating, some zero."""
    rng = np.random.default_rng(seed)
    imp = np.exp(rng.standard_normal(cols) * 1.5).astype(np.float32)
    imp[::97] = 0
    return imp


@functools.cache
def tensors() -> dict[str, np.ndarray]:
    out = synthetic()
    reader = gguf.GGUFReader(default_model_path())
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    out["real"] = dequantize(t.data, t.tensor_type)[:256]  # (256, 1536): Q4_1 in the file
    return out


@functools.cache
def encoded(name: str, qtype: Q, weighted: bool = False) -> np.ndarray:
    x = tensors()[name]
    importance = torch.from_numpy(importance_for(x.shape[1])) if weighted else None
    return quantize_tensor(torch.from_numpy(x), qtype, importance)


def rmse(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    err = (x.astype(np.float64) - y) ** 2
    return float(np.sqrt(np.mean(err if weights is None else err * weights)))


# ---- (1) round trips

@pytest.mark.parametrize("name", ["normal", "student_t", "zero_blocks", "tiny", "huge", "real"])
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_bytes_decode_same_through_gguf_and_torch(name, qtype):
    x = tensors()[name]
    raw = encoded(name, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // block * nbytes)
    ours = dequantize_torch(raw, qtype)
    assert ours.dtype == torch.float32
    theirs = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(ours.numpy(), theirs)
    assert np.isfinite(theirs).all()
    if name != "tiny":  # (at 1e-6 the fp16 block scales underflow to 0, in llama.cpp too)
        assert rmse(x, theirs) <= 0.6 * rmse(x, 0 * x)


@pytest.mark.parametrize("name", ["normal", "student_t", "zero_blocks", "tiny", "huge", "real"])
@pytest.mark.parametrize("qtype", FLOATS + LEGACY + MX, ids=lambda t: t.name)
def test_reference_rule_matches_gguf_quantize(name, qtype):
    x = tensors()[name]
    ours = encoded(name, qtype)
    theirs = np.asarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(ours.shape)
    if not np.array_equal(ours, theirs):
        assert rmse(x, dequantize(ours, qtype)) <= rmse(x, dequantize(theirs, qtype))


def test_mxfp4_reference_rule_is_gguf_quantize_byte_for_byte():
    """MXFP4 without importance: exactly gguf's (= llama.cpp's quantize_row_mxfp4_ref) bytes, on the
    test tensors and on the hard cases of its rule: values halfway between two codes (ties: the lower
    code), block maxima just below and at powers of two (the exponent's floor(log2)), zero blocks and
    -0.0 (code 0, not 8)."""
    rng = np.random.default_rng(3)
    halves = (rng.integers(-26, 27, (64, 256)) * 0.25).astype(np.float32)
    below_pow2 = np.ldexp(np.float32(1) - np.float32(2**-24), rng.integers(-100, 100, (64, 1))).astype(np.float32)
    below_pow2 = below_pow2 * np.concatenate([np.ones((64, 1)), rng.uniform(-1, 1, (64, 255))], 1).astype(np.float32)
    pow2 = np.ldexp(np.float32(1), rng.integers(-100, 100, (64, 256))).astype(np.float32)
    signed_zero = np.zeros((2, 64), np.float32)
    signed_zero[0, ::2] = -0.0
    signed_zero[1, :32] = -0.0
    signed_zero[1, 32:] = rng.standard_normal(32)
    cases = dict(tensors(), halves=halves, below_pow2=below_pow2, pow2=pow2, signed_zero=signed_zero)
    for name, x in cases.items():
        ours = quantize_tensor(torch.from_numpy(x), Q.MXFP4)
        theirs = np.asarray(gguf.quants.quantize(x, Q.MXFP4)).view(np.uint8).reshape(ours.shape)
        np.testing.assert_array_equal(ours, theirs, err_msg=name)


def test_mxfp4_from_hugging_face_blocks_decodes_as_transformers():
    """gpt-oss's checkpoint layout (*_blocks, *_scales) repacked as GGUF MXFP4 rows: gguf's decoding
    equals transformers' dequantization (convert_moe_packed_tensors), -0.0 for code 8 aside."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from localllm.quantize.mxfp4 import from_hf_blocks

    g = torch.Generator().manual_seed(4)
    experts, rows, groups = 3, 8, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (experts, rows, groups), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 1  # the subnormal scales
    raw = from_hf_blocks(blocks, scales)
    assert raw.shape == (experts, rows, groups * 17)
    ours = gguf.quants.dequantize(raw.reshape(experts * rows, -1).numpy(), Q.MXFP4).reshape(experts, rows, -1)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, rows, K)
    np.testing.assert_array_equal(ours, theirs.numpy())  # (-0.0 == 0.0)
    with pytest.raises(ValueError):
        from_hf_blocks(blocks[..., :8], scales)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_weighted_bytes_decode_same_through_gguf_and_torch(qtype):
    raw = encoded("student_t", qtype, weighted=True)
    np.testing.assert_array_equal(dequantize_torch(raw, qtype).numpy(), gguf.quants.dequantize(raw, qtype))


def test_torch_decoder_reads_arbitrary_blocks():
    """Random bytes (fp16 scales kept finite) decode alike: the decoder is checked apart from the encoder."""
    rng = np.random.default_rng(7)
    for qtype in QUANTIZED + [Q.BF16]:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(4, 2 * nbytes), dtype=np.uint8)
        theirs = gguf.quants.dequantize(raw, qtype)
        ours = dequantize_torch(torch.from_numpy(raw), qtype).numpy()
        np.testing.assert_array_equal(ours, theirs, err_msg=qtype.name)


def test_bits_per_weight():
    assert {t: bits_per_weight(t) for t in ALL} == {
        Q.F32: 32, Q.F16: 16, Q.BF16: 16, Q.Q8_0: 8.5, Q.Q4_0: 4.5, Q.Q4_1: 5, Q.Q5_0: 5.5, Q.Q5_1: 6,
        Q.Q2_K: 2.625, Q.Q3_K: 3.4375, Q.Q4_K: 4.5, Q.Q5_K: 5.5, Q.Q6_K: 6.5625, Q.MXFP4: 4.25,
        Q.IQ4_NL: 4.5, Q.IQ4_XS: 4.25,
    }
    assert set(ALL) == SUPPORTED_TYPES


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        quantize_tensor(torch.zeros(2, 100), Q.Q4_K)
    with pytest.raises(ValueError):
        quantize_tensor(torch.zeros(2, 256), Q.Q4_K, torch.ones(100))
    with pytest.raises(ValueError):
        quantize_tensor(torch.full((2, 256), float("nan")), Q.Q8_0)
    for bad in (float("nan"), float("inf"), -float("inf")):  # one value among finite ones
        w = torch.randn(3, 256)
        w[1, 77] = bad
        with pytest.raises(ValueError, match="non-finite"):
            quantize_tensor(w, Q.Q4_0)


# ---- (2) quality

def baseline(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Plain max/round K-quant values: each sub-block's scale from its max, scales rounded against their max."""
    sub, nmax, bits, affine = {Q.Q2_K: (16, 3, 4, True), Q.Q3_K: (16, 4, 6, False), Q.Q4_K: (32, 15, 6, True),
                               Q.Q5_K: (32, 31, 6, True), Q.Q6_K: (16, 32, 8, False)}[qtype]
    xs = x.reshape(-1, 256 // sub, sub).astype(np.float32)

    def against_max(v, levels):  # v (B, n) >= 0 -> (d * ints)
        d = (v.max(-1, keepdims=True) / levels).astype(np.float16).astype(np.float32)
        return d * np.clip(np.round(v / np.where(d > 0, d, 1)), 0, levels)

    if affine:
        low = np.minimum(xs.min(-1), 0)
        scale = against_max((xs.max(-1) - low) / nmax, 2**bits - 1)[..., None]
        mins = against_max(-low, 2**bits - 1)[..., None]
        q = np.clip(np.round((xs + mins) / np.where(scale > 0, scale, 1)), 0, nmax)
        return (scale * q - mins).reshape(x.shape)
    top = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0] / -nmax  # signed sub-block scales
    half = 2 ** (bits - 1)
    ref = np.take_along_axis(top, np.abs(top).argmax(-1)[..., None], -1)
    d = (ref / -half).astype(np.float16).astype(np.float32)
    scale = (d * np.clip(np.round(top / np.where(d != 0, d, 1)), -half, half - 1))[..., None]
    return (scale * np.clip(np.round(xs / np.where(scale != 0, scale, 1)), -nmax, nmax - 1)).reshape(x.shape)


# RMSE of llama.cpp's own quantize_qN_K (ggml_quantize_chunk of ggml 0.20.2, through the libggml-python
# wheel) on these tensors: (tensor, type) -> (without imatrix, importance-weighted RMSE with it).
LLAMA_CPP_RMSE = {
    ("normal", Q.Q2_K): (5.9325e-03, 6.9313e-03),
    ("normal", Q.Q3_K): (3.0213e-03, 4.1236e-03),
    ("normal", Q.Q4_K): (1.4262e-03, 1.9571e-03),
    ("normal", Q.Q5_K): (7.2257e-04, 1.0135e-03),
    ("normal", Q.Q6_K): (3.5422e-04, 5.0351e-04),
    ("student_t", Q.Q2_K): (1.1823e-02, 1.3729e-02),
    ("student_t", Q.Q3_K): (6.3926e-03, 9.1789e-03),
    ("student_t", Q.Q4_K): (3.0801e-03, 4.3562e-03),
    ("student_t", Q.Q5_K): (1.5462e-03, 2.2829e-03),
    ("student_t", Q.Q6_K): (8.2826e-04, 1.2696e-03),
    ("real", Q.Q2_K): (5.9038e-02, 6.8907e-02),
    ("real", Q.Q3_K): (2.9840e-02, 4.1708e-02),
    ("real", Q.Q4_K): (3.6357e-03, 5.1739e-03),
    ("real", Q.Q5_K): (3.8168e-03, 5.1577e-03),
    ("real", Q.Q6_K): (3.4640e-03, 4.9207e-03),
}


@pytest.mark.parametrize("name", ["normal", "student_t", "real"])
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_rmse_beats_max_round_and_matches_llama_cpp(name, qtype):
    x = tensors()[name]
    ours = rmse(x, dequantize(encoded(name, qtype), qtype))
    assert ours <= rmse(x, baseline(x, qtype))
    assert ours <= 1.005 * LLAMA_CPP_RMSE[name, qtype][0]


@pytest.mark.parametrize("name", ["normal", "student_t", "real"])
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_weighted_rmse_matches_llama_cpp_imatrix(name, qtype):
    x = tensors()[name]
    imp = importance_for(x.shape[1])
    ours = rmse(x, dequantize(encoded(name, qtype, weighted=True), qtype), imp)
    assert ours <= 1.005 * LLAMA_CPP_RMSE[name, qtype][1]


@pytest.mark.parametrize("name", ["normal", "student_t", "real"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_importance_lowers_the_weighted_error(name, qtype):
    x = tensors()[name]
    imp = importance_for(x.shape[1])
    plain = rmse(x, dequantize(encoded(name, qtype), qtype), imp)
    weighted = rmse(x, dequantize(encoded(name, qtype, weighted=True), qtype), imp)
    if plain == 0:  # the real tensor is Q4_1 in the file: Q4_1 and Q5_1 can give it back exactly
        assert weighted == 0
    else:
        assert weighted < plain


# ---- (3) through a GGUF file

def test_gguf_file_round_trip(tmp_path):
    x = tensors()["real"][:64]
    path = tmp_path / "quants.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    written = {}
    for qtype in ALL:
        raw = quantize_tensor(torch.from_numpy(x), qtype)
        written[qtype.name] = (qtype, dequantize_torch(raw, qtype).numpy())
        writer.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(ALL)
    for t in reader.tensors:
        qtype, values = written[t.name.removeprefix("t.")]
        assert t.tensor_type == qtype
        assert list(t.shape) == [x.shape[1], x.shape[0]]
        np.testing.assert_array_equal(dequantize(t.data, t.tensor_type), values, err_msg=t.name)


# ---- the registry: every type's facts in one place (quantize/formats), read by quantize/ and kernels/

def test_registry_matches_gguf_sizes_and_fields_tile_each_block():
    """FORMATS holds exactly the supported types; each one's block geometry is gguf's and its fields
    cover every byte of a block exactly once."""
    assert set(FORMATS) == SUPPORTED_TYPES == set(ALL)
    for qtype, f in FORMATS.items():
        assert f.qtype == qtype
        assert (f.block, f.nbytes) == gguf.GGML_QUANT_SIZES[qtype], qtype.name
        assert bits_per_weight(qtype) == f.bits
        fields = sorted(f.fields, key=lambda x: x.offset)
        assert sum(x.size for x in fields) == f.nbytes, qtype.name
        assert [x.offset for x in fields] == [0] + list(np.cumsum([x.size for x in fields[:-1]])), qtype.name
        assert all(x.size % x.dtype.itemsize == 0 for x in fields), qtype.name
        assert f.dense == (qtype in FLOATS) and f.imatrix == (qtype in K_QUANTS + IQ)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_registry_encoder_and_decoder_round_trip_through_gguf(qtype):
    """Each Format's own encoder and decoder: every candidate encoding decodes, through the Format and
    through gguf.quants.dequantize, to the same bits."""
    f = FORMATS[qtype]
    x = torch.from_numpy(tensors()["normal"][:8])
    if f.dense:
        candidates = [f.encode(x)]
    else:
        xb = x.reshape(-1, f.block)
        candidates = f.encode(xb, None) + f.encode(xb, torch.rand_like(xb))
    for data in candidates:
        raw = data.reshape(x.shape[0], -1).numpy()
        assert raw.dtype == np.uint8 and raw.shape[1] == x.shape[1] // f.block * f.nbytes
        got = f.decode(torch.from_numpy(raw).reshape(-1, f.nbytes)).reshape(x.shape[0], -1)
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_planar_fields_are_the_stored_bytes(qtype):
    """Format.planar splits every field of the stored blocks into one (N, X) array, bytes as stored
    (widened fields: their unpack of them); the kernels' field names and block-major units exist."""
    f = FORMATS[qtype]
    n, nb = 3, 4
    raw = torch.randint(0, 256, (n, nb * f.nbytes), dtype=torch.uint8)
    parts = f.planar(raw)
    if f.gemv is None:
        assert list(parts) == ["raw"] and torch.equal(parts["raw"], raw) and f.int_dot is None
        return
    blocks = raw.reshape(n, nb, f.nbytes)
    names = set()
    for field in f.fields:
        stored = blocks[:, :, field.offset:field.offset + field.size].reshape(-1, field.size)
        if field.unpack is None:
            want = {field.name: stored.contiguous().view(field.dtype)}
        else:
            want = field.unpack(stored)
        for name, v in want.items():
            same_bits = torch.equal(parts[name].view(torch.uint8), v.reshape(n, -1).view(torch.uint8))  # NaNs too
            assert parts[name].dtype == v.dtype and same_bits, (qtype.name, name)
            names.add(name)
    assert set(parts) == names and {a for a in f.gemv if a} <= names
    if f.int_dot is not None:
        assert set(f.int_dot.chunks) == names and {a for a in f.int_dot.args if a} <= names
        units = nb * f.block // f.int_dot.unit
        # quants: c elements per unit; scales (c = 1): one per scale, moved as they are
        assert all(parts[k].shape[1] == units * c for k, c in f.int_dot.chunks.items() if c > 1), qtype.name


def test_kernel_tables_are_read_from_formats(monkeypatch):
    """kernels/ keeps no per-type table of its own: qweight's type sets and block-major chunks, the
    Triton kernels' field orders and units, and the C++ type sets all come from FORMATS."""
    from localllm.kernels import cpu, qweight
    from localllm.quantize import blocks, decode

    assert qweight.KERNEL_TYPES == {t for t, f in FORMATS.items() if f.gemv is not None}
    assert qweight.INT_DOT_TYPES == set(qweight.BLOCK_MAJOR) == {t for t, f in FORMATS.items() if f.int_dot}
    assert qweight.BLOCK_MAJOR == {t: dict(FORMATS[t].int_dot.chunks) for t in qweight.INT_DOT_TYPES}
    assert qweight.QUANTIZED_TYPES == set(QUANTIZED)
    assert cpu.CPU_TYPES | cpu.DENSE_TYPES == set(FORMATS) and cpu.DENSE_TYPES == set(FLOATS)
    assert all(decode.DECODERS[t] is f.decode for t, f in FORMATS.items())
    assert all((blocks.FLOAT_ENCODERS | blocks.BLOCK_ENCODERS)[t] is f.encode for t, f in FORMATS.items())
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the Triton tests set it: their modules read it at import
    from localllm.kernels import triton_gemv, triton_units

    assert {t: triton_gemv.FIELDS[fmt] for t, fmt in triton_gemv.FMT_OF.items()} == {
        t: FORMATS[t].gemv for t in qweight.KERNEL_TYPES}
    assert triton_units.FIELDS == {t: FORMATS[t].int_dot.args for t in qweight.INT_DOT_TYPES}
    assert triton_units.UNIT == {t: FORMATS[t].int_dot.unit for t in qweight.INT_DOT_TYPES}
