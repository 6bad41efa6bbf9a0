"""A cached virtual environment with llama-cpp-python (llama.cpp built from source by pip), for
benchmarks that run llama.cpp beside localllm. Not a dependency of localllm itself.

    python bench/llamacpp_env.py            # create or reuse it; prints its python
    LLAMACPP_VENV=/path python bench/...    # (only the benchmarks read this, to pick another cache)

The first build takes several minutes (llama.cpp compiles from source); later runs reuse the cached environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

PACKAGE = "llama-cpp-python"


def venv_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_VENV", Path.home() / ".cache" / "localllm" / "llamacpp-venv"))


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def has_llama_cpp(python: Path) -> bool:
    return python.exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def ensure_llamacpp() -> Path:
    """Python of the cached venv with llama_cpp importable; builds it on first use."""
    python = venv_python()
    if has_llama_cpp(python):
        return python
    print(f"building {PACKAGE} into {venv_dir()} (about 6 minutes on 2 cores) ...", file=sys.stderr)
    venv.create(venv_dir(), with_pip=True)
    subprocess.run([python, "-m", "pip", "install", "-q", PACKAGE, "numpy"], check=True)
    return python


def run_llamacpp(code: str, *args: str) -> str:
    """Run a Python snippet in the llama.cpp venv; returns its stdout."""
    out = subprocess.run([ensure_llamacpp(), "-c", code, *args], check=True, capture_output=True, text=True)
    return out.stdout


if __name__ == "__main__":
    print(ensure_llamacpp())
