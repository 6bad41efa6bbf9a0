"""`localllm quantize IN OUT TYPE` on a GGUF without torch (commands/quantize_native.py).

Oracle: the torch path (quantize_cmd.quantize_model, whose bytes tests/test_quantize_cmd.py checks
against llama.cpp's types and gguf.quants): the two files must be byte for byte equal, for each preset
family (32-value, K-quants, float) from F32, F16 and BF16 inputs and a requantize. And the CLI run of
such a preset, in a fresh interpreter, must finish without torch ever imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tiny_gguf import gguf_tensors, write_gguf
from tiny_spec import TinySpec
from localllm.commands.quantize_cmd import quantize_model
from localllm.commands.quantize_native import quantize_native
from localllm.errors import LocalLLMError
from localllm.kernels import cpu_encode_lib
from localllm.quantize import blocks

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
# dim 256: the K-quants apply to the attention matrices too; ffn rows of 512
SPEC = TinySpec("llama", dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, n_layers=2, seed=5)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("native")
    return {q: write_gguf(SPEC, folder / f"in-{q.name}.gguf", q) for q in (Q.F32, Q.F16, Q.BF16)}


def both(tmp_path, src, preset, **kw) -> tuple[bytes, bytes]:
    ours = quantize_native(str(src), tmp_path / "native.gguf", preset, threads=2, progress=False, **kw)
    assert ours is not None, "the torch-free path declined"
    quantize_model(str(src), tmp_path / "torch.gguf", preset, device="cpu", progress=False, **kw)
    return (tmp_path / "native.gguf").read_bytes(), (tmp_path / "torch.gguf").read_bytes()


@pytest.mark.parametrize("source, preset", [
    (Q.F16, "Q8_0"), (Q.F16, "Q4_0"), (Q.F32, "Q5_1"), (Q.BF16, "Q4_1"),
    (Q.F16, "Q4_K_M"), (Q.F32, "Q6_K"), (Q.BF16, "Q3_K_M"),
    (Q.F16, "F32"), (Q.F32, "F16"), (Q.F16, "BF16"),
])
def test_same_bytes_as_the_torch_path(inputs, tmp_path, source, preset):
    native, reference = both(tmp_path, inputs[source], preset)
    assert native == reference


def test_requantize_same_bytes(inputs, tmp_path):
    q8 = tmp_path / "q8.gguf"
    quantize_model(str(inputs[Q.F16]), q8, "Q8_0", device="cpu", progress=False)
    native, reference = both(tmp_path, q8, "Q4_K_M")
    assert native == reference
    with pytest.raises(LocalLLMError, match="already quantized"):
        quantize_native(str(q8), tmp_path / "refused.gguf", "Q4_K_M", threads=1, allow_requantize=False, progress=False)
    assert not (tmp_path / "refused.gguf").exists()


def test_declines_what_it_cannot_encode(inputs, tmp_path, monkeypatch, capsys):
    """IQ4_NL has no C++ encoder here; no compiler: a note. Then None, nothing written (the CLI takes the torch path)."""
    assert quantize_native(str(inputs[Q.F16]), tmp_path / "a.gguf", "IQ4_NL", threads=1, progress=False) is None
    monkeypatch.setattr(cpu_encode_lib, "compiler", lambda: None)
    assert quantize_native(str(inputs[Q.F16]), tmp_path / "b.gguf", "Q8_0", threads=1, progress=False) is None
    assert "no C++ compiler" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_non_finite_refused(tmp_path):
    w = gguf_tensors(SPEC)
    w["blk.0.attn_q.weight"][3, 7] = np.nan
    src = tmp_path / "nan.gguf"
    write_gguf(SPEC, src, Q.F16, raw={"blk.0.attn_q.weight": (w["blk.0.attn_q.weight"].astype(np.float16), Q.F16)})
    with pytest.raises(LocalLLMError, match="cannot quantize tensor 'blk.0.attn_q.weight' to Q4_K: cannot quantize non-finite"):
        quantize_native(str(src), tmp_path / "out.gguf", "Q4_K_M", threads=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]


def test_thread_rule_is_the_torch_paths():
    """One rule (type_facts.encode_threads) for both paths: all threads from PARALLEL_MIN_WORK on, a
    K-quant value counting 8."""
    import torch

    from localllm.quantize.type_facts import PARALLEL_MIN_WORK, encode_threads

    n = torch.get_num_threads()
    for values, qtype in [(PARALLEL_MIN_WORK, Q.Q8_0), (PARALLEL_MIN_WORK - 1, Q.Q8_0),
                          (PARALLEL_MIN_WORK // 8, Q.Q4_K), (PARALLEL_MIN_WORK // 8 - 1, Q.Q4_K)]:
        assert blocks.write_threads(values, qtype) == encode_threads(values, qtype, n)
    assert encode_threads(PARALLEL_MIN_WORK - 1, Q.Q8_0, 7) == 1 and encode_threads(PARALLEL_MIN_WORK // 8, Q.Q4_K, 7) == 7


def test_cli_imports_no_torch(inputs, tmp_path):
    """The whole CLI run in a fresh interpreter: the file written, equal to the torch path's, torch never imported."""
    out = tmp_path / "cli.gguf"
    code = ("import sys; from localllm.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, "quantize", str(inputs[Q.F16]), str(out), "Q4_K_M"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr
    quantize_model(str(inputs[Q.F16]), tmp_path / "torch.gguf", "Q4_K_M", device="cpu", progress=False)
    assert out.read_bytes() == (tmp_path / "torch.gguf").read_bytes()
