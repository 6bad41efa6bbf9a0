"""The decode step's Triton kernels compile for Hopper (sm_90) as the CUDA backend launches them:
tests/compile_sm90.py's cases, compiled by Triton's CUDA backend (ptxas) on this machine, no GPU needed,
in a process of its own (no TRITON_INTERPRET there: interpreted kernels cannot be compiled). Catches a
kernel whose new argument or constexpr the GPU would first meet on the device."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (not imported here: this process's first import of triton must come after the Triton test modules set
# TRITON_INTERPRET, or their kernels run uninterpreted; tests/conftest.py)
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (it ships the CUDA backend's ptxas)", allow_module_level=True)
SCRIPT = Path(__file__).resolve().parent / "compile_sm90.py"


def test_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(SCRIPT.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 25, done.stdout[-2000:]
    failed = {r["case"]: r["error"][:600] for r in rows if r["error"]}
    assert not failed, failed
