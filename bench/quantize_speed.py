"""Quantize time against llama.cpp's (llama_model_quantize, what llama-quantize runs), same input.

    python bench/quantize_speed.py [--type Q4_K_M Q8_0] [--rounds 3] [--work DIR] [--device cpu]
    python bench/quantize_speed.py --target-bpw 4.5     # ours only: llama.cpp has no such mode
    python bench/quantize_speed.py --base synth-8b-f16.gguf --target-bpw 4.5 --device cuda --rounds 1
    python bench/quantize_speed.py --synthetic llama-3.1-8b --target-bpw 4.5 --device cuda --rounds 1

Input: an F16 GGUF of the default model (`localllm quantize smollm2-135m base-f16.gguf --type F16`,
the Q4_1 file's values decoded), the fair input for both tools (llama.cpp would need --allow-requantize
for the Q4_1 file). Rounds interleave ours and llama.cpp's (ours, theirs, ours, theirs...) so that a
shared machine's load hits both alike; per round the ratio of wall seconds, and the median of those
ratios. Each of our runs also prints its phase line (`time: read ..., write ...`).
llama.cpp runs with nthread = the CPU count (its default, llama-quantize's too).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_env import run_llamacpp  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

QUANTIZE = """
import ctypes, os, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3]); p.nthread = os.cpu_count()
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def child_cpu() -> float:
    """User + system CPU seconds of the waited-for child processes so far: a run's delta is its CPU time,
    steadier than wall time on a shared machine (where a single-threaded start-up gets a smaller share)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ours(base: Path, out: Path, device: str, *args: str) -> tuple[float, str, float]:
    """(wall seconds, the phase line and CPU seconds, CPU seconds) of `localllm quantize BASE OUT ARGS`."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "quantize", str(base), str(out), "--device", device, *args]
    start, cpu = time.perf_counter(), child_cpu()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    phases = re.search(r"time: (.*)", done.stderr)
    cpu = child_cpu() - cpu
    return seconds, f"{phases.group(1) if phases else '?'}; CPU {cpu:.1f} s", cpu


def theirs(base: Path, out: Path, ftype: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of llama_model_quantize's process."""
    start, cpu = time.perf_counter(), child_cpu()
    run_llamacpp(QUANTIZE, str(base), str(out), ftype)
    return time.perf_counter() - start, child_cpu() - cpu


def synthetic_base(preset: str, work: Path, device: str) -> Path:
    """WORK/PRESET-F16.gguf: the preset's shape with random weights (localllm.synthetic, as `localllm bench
    --synthetic` makes them) and the llama-bpe test vocabulary's tokenizer keys (its token count)."""
    from dataclasses import replace
    from localllm.commands.quantize_cmd import read_gguf_metadata
    from localllm.registry import shape_preset
    from localllm.synthetic import write_synthetic_gguf
    path = work / f"{preset}-F16.gguf"
    if path.exists():
        return path
    vocab = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"
    tok = read_gguf_metadata(vocab, keep=lambda key: key.startswith("tokenizer."))
    cfg = replace(shape_preset(preset), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
    start = time.perf_counter()
    write_synthetic_gguf(cfg, "F16", path, tok, device)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", nargs="+", default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--target-bpw", type=float, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="/tmp/localllm-quantize-speed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--base", default=None, help="input GGUF (default: WORK/base-f16.gguf, made from smollm2-135m)")
    ap.add_argument("--synthetic", default=None, metavar="PRESET",
                    help="input: an F16 GGUF of this models.toml shape with random weights (WORK/PRESET-F16.gguf), "
                         "the llama-bpe test vocabulary's tokenizer")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = Path(args.base) if args.base else work / "base-f16.gguf"
    if args.synthetic:
        base = synthetic_base(args.synthetic, work, args.device)
    if not base.exists():
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "quantize", "smollm2-135m", str(base), "--type", "F16",
                        "--allow-requantize"],  # the default file is Q8_0
                       check=True, capture_output=True)
    print(f"cpu: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (a shared machine)")
    if args.target_bpw is not None:
        for r in range(args.rounds):
            s, phases, _ = ours(base, work / "ours-bpw.gguf", args.device, "--target-bpw", str(args.target_bpw))
            print(f"--target-bpw {args.target_bpw} round {r}: {s:.1f} s ({phases})", flush=True)
        return
    for ftype in args.type:
        ratios, cpu_ratios = [], []
        for r in range(args.rounds):
            a, phases, a_cpu = ours(base, work / f"ours-{ftype}.gguf", args.device, "--type", ftype)
            b, b_cpu = theirs(base, work / f"llamacpp-{ftype}.gguf", ftype)
            ratios.append(a / b)
            cpu_ratios.append(a_cpu / b_cpu)
            print(f"{ftype} round {r}: ours {a:.1f} s ({phases}), llama.cpp {b:.1f} s (CPU {b_cpu:.1f} s), "
                  f"ratio {a / b:.2f} (CPU {a_cpu / b_cpu:.2f})", flush=True)
        print(f"{ftype}: median ratio ours / llama.cpp {statistics.median(ratios):.2f} over {args.rounds} rounds "
              f"(CPU seconds: {statistics.median(cpu_ratios):.2f}); load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
