"""llama.cpp's -ngl on a CUDA GPU: accepted, said once that every layer runs on the GPU, and the output
is the same as without it (greedy, the tiny model)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from _bad_files import write_tiny_model


def test_ngl_on_cuda_said_once_same_text(tmp_path):
    from localllm.cli import app

    model = write_tiny_model(tmp_path / "tiny.gguf")
    args = ["complete", str(model), "the the", "-n", "6", "--temp", "0", "--device", "cuda", "--json"]
    plain = CliRunner().invoke(app, args)
    ngl = CliRunner().invoke(app, [*args, "-ngl", "99"])
    assert plain.exit_code == 0 and ngl.exit_code == 0, plain.output + ngl.output
    assert json.loads(ngl.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert ngl.stderr.count("-ngl 99: every layer runs on the GPU") == 1, ngl.stderr
