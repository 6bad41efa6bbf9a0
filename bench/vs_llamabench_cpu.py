"""localllm against llama.cpp's own llama-bench on a CPU (a CPU-only build from source): the same GGUF
files (random weights of a models.toml shape, written by localllm.synthetic.write_synthetic_gguf), the
same thread count, interleaved rounds (ours, theirs, ours, theirs, ...), the median of the per-round ratios.

    python bench/vs_llamabench_cpu.py --build .out/llama_src.tgz --build-dir /tmp/llama-cpu \\
        --shape smollm2-135m --vocab tests/data/vocab/ggml-vocab-starcoder.gguf \\
        --types Q4_K_M,Q4_0,Q4_1,Q8_0,F16 -t 2 -p 512 -n 128 --rounds 3

For a CPU where llama-cpp-python (bench/vs_llamacpp.py) cannot be built, e.g. a GPU machine's host.
llama.cpp is built with GGML_NATIVE=OFF, AVX2 / AVX-512 (F, VNNI, BF16, VBMI) on and AMX off (AMX builds
can die with SIGILL on quantized models on hosts that advertise it). Tests as llama-bench defines them:
ppP = a P-token prompt into an empty context; tgN = N steps after P tokens of context (-d P); localllm
through `localllm bench FILE --device cpu -t T -p P -n N` (tgN after ppP). Each side prints its mean
over -r repetitions per round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_llamacpp_gpu as gpu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU_FLAGS = ["-G", "Ninja", "-DGGML_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
             "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=ON",
             "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def theirs(exe: Path, path: Path, threads: int, p: int, n: int, reps: int) -> dict[str, float]:
    def one(args: list[str]) -> float:
        cmd = [str(exe), "-m", str(path), "-ngl", "0", "-t", str(threads), *args, "-r", str(reps), "-o", "json"]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if out.returncode != 0:
            gpu.fail(f"llama-bench exited with {out.returncode} on {path.name}: {out.stderr.strip()[-300:]}")
        return json.loads(out.stdout[out.stdout.index("["):])[0]["avg_ts"]
    return {f"pp{p}": one(["-p", str(p), "-n", "0"]), f"tg{n}": one(["-p", "0", "-n", str(n), "-d", str(p)])}


def ours(path: Path, threads: int, p: int, n: int, reps: int) -> dict[str, float]:
    cmd = [sys.executable, str(ROOT / "cli.py"), "bench", "-m", str(path), "--device", "cpu", "-t", str(threads),
           "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        gpu.fail(f"localllm bench exited with {out.returncode} on {path.name}: {out.stderr.strip()[-300:]}")
    rows = json.loads(out.stdout[out.stdout.index("{"):])["rows"]
    speeds = {}
    for r in rows:
        test = r.get("test", "")
        tps = r.get("tps_mean", r.get("avg_ts"))
        if test == f"pp{p}":
            speeds[f"pp{p}"] = tps
        elif re.fullmatch(rf"tg{n}( after pp{p})?", test):
            speeds[f"tg{n}"] = tps
    return speeds


def make_file(cfg, wtype: str, path: Path, tok, args) -> None:
    """The GGUF file of a --types entry: random weights written in that type where the synthetic writer
    has its rule (localllm.synthetic.tensor_type), else (Q5_K_M, Q4_K_S, ...) an F16 file of random
    weights quantized by `localllm quantize`, as a user makes one."""
    try:
        gpu.write_synthetic_gguf(cfg, wtype, path, tok, "cpu", quantized_embedding=True)
        return
    except (KeyError, ValueError):  # no synthetic rule for this preset
        path.unlink(missing_ok=True)
    base = args.workdir / f"{args.shape}-F16.gguf"
    if not base.exists():
        gpu.write_synthetic_gguf(cfg, "F16", base, tok, "cpu", quantized_embedding=True)
    cmd = [sys.executable, str(ROOT / "cli.py"), "quantize", str(base), str(path), wtype]
    if subprocess.run(cmd, check=False, capture_output=True, text=True).returncode != 0:
        gpu.fail(f"localllm quantize to {wtype} failed: {' '.join(cmd)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, metavar="SRC_TGZ", help="llama.cpp source tarball (holding llama.cpp/)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/llama-cpu"))
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--vocab", type=Path, default=ROOT / "tests/data/vocab/ggml-vocab-starcoder.gguf")
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0,F16")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llama-cpu-gguf"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gpu.CMAKE_FLAGS[:] = CPU_FLAGS  # build_llama_bench adds a CUDA architecture flag, unused here
    exe = args.build_dir / "bin" / "llama-bench"
    if not exe.exists():
        if args.build is None:
            gpu.fail(f"{exe} not built: pass --build SRC_TGZ")
        exe = gpu.build_llama_bench(args.build, args.build_dir, os.cpu_count() or 2, "90")
    tok = gpu.read_vocab(args.vocab)
    cfg = replace(gpu.shape_preset(args.shape), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} logical CPUs, -t {args.threads}; {args.shape} random weights, "
          f"pp{args.prompt} / tg{args.gen} after pp{args.prompt}; tokens/s per round (ours / llama.cpp)", flush=True)
    for wtype in args.types.split(","):
        path = args.workdir / f"{args.shape}-{wtype}.gguf"
        if not path.exists():
            make_file(cfg, wtype, path, tok, args)
        ratios: dict[str, list[float]] = {}
        for r in range(args.rounds):
            a = ours(path, args.threads, args.prompt, args.gen, args.reps)
            b = theirs(exe, path, args.threads, args.prompt, args.gen, args.reps)
            line = []
            for test in b:
                ratios.setdefault(test, []).append(a[test] / b[test])
                line.append(f"{test} {a[test]:.1f} / {b[test]:.1f} = {a[test] / b[test]:.2f}")
            print(f"{wtype} round {r}: " + ", ".join(line), flush=True)
        print(f"{wtype}: median ratio " + ", ".join(f"{t} {statistics.median(v):.2f}" for t, v in ratios.items()),
              flush=True)


if __name__ == "__main__":
    main()
