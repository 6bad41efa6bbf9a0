"""The CPU kernels (kernels/cpu*.cpp) against their oracles.

- decoding (file blocks and 8-row tiles): quantize.dequantize_torch, bit for bit;
- products: the fp64 product of dequantize_torch's values with x rounded as the kernels round it
  (int16 per 32 values; F32/F16/BF16 weights, and long inputs of untiled ones, take x as it is);
- the one-call decode step: the dense reference model's forward with the same input rounding;
- the default model: greedy output of the CPU path equal to the dense fp32 reference for 64 tokens.
"""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from localllm.kernels.cpu import QMATVEC_MAX_ROWS, BlockQWeight, dequantize_rows, embed, load_extension, pack_for_cpu, qlinear
from localllm.cache import make_cache
from localllm.backends.cpu import CpuRuntime
from localllm.generate import generate
from localllm.gguf_file import open_gguf
from localllm.load import load_model
from localllm.model import Linear
from localllm.runner import encode_prompt
from localllm.sampling import Sampler
from localllm.settings import DEFAULT_CPU, SamplingSettings
from localllm.quantize import dequantize_torch, quantize_tensor

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.F16,
         Q.BF16, Q.F32]
DENSE = (Q.F16, Q.BF16, Q.F32)


def round_like_kernels(x: torch.Tensor) -> torch.Tensor:
    """x (T, K) -> d * round(x / d) per 32 values, d = max|x| / 32767 (cpu_quant.cpp quantize_x)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


def kernels():
    return load_extension(DEFAULT_CPU.cache_dir)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_kernels_build():
    assert kernels() is not None, "the C++ CPU kernels did not build"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_and_tiles_decode_and_multiply_like_the_reference(qtype):
    g = torch.Generator().manual_seed(int(qtype))
    N, K = 61, 512  # 61 rows: the last 8-row tile is partial
    raw = torch.as_tensor(quantize_tensor(torch.randn(N, K, generator=g), qtype)).view(torch.uint8).reshape(N, -1)
    ref = dequantize_torch(raw, qtype)
    w = pack_for_cpu(BlockQWeight.from_blocks(raw, qtype, torch.float32), kernels())
    assert torch.equal(dequantize_rows(w, 0, N), ref)
    assert torch.equal(dequantize_rows(w, 13, 27), ref[13:27])
    for T in (1, 3, QMATVEC_MAX_ROWS + 3):
        x = torch.randn(T, K, generator=g)
        gemm = qtype in DENSE or (T > QMATVEC_MAX_ROWS and not w.tiled)  # x as it is, fp32
        xr = x if gemm else round_like_kernels(x)
        assert rel(qlinear(x, w), xr.double() @ ref.double().T) < 2e-6


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.MXFP4], ids=lambda t: t.name)
def test_torch_fallback_reads_the_file_blocks(qtype):
    """Without the kernels (no compiler, or MPS) the file's blocks are decoded by dequantize_torch."""
    g = torch.Generator().manual_seed(5)
    raw = torch.as_tensor(quantize_tensor(torch.randn(40, 64, generator=g), qtype)).view(torch.uint8).reshape(40, -1)
    w, ref = BlockQWeight.from_blocks(raw, qtype, torch.float32), dequantize_torch(raw, qtype)
    tokens, x = torch.tensor([[3, 39, 3]]), torch.randn(2, 64, generator=g)
    assert w.ext is None and torch.equal(embed(w, tokens), ref[tokens])
    assert rel(qlinear(x, w), x.double() @ ref.double().T) < 1e-6


@pytest.fixture(scope="module")
def cpu_lm(default_path):
    """The default model as `localllm` loads it on the CPU (weights kept quantized, tiled), loaded once
    for this module's tests: they read its weights or decode with caches of their own."""
    return load_model(str(default_path), "cpu")


def test_weights_are_held_once(cpu_lm, default_path):
    """The CPU load holds no more weight bytes than the file and no view of its mapping."""
    lm = cpu_lm
    held = [w for m in lm.model.modules() for w in [getattr(m, "qweight", None)] if w is not None]
    held.append(lm.model.token_embd.weight)
    assert all(isinstance(w, BlockQWeight) and w.tiled for w in held)
    f = open_gguf(default_path)
    file_bytes = sum(int(t.n_bytes) for t in f.tensors.values())
    assert sum(w.nbytes for w in held) <= file_bytes
    assert all(w.data.untyped_storage().nbytes() == w.nbytes for w in held)  # own storage, not the mmap


def rounded(x: torch.Tensor) -> torch.Tensor:
    return round_like_kernels(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def hooked_reference(ref, fast):
    """Make ref's products see their input rounded as fast's kernels round it (quantized weights)."""
    mods = dict(ref.named_modules())
    for name, m in fast.named_modules():
        if isinstance(m, Linear) and isinstance(m.w, BlockQWeight) and m.w.qtype not in DENSE:
            mods[name].register_forward_pre_hook(lambda _m, a: (rounded(a[0]),))
    # The head (output, or token_embd when tied) is multiplied by model.forward itself, fed by output_norm.
    ref.output_norm.register_forward_hook(lambda _m, _a, out: rounded(out))


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "llama3"])
def test_decode_step_matches_reference_forward(tiny, case):
    """One C++ call per token gives the logits of the dense model's forward (inputs of quantized
    products rounded alike), and fills the cache as the torch path does."""
    path = str(tiny.gguf(case, Q.Q8_0))
    rt = load_model(path, "cpu").runtime
    fast = rt.model
    ref = load_model(path, "cpu", torch.float32, keep_quantized=False).model
    hooked_reference(ref, fast)
    tokens = torch.randint(0, fast.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    cache, ref_cache = rt.new_cache(12), make_cache(fast.cfg, 12)
    assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(cache) is not None
    with torch.inference_mode():
        rt.prefill(cache, tokens[:, :6].tolist(), 0)
        ref(tokens[:, :6], ref_cache, 0)
        for i in range(6, 9):
            got, want = rt.decode(cache, tokens[:, i])[:, None], ref(tokens[:, i:i + 1], ref_cache, i)
            assert rel(got, want) < 1e-4, f"step {i}"  # unrounded inputs: ~5e-3 with int8, ~2e-5 int16
    assert rel(cache.k[:, :, :, :9], ref_cache.k[:, :, :, :9]) < 1e-4


def greedy(lm, ids: list[int], n: int) -> list[int]:
    cache = lm.runtime.new_cache(len(ids) + n + 1)
    return list(generate(lm.runtime, cache, ids, Sampler(SamplingSettings(temperature=0)), n))


LONG_PROMPT = (  # ~130 tokens: a prompt past QMATVEC_MAX_ROWS, multiplied as a batch
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of the "
    "one hundred and twelve steps as his father had taught him. At the top he trimmed the wick, polished "
    "the great lens until it gleamed, and wrote the weather in a leather book: wind from the north-east, "
    "a grey swell, two fishing boats returning late. The village below had grown quiet over the years. "
    "Children left for the cities, the cannery closed, and the ferry came only twice a week. Still he "
    "kept the light burning, because a ship"
)


@pytest.mark.parametrize("prompt", ["Once upon a time, there was a little",
                                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                                    LONG_PROMPT], ids=["readme", "chat", "long"])
def test_default_model_greedy_64_equals_reference(default_lm, cpu_lm, prompt):
    """The README prompt has a near tie at its 13th token (top-2 logits 0.003 apart): int8-rounded
    activations, llama.cpp's, flip it; the int16 ones do not."""
    cpu = cpu_lm
    ids = encode_prompt(cpu, prompt)
    assert len(ids) > QMATVEC_MAX_ROWS or prompt != LONG_PROMPT
    assert greedy(cpu, ids, 64) == greedy(default_lm, ids, 64)


def test_gguf_header_cache(default_path, tiny, tmp_path, monkeypatch):
    """A large metadata section is parsed once: the second open reads the cache (the section's parser
    is made to fail) and gives the same metadata and tensor table; a changed file is parsed again; a
    small section is never cached. Corrupt and stale entries: tests/test_header_cache.py."""
    import localllm.gguf_file as gf

    path, cache_dir = tmp_path / "model.gguf", tmp_path / "cache"
    shutil.copyfile(default_path, path)
    first = open_gguf(path, cache_dir=cache_dir)
    entries = list((cache_dir / "gguf").glob("*.json"))
    assert len(entries) == 1
    parse = gf.read_kv_section
    with monkeypatch.context() as m:
        m.setattr(gf, "read_kv_section", lambda *a: pytest.fail("the cached section was parsed again"))
        second = open_gguf(path, cache_dir=cache_dir)
    assert second.metadata == first.metadata
    table = lambda f: {n: (t.tensor_type, t.data.shape, t.data_offset) for n, t in f.tensors.items()}  # noqa: E731
    assert table(second) == table(first)
    # A changed header (same size: one letter of a key) is parsed again.
    parsed = []
    monkeypatch.setattr(gf, "read_kv_section", lambda *a: parsed.append(1) or parse(*a))
    data = bytearray(path.read_bytes())
    data[data.index(b"general.name")] = ord("G")
    path.write_bytes(bytes(data))
    changed = open_gguf(path, cache_dir=cache_dir)
    assert parsed and "General.name" in changed.metadata and "general.name" not in changed.metadata
    open_gguf(tiny.gguf("llama"), cache_dir=cache_dir)
    assert len(list((cache_dir / "gguf").glob("*.json"))) == 1


def test_mxfp4_tiles_take_every_e8m0_byte():
    """MXFP4 tiles keep the file's E8M0 bytes and 4-bit codes (cpu_tiles.h): all 256 scale bytes
    (e < 2: subnormal scales) and all codes decode to dequantize_torch's values bit for bit, and the
    tiles are no larger than the blocks (N a multiple of 8)."""
    g = torch.Generator().manual_seed(3)
    N, K = 61, 512
    raw = torch.randint(0, 256, (N, K // 32 * 17), generator=g, dtype=torch.uint8)
    raw.view(N, -1, 17)[:, :, 0] = torch.arange(N * K // 32).remainder(256).to(torch.uint8).view(N, -1)
    ref = dequantize_torch(raw, Q.MXFP4)
    w = pack_for_cpu(BlockQWeight.from_blocks(raw, Q.MXFP4, torch.float32), kernels())
    assert w.tiled and w.nbytes == (N + 7) // 8 * 8 * raw.shape[1]
    assert torch.equal(dequantize_rows(w, 0, N), ref)
    assert torch.equal(dequantize_rows(w, 13, 27), ref[13:27])


def test_q6k_tiles_take_every_bit_pattern():
    """Q6_K tiles hold the low nibbles, two 2-bit planes of the top bits, the file's int8 scales and
    fp16 d (cpu_tiles.h: 224 bytes a tile-group, 7 bits a weight): random block bytes (every 6-bit
    value, scales -128..127, both signs of d) decode to dequantize_torch's values bit for bit, and
    products at 1, 3 and 19 rows of x equal the fp64 reference's."""
    g = torch.Generator().manual_seed(6)
    N, K = 61, 512
    raw = torch.randint(0, 256, (N, K // 256 * 210), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 256, generator=g) * 2 - 1).to(torch.float16)
    raw.view(N, -1, 210)[:, :, 208:] = d.view(torch.uint8).view(N, -1, 2)
    ref = dequantize_torch(raw, Q.Q6_K)
    w = pack_for_cpu(BlockQWeight.from_blocks(raw, Q.Q6_K, torch.float32), kernels())
    assert w.tiled and w.nbytes == (N + 7) // 8 * (K // 32) * 224
    assert torch.equal(dequantize_rows(w, 0, N), ref)
    assert torch.equal(dequantize_rows(w, 13, 27), ref[13:27])
    for T in (1, 3, 19):
        x = torch.randn(T, K, generator=g)
        assert rel(qlinear(x, w), round_like_kernels(x).double() @ ref.double().T) < 2e-6
