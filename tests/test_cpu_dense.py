"""F32 / F16 / BF16 weights on the CPU (issue 20): GGUF files and safetensors folders keep their linear
weights and embedding as rows of the stored type (BlockQWeight; load.dense_as_blocks, Runtime.dense_blocks),
multiplied by the dense C++ products (cpu_quant.cpp dense_rows_of) in the one-call decoder, and by torch's
fp32 GEMM for long prompts (kernels/cpu.py fp32_rows).

Oracle: the portable torch forward (runtime.Runtime) on the same file decoded to fp32 (the stored values
exactly): logits of the prompt (short: C++ products; past QMATVEC_MAX_ROWS: the GEMM) and of every C++
decode step, and greedy ids for 64 tokens.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

import tiny_models as tm
from tiny_gguf import gguf_tensors, write_gguf
from tiny_hf import write_hf_folder
from tiny_spec import TinySpec
from localllm.backends.cpu import CpuRuntime
from localllm.kernels.cpu import QMATVEC_MAX_ROWS, BlockQWeight
from localllm.load import load_model
from localllm.model import Linear, QEmbedding
from localllm.runtime import Runtime
from test_cpu_kernels import greedy, rel

Q = gguf.GGMLQuantizationType
SPEC = tm.case_spec("llama")


def bf16_raw(spec: TinySpec) -> dict:
    """Every 2-D tensor of the tiny model as BF16 rows (tiny_models writes F32 and F16 only)."""
    return {n: (gguf.quants.quantize(d.astype(np.float32), Q.BF16), Q.BF16)
            for n, d in gguf_tensors(spec).items() if d.ndim == 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dense")
    return {
        "F32": write_gguf(SPEC, root / "f32.gguf", Q.F32),
        "F16": write_gguf(SPEC, root / "f16.gguf", Q.F16),
        "BF16": write_gguf(SPEC, root / "bf16.gguf", raw=bf16_raw(SPEC)),
        "hf-float16": write_hf_folder(replace(SPEC, storage_dtype="float16"), root / "hf16"),
        "hf-bfloat16": write_hf_folder(replace(SPEC, storage_dtype="bfloat16"), root / "hfbf16"),
    }


STORED = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "hf-float16": Q.F16, "hf-bfloat16": Q.BF16}


@pytest.mark.parametrize("kind", list(STORED))
def test_dense_weights_run_the_cpp_decoder_like_the_reference(files, kind):
    lm = load_model(str(files[kind]), "cpu")
    ref = load_model(str(files[kind]), "cpu", torch.float32, backend=Runtime)
    rt = lm.runtime
    held = [m.w for m in lm.model.modules() if isinstance(m, Linear)]
    assert isinstance(lm.model.token_embd, QEmbedding)
    assert all(isinstance(w, BlockQWeight) and w.qtype == STORED[kind] for w in [*held, lm.model.token_embd.weight])
    assert not any(isinstance(m.w, BlockQWeight) for m in ref.model.modules() if isinstance(m, Linear))
    tokens = torch.randint(0, lm.config.vocab_size, (1, QMATVEC_MAX_ROWS + 12),
                           generator=torch.Generator().manual_seed(3))
    for prompt in (5, QMATVEC_MAX_ROWS + 4):  # C++ products, then torch's GEMM on the rows
        cache, ref_cache = rt.new_cache(prompt + 8), ref.runtime.new_cache(prompt + 8)
        assert isinstance(rt, CpuRuntime) and rt.cpp_decoder(cache) is not None
        got = rt.prefill(cache, tokens[:, :prompt].tolist())
        assert rel(got, ref.runtime.prefill(ref_cache, tokens[:, :prompt].tolist())) < 1e-5
        for i in range(prompt, prompt + 8):
            got = rt.decode(cache, tokens[:, i])
            assert rel(got, ref.runtime.decode(ref_cache, tokens[:, i])) < 1e-5, f"{kind}: step {i}"


@pytest.mark.parametrize("kind", ["F16", "hf-bfloat16"])
def test_dense_greedy_64_equals_reference(files, kind):
    lm = load_model(str(files[kind]), "cpu")
    ref = load_model(str(files[kind]), "cpu", torch.float32, backend=Runtime)
    ids = lm.tokenizer.encode("Once upon a time", add_bos=True, parse_special=False)
    assert greedy(lm, ids, 64) == greedy(ref, ids, 64)


def test_float16_folder_holds_the_f16_files_rows_in_its_layout(files):
    """A float16 folder and the F16 GGUF of the same weights (issue 20, folder as fast as file): every
    linear weight and the embedding the same BlockQWeight (type, shape, layout, the same bytes), so the
    same C++ kernels read the same rows (the prompt GEMM, the decoder's streams)."""
    def weights(path):
        m = load_model(str(path), "cpu").model
        return {n: m_.w for n, m_ in m.named_modules() if isinstance(m_, Linear)} | {"token_embd": m.token_embd.weight}

    folder, file = weights(files["hf-float16"]), weights(files["F16"])
    assert folder.keys() == file.keys() and len(folder) > 1
    for name, w in folder.items():
        f = file[name]
        assert (w.qtype, w.shape, w.tiled, sorted(w.parts)) == (f.qtype, f.shape, f.tiled, sorted(f.parts)), name
        assert w.data.is_contiguous() and w.ext is not None and w.ext is f.ext, name
        assert torch.equal(w.data, f.data), name
