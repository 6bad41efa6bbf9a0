"""Gemma 4 on CUDA (the eager runtime: CudaEagerRuntime runs model.py's forward on QWeights and the
Triton products) against the CPU fp32 reference of the same file, on the tiny Gemma 4 checkpoints of
tests/tiny_gemma4.py (tests/test_gemma4.py checks that reference against transformers): F32 in fp32
(the same math: 1e-3) and Q8_0 in bf16 (the bounds of test_gpu_logits.py)."""

from __future__ import annotations

import pytest
import torch

import tiny_gemma4 as g4
import tiny_models as tm

from .gpu_helpers import random_ids, rel, take_dense_values

PROMPT, STEPS = 12, 6


@pytest.mark.parametrize("wtype,dtype,bound", [("F32", torch.float32, 1e-3), ("Q8_0", torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("case", list(g4.CASES))
@torch.inference_mode()
def test_cuda_gemma4_logits_match_cpu_fp32(tmp_path, case, wtype, dtype, bound):
    from localllm.load import load_model

    spec = g4.CASES[case]
    folder = g4.write_hf_folder(spec, tmp_path / "hf")
    path = g4.write_gguf(spec, folder, tmp_path / f"{case}-{wtype}.gguf", tm.Q[wtype])
    gpu = load_model(str(path), "cuda", dtype).runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    take_dense_values(ref.model, gpu.model)
    ids = random_ids(tm.vocab_size(), PROMPT + STEPS, seed=3)
    cg, cc = gpu.new_cache(32), ref.new_cache(32)
    assert rel(gpu.prefill(cg, [ids[:PROMPT]], 0)[0].float(), ref.prefill(cc, [ids[:PROMPT]], 0)[0]) < bound
    for t in ids[PROMPT:]:
        lg = gpu.decode(cg, torch.tensor([t], device=gpu.device))[0].float()
        assert rel(lg, ref.decode(cc, torch.tensor([t]))[0]) < bound
