"""--target-bpw's calibration on CUDA (issue 20: an 8B model on one H100): the Fisher rows on the GPU
are the whole diagonal's rows there too, the Fisher passes' peak memory
is the model plus about one gradient (not a second and third copy of every weight, as when the whole
fp32 Fisher and every gradient were held at once), and a real CUDA out-of-memory in the CLI is one line.
"""

from __future__ import annotations

import torch

import tiny_models as tm
from tiny_gguf import write_gguf
from test_fisher_rows import whole_fisher  # the oracle: the whole diagonal as plan_mixed computed it before
from localllm.runtime import Runtime

CHUNKS = [list(range(3, 131)), list(range(500, 628))]  # 2 chunks of 128 tokens (calibration: 4 of 256)


def sampled(lm):
    """plan_mixed's rows: every 2-D / 3-D parameter's sample_rows(rows, SAMPLE_ROWS)."""
    from localllm.mixed import SAMPLE_ROWS
    from localllm.quantize.plan import sample_rows

    return {n: sample_rows(p.numel() // p.shape[-1], SAMPLE_ROWS) for n, p in lm.model.named_parameters()
            if p.dim() in (2, 3)}


def test_cuda_fisher_rows_equal_whole_fisher_rows(tmp_path):
    """On CUDA too, the kept rows are the whole diagonal's (to the rounding of CUDA's atomic sums)."""
    from localllm.fisher import fisher_rows
    from localllm.load import load_model

    chunks = [list(range(3, 19)), list(range(100, 116))]  # within the tiny vocabularies
    for case, spec in (("llama", tm.CASES["llama"]), ("phi3", tm.PHI_CASES["phi3"]), ("mixtral", tm.MOE_CASES["mixtral"])):
        lm = load_model(str(write_gguf(spec, tmp_path / f"{case}.gguf")), "cuda", torch.float32, keep_quantized=False,
                        backend=Runtime)  # as quantize_cmd.mixed_plan loads it: each Linear's own weight
        rows = sampled(lm)
        got, want = fisher_rows(lm.model, chunks, rows), whole_fisher(lm.model, chunks)
        for n, r in rows.items():
            w = want[n].reshape(-1, want[n].shape[-1])[r.cuda()]
            assert got[n].device.type == "cuda" and w.sum() > 0, (case, n)
            torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-7 * w.max().item(), msg=f"{case} {n}")


def test_cuda_fisher_peak_memory(synthetic_files):
    """A 2-layer model of llama-3.1-8b's widths (32000-token vocabulary), fp32 on the GPU: the Fisher
    passes add at most the largest matrix twice plus the activations of a 128-token chunk, far below
    the model's own bytes (the old whole-Fisher passes added about twice the model)."""
    from localllm.fisher import fisher_rows
    from localllm.load import load_model

    lm = load_model(str(synthetic_files.gguf("llama-3.1-8b", "F16", layers=2)), "cuda", torch.float32,
                    keep_quantized=False, backend=Runtime)
    params = [p for p in lm.model.parameters()]
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fisher = fisher_rows(lm.model, CHUNKS, sampled(lm))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    print(f"model {model_bytes / 2**30:.2f} GiB, largest matrix {largest / 2**30:.2f} GiB, "
          f"Fisher passes' extra peak {extra / 2**30:.2f} GiB")
    assert extra < 2 * largest + 2**30, extra
    assert extra < 0.5 * model_bytes, extra
    # token_embd's sampled rows are ids the chunks may not hold (their gradient is 0): every other matrix
    assert all(f.shape[0] <= 64 and (f.sum() > 0 or n.startswith("token_embd")) for n, f in fisher.items())


def test_cuda_out_of_memory_is_one_line(tmp_path, monkeypatch):
    """A real CUDA allocation failure (1 PiB) in the planning passes: one `error:` line, exit 1."""
    from typer.testing import CliRunner

    from localllm import mixed
    from localllm.cli import app

    def too_big(*args, **kwargs):
        return torch.empty(2**50, dtype=torch.uint8, device="cuda")

    monkeypatch.setattr(mixed, "fisher_rows", too_big)
    src = write_gguf(tm.CASES["llama"], tmp_path / "llama.gguf")
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(app, ["quantize", str(src), str(out), "--target-bpw", "6", "--device", "cuda"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: out of GPU memory on cuda allocating "), lines[0]
    assert "try --device cpu" in lines[0] and "Traceback" not in result.stderr
    assert not out.exists()
