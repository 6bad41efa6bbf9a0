"""Gemma 4 on CUDA (the eager runtime: CudaEagerRuntime runs model.py's forward on QWeights and the
Triton products) against the CPU fp32 reference of the same file, on the tiny Gemma 4 checkpoints of
tests/tiny_gemma4.py (tests/test_gemma4.py checks that reference against transformers): F32 in fp32
(the same math: 1e-3) and Q8_0 in bf16.

bf16's bound: test_gpu_logits.py's 5e-2, or twice the error of the CPU's own bf16 forward on the same
weights where that is larger: these tiny random checkpoints amplify rounding (the CPU bf16 forward is
0.02-0.16 off fp32 on them: PLE, KV sharing and a soft cap of 2), and a wrong layer gives errors near 1."""

from __future__ import annotations

import pytest
import torch

import tiny_gemma4 as g4
from tiny_spec import Q
from tiny_tokenizer import vocab_size

from .gpu_helpers import check_speculative_equals_plain, random_ids, rel, round_inputs_as_int_dot, take_dense_values

PROMPT, STEPS = 12, 6


def logits(rt, ids: list[int]) -> list[torch.Tensor]:
    """The prompt's last logits, then one decode step's per id after it (fp32, on the CPU)."""
    cache = rt.new_cache(32)
    out = [rt.prefill(cache, [ids[:PROMPT]], 0)[0].float().cpu()]
    for t in ids[PROMPT:]:
        out.append(rt.decode(cache, torch.tensor([t], device=rt.device))[0].float().cpu())
    return out


@pytest.mark.parametrize("wtype,dtype", [("F32", torch.float32), ("Q8_0", torch.bfloat16)])
@pytest.mark.parametrize("case", list(g4.CASES))
@torch.inference_mode()
def test_cuda_gemma4_logits_match_cpu_fp32(tmp_path, case, wtype, dtype):
    from localllm.load import load_model

    spec = g4.CASES[case]
    folder = g4.write_hf_folder(spec, tmp_path / "hf")
    path = g4.write_gguf(spec, folder, tmp_path / f"{case}-{wtype}.gguf", Q[wtype])
    gpu = load_model(str(path), "cuda", dtype).runtime
    ref = load_model(str(path), "cpu", torch.float32, keep_quantized=False).runtime
    take_dense_values(ref.model, gpu.model)
    ids = random_ids(vocab_size(), PROMPT + STEPS, seed=3)
    want, got = logits(ref, ids), logits(gpu, ids)
    if dtype == torch.float32:
        bounds = [1e-3] * len(want)
    else:
        cpu = load_model(str(path), "cpu", dtype, keep_quantized=False).runtime
        take_dense_values(cpu.model, gpu.model)
        round_inputs_as_int_dot(cpu.model)  # Q8_0 products on CUDA quantize their inputs
        bounds = [max(5e-2, 2 * rel(c, w)) for c, w in zip(logits(cpu, ids), want)]
    errs = [rel(g, w) for g, w in zip(got, want)]
    assert all(e < b for e, b in zip(errs, bounds)), (errs, bounds)


@pytest.mark.parametrize("wtype,dtype", [("F32", torch.float32), ("Q8_0", torch.bfloat16)])
@pytest.mark.parametrize("case", list(g4.CASES))
@torch.inference_mode()
def test_cuda_gemma4_greedy_speculative_equals_plain(tmp_path, case, wtype, dtype):
    """Prompt lookup on a repetitive prompt (verify passes of up to 6 rows through the eager runtime's
    forward) yields plain greedy decoding's ids."""
    from localllm.load import load_model

    spec = g4.CASES[case]
    folder = g4.write_hf_folder(spec, tmp_path / "hf")
    rt = load_model(str(g4.write_gguf(spec, folder, tmp_path / f"{case}.gguf", Q[wtype])), "cuda", dtype).runtime
    check_speculative_equals_plain(rt, random_ids(vocab_size(), 12, seed=2) * 4, 40)
