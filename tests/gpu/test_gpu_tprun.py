"""`--tp 2` through the CLI on 2 GPUs (issue 23; commands/tp_cmd.py, localllm/tp_runtime.py): the launch,
the driver/worker protocol over NCCL, greedy output repeated bit for bit run to run, speculative decoding
(--lookup, --draft) giving plain decoding's greedy text at TP=2, the GPU-count error, and
`bench --tp 1,2` gathering both degrees' rows. Needs 2 GPUs (skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_gguf import write_gguf  # noqa: E402
from tiny_spec import TinySpec  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([sys.executable, "-m", "localllm.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = TinySpec("llama", dim=256, ffn_dim=512, n_heads=8, n_kv_heads=2, head_dim=64, seed=21)
    return write_gguf(spec, tmp_path_factory.mktemp("tprun") / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)


def test_tp2_greedy_repeats_and_speculative_agrees(model):
    args = ["complete", model, "the cat sat on the mat. the cat", "-n", "24", "--temp", "0", "--device", "cuda", "--tp", "2"]
    runs = [cli(*args), cli(*args), cli(*args, "--lookup", "2"), cli(*args, "--draft", model, "--draft-max", "3")]
    for r in runs:  # nothing on stderr but the progress lines of a first run's kernel compilation
        noise = [line for line in r.stderr.splitlines() if not line.endswith(" s elapsed")]
        assert r.returncode == 0 and r.stdout.strip() and noise == [], r.stderr
    assert len({r.stdout for r in runs}) == 1, [r.stdout for r in runs]


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="needs fewer than 8 GPUs")
def test_tp_more_than_the_gpus(model):
    r = cli("complete", model, "hi", "--device", "cuda", "--tp", "8")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"--tp 8 needs 8 GPUs, {torch.cuda.device_count()} found" in lines[0]


def test_bench_tp_1_2(model):
    r = cli("bench", model, "-p", "16", "-n", "16", "-r", "2", "--device", "cuda", "--tp", "1,2", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert sorted({row["tp"] for row in rows}) == [1, 2] and all(row["tps_mean"] > 0 for row in rows)
