"""Mixed precision and the per-expert imatrix of mixture-of-experts models with the model on CUDA
(quantize --target-bpw loads the model dense on the encoder's device): the same statistics as the CPU
fp32 run (tests/test_mixed_moe.py checks those against transformers), and a --target-bpw file that hits
its target and stays close to the F32 model.
"""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from tiny_gguf import write_gguf

CASES = {"mixtral": 6.0, "qwen3_moe": 6.0, "gpt_oss": 7.5}  # target bits per weight (as the CPU tests)
IDS = torch.tensor([[1, 5, 9, 30, 40, 100, 200, 300, 7, 64, 128, 250, 3, 17, 90, 333]])


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_expert_imatrix_matches_cpu(tmp_path, case):
    # quantize's own measurement (--imatrix-out on --device cuda): the portable forward on the GPU
    from localllm import imatrix as IM
    from localllm.commands.quantize_mixed import measure_imatrix
    from localllm.load import load_model

    src = write_gguf(tm.MOE_CASES[case], tmp_path / f"{case}.gguf")
    chunks = [list(range(3, 43)), list(range(200, 240))]
    cpu = IM.collect_imatrix(load_model(str(src), "cpu", torch.float32, keep_quantized=False).model, chunks)
    gpu = measure_imatrix(src, chunks, "cuda", tmp_path / "imatrix.gguf")
    assert set(gpu) == set(cpu) and any(n.endswith("_exps.weight") for n in cpu)
    for name, v in cpu.items():
        assert gpu[name].shape == v.shape and gpu[name].device.type == "cpu", name
        torch.testing.assert_close(gpu[name], v, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_target_bpw_moe(tmp_path, case):
    from localllm.cache import make_cache
    from localllm.commands.quantize_cmd import quantize_model
    from localllm.load import load_model
    from localllm.quantize.plan import total_bpw

    target = CASES[case]
    src = write_gguf(tm.MOE_CASES[case], tmp_path / f"{case}.gguf")
    out = tmp_path / "mixed.gguf"
    result = quantize_model(str(src), out, None, target_bpw=target, device="cuda", progress=False)
    assert target - 0.02 <= total_bpw(result.plan) <= target
    assert all(r.note == "" for r in result.plan if r.name.endswith("_exps.weight"))
    # every phase timed on the GPU path too (the CLI prints them as "time: read ... s, ...")
    assert list(result.phases) == ["read", "load", "fisher+imatrix", "errors", "search", "write"]
    assert 0 <= sum(result.phases.values()) <= result.seconds

    def logits(path):
        lm = load_model(str(path), "cpu", torch.float32)
        return lm.model(IDS, make_cache(lm.config, IDS.shape[1]), 0)[0]

    ref, ours = logits(src), logits(out)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.25  # CPU runs: 0.06-0.16 at these targets
