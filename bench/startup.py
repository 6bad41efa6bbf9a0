"""Start-up as the user sees it: a whole `localllm complete` process, timed from spawn to its first
streamed byte (the first token: complete does not echo the prompt) and to its exit.

Issue 20's goal (CUDA, warm caches): first token <= 1.0 s after the command starts, the whole command
<= 1.5 s + generation time; on a cold machine, visible progress and the first token <= 20 s.
The first run of a fresh cache directory is "cold" (Triton / C++ builds: run 0 on a fresh machine, or
with --cold-home); later runs are "warm".

    python bench/startup.py MODEL --device cuda -n 256 -r 5 [--cold-home DIR]
    python bench/startup.py NAME --server http://127.0.0.1:8080 -n 256 -r 5   # against a running `localllm serve`
    python bench/startup.py MODEL --device cuda --keep-alive 5m -r 5   # run 0 starts the background server

With --keep-alive every run uses one HOME (--cold-home's, if given), so run 0 starts the background server
(its load and compilation counted) and the later runs stream from it; the server is stopped at the end.

Prints one line per run and the median of the warm runs; the generation time is the process's own
figure (complete -v's "generated N tokens, X tokens/s").
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

GEN = re.compile(r"generated (\d+) tokens, ([\d.]+) tokens/s")


def run_once(cmd: list[str], env: dict) -> tuple[float, float, float, str]:
    """-> (seconds to the first stdout byte, seconds to exit, seconds of generation, stderr)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0
    p.stdout.read()
    err = p.stderr.read().decode(errors="replace")
    p.wait()
    t_end = time.perf_counter() - t0
    if p.returncode != 0 or not first:
        sys.exit(f"command failed ({p.returncode}): {err.strip()[-500:]}")
    m = GEN.search(err)
    gen = int(m.group(1)) / float(m.group(2)) if m and float(m.group(2)) > 0 else 0.0
    return t_first, t_end, gen, err


def write_model(spec: str, out: str, vocab: str) -> None:
    """A random-weight GGUF of a models.toml preset (the GPU comparisons' files: bench/vs_llamacpp_gpu.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from vs_llamacpp_gpu import preset_config, read_vocab

    from localllm.synthetic import write_synthetic_gguf

    preset, wtype = spec.split(":")
    tokenizer = read_vocab(Path(vocab))
    cfg = preset_config(preset, len(tokenizer["tokenizer.ggml.tokens"].value))
    write_synthetic_gguf(cfg, wtype, Path(out), tokenizer, "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-p", "--prompt", default="The capital of France is")
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--cold-home", help="a fresh HOME for the first run (empty kernel caches): a cold start")
    ap.add_argument("--synthetic", metavar="PRESET:TYPE", help="first write MODEL as a random-weight GGUF of this "
                    "models.toml preset and file type (e.g. smollm2-135m:Q4_1), with --vocab's tokenizer")
    ap.add_argument("--vocab", default="tests/data/vocab/ggml-vocab-gpt-2.gguf")
    ap.add_argument("--server", metavar="URL", help="time `complete --server URL` instead (MODEL: a model name the "
                    "running server lists): the command loads nothing, the server holds the model")
    ap.add_argument("--keep-alive", metavar="DURATION", help="time `complete --keep-alive DURATION` (a background "
                    "server started by run 0, kept for the later runs, stopped at the end)")
    ap.add_argument("--stderr", metavar="PREFIX", help="write each run's whole stderr to PREFIX.N (the spinner "
                    "and progress lines of a cold run)")
    a = ap.parse_args()
    if a.synthetic:
        write_model(a.synthetic, a.model, a.vocab)
    cmd = [sys.executable, "-m", "localllm.cli", "complete", a.model, "-p", a.prompt, "-n", str(a.n),
           "--temp", "0", "-v"] + (["--server", a.server] if a.server else ["--device", a.device])
    cmd += ["--keep-alive", a.keep_alive] if a.keep_alive else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs = []
    for i in range(a.runs):
        e = dict(env, HOME=a.cold_home) if a.cold_home and (i == 0 or a.keep_alive) else env
        first, end, gen, err = run_once(cmd, e)
        runs.append((first, end, gen))
        if a.stderr:
            with open(f"{a.stderr}.{i}", "w") as f:
                f.write(err)
        print("  " + err.strip().splitlines()[-1] if err.strip() else "")
        print(f"run {i}: first token {first:.2f} s, "
              f"whole {end:.2f} s, generation {gen:.2f} s, whole - generation {end - gen:.2f} s", flush=True)
    if a.keep_alive:  # the background servers recorded under the runs' HOME (localllm/resident.py)
        from localllm.resident import stop_running

        stop_running(Path(a.cold_home or Path.home()) / ".cache" / "localllm" / "resident")
    warm = runs[1:] if len(runs) > 1 else runs
    print(f"warm median: first token {statistics.median(r[0] for r in warm):.2f} s, "
          f"whole - generation {statistics.median(r[1] - r[2] for r in warm):.2f} s")


if __name__ == "__main__":
    main()
