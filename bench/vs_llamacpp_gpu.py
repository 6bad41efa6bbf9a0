"""localllm against llama.cpp on one CUDA GPU: llama.cpp's own llama-bench (a CUDA build from source) and
`localllm bench --synthetic PRESET --type TYPE`, on random-weight models of the same shape and the same weights.

    python bench/vs_llamacpp_gpu.py --build .out/llama_src.tgz --build-dir .out/llama-build --build-only
    python bench/vs_llamacpp_gpu.py --presets llama-3.1-8b,llama-3.2-1b --types F16,Q8_0,Q4_0,Q4_K_M \
        --vocab .out/ggml-vocab-llama-bpe.gguf --build-dir .out/llama-build --workdir .out/gguf [-r 3]

--build SRC_TGZ unpacks llama.cpp's source (a tarball holding llama.cpp/) beside DIR and builds only
llama-bench into DIR (CUDA, sm_90 by default; several minutes), unless DIR/bin/llama-bench exists.

Weights: localllm.synthetic.write_synthetic_gguf writes synthetic_state's weights, the very ones
`localllm bench --synthetic` runs (same seed, same blocks, llama.cpp's Q4_K_M mix), as a GGUF with the
vocabulary's tokenizer keys; quantized tensors are the same bytes on both sides. Dense 2-D tensors (the
token embedding, which is the head of a tied model; every linear of an F16 file) are F16 in the file
and bf16 in localllm: an F16 file is compared with localllm bf16. Each file is deleted after its run.

Tests, as llama-bench defines them: pp512 = a 512-token prompt into an empty context (-p 512 -n 0);
tg128 = 128 single-token steps after 512 tokens of context (-p 0 -n 128 -d 512; localllm's
"tg128 after pp512"). llama-bench runs with every layer on the GPU and flash attention (-ngl 99 -fa 1),
after its warm-up; localllm through localllm.commands.bench.bench_model (two warm-ups). Both print mean ± sd over
-r repetitions; ratio = localllm / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from localllm.backends.measure import free_memory, measure_roofline
from localllm.commands.bench import BenchModel, bench_model
from localllm.device import pick_device, pick_dtype
from localllm.errors import LocalLLMError
from localllm.commands.quantize_cmd import read_gguf_metadata
from localllm.registry import shape_preset
from localllm.synthetic import synthetic_model, write_synthetic_gguf

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "MXFP4_MOE")
# localllm runs dense weights in bf16 on CUDA: both dense file types compare with it
LOCALLLM_TYPE = {"F16": "bf16", "BF16": "bf16"}
# LLAMA_CURL is deprecated (ignored) in this llama.cpp; LLAMA_OPENSSL and LLAMA_BUILD_APP are on by default.
CMAKE_FLAGS = ["-G", "Ninja", "-DGGML_CUDA=ON", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]


def fail(message: str) -> None:
    raise SystemExit(f"error: {message}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_llama_bench(src_tgz: Path, build_dir: Path, jobs: int, cuda_arch: str) -> Path:
    """DIR/bin/llama-bench, configured and built from the tarball unless it is there already."""
    exe = build_dir / "bin" / "llama-bench"
    if exe.exists():
        log(f"using the llama-bench already built: {exe}")
        return exe
    if not src_tgz.is_file():
        fail(f"llama.cpp source tarball not found: {src_tgz}")
    src = build_dir.with_name(build_dir.name + "-src")
    if not (src / "llama.cpp" / "CMakeLists.txt").exists():
        src.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xzf", str(src_tgz), "-C", str(src)], check=True)
    flags = CMAKE_FLAGS + [f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    steps = [["cmake", "-S", str(src / "llama.cpp"), "-B", str(build_dir), *flags],
             ["cmake", "--build", str(build_dir), "--target", "llama-bench", "-j", str(jobs)]]
    t0 = time.perf_counter()
    for cmd in steps:
        log("$ " + " ".join(cmd))
        if subprocess.run(cmd, check=False).returncode != 0:
            fail(f"llama.cpp build failed at: {' '.join(cmd[:3])} (its output is above)")
    log(f"built {exe} in {time.perf_counter() - t0:.0f} s")
    return exe


def run_llama_bench(exe: Path, path: Path, args: list[str]) -> dict:
    """One llama-bench test on the whole GPU -> its JSON record (avg_ts, stddev_ts, gpu_info, ...)."""
    cmd = [str(exe), "-m", str(path), "-ngl", "99", "-fa", "1", *args, "-o", "json"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        fail(f"llama-bench exited with {out.returncode} on {path.name} ({' '.join(args)}): {last}")
    records = json.loads(out.stdout[out.stdout.index("["):])
    if len(records) != 1:
        fail(f"llama-bench gave {len(records)} results for {' '.join(args)}, expected 1")
    return records[0]


def llamacpp_speeds(exe: Path, path: Path, p: int, n: int, reps: int) -> tuple[dict, str]:
    """{test: (mean, sd) tokens/s} for pp{p} and tg{n} after p tokens; and llama-bench's GPU name."""
    r = str(reps)
    pp = run_llama_bench(exe, path, ["-p", str(p), "-n", "0", "-r", r])
    tg = run_llama_bench(exe, path, ["-p", "0", "-n", str(n), "-d", str(p), "-r", r])
    assert (pp["n_prompt"], pp["n_gen"], tg["n_gen"], tg["n_depth"]) == (p, 0, n, p), (pp, tg)
    speeds = {f"pp{p}": (pp["avg_ts"], pp["stddev_ts"]), f"tg{n}": (tg["avg_ts"], tg["stddev_ts"])}
    return speeds, pp.get("gpu_info") or pp.get("cpu_info", "")


def localllm_speeds(cfg, wtype: str, device: str, p: int, n: int, reps: int, roof: dict) -> dict:
    """The same tests through localllm.commands.bench, on the synthetic model `localllm bench --synthetic` builds."""
    rt, types = synthetic_model(cfg, wtype, device, pick_dtype(device))
    rows = bench_model(BenchModel(wtype, rt, types), [p], [n], [0], reps, roof)
    del rt
    free_memory(device)
    by_test = {r.test: (r.tps_mean, r.tps_std) for r in rows}
    return {f"pp{p}": by_test[f"pp{p}"], f"tg{n}": by_test[f"tg{n} after pp{p}"]}


def read_vocab(path: Path) -> dict:
    if not path.is_file():
        fail(f"vocabulary file not found: {path} (a GGUF with tokenizer.* keys, e.g. ggml-vocab-llama-bpe.gguf)")
    kv = read_gguf_metadata(path, keep=lambda key: key.startswith("tokenizer."))
    if "tokenizer.ggml.tokens" not in kv:
        fail(f"{path} has no tokenizer (tokenizer.ggml.tokens)")
    return kv


def preset_config(name: str, n_tokens: int):
    """The preset's shape; a vocabulary of another size takes the vocabulary's (e.g. smollm2-135m)."""
    try:
        cfg = shape_preset(name)
    except LocalLLMError as e:
        fail(str(e))
    if cfg.vocab_size != n_tokens:
        log(f"{name}: vocabulary of {n_tokens} tokens instead of the preset's {cfg.vocab_size}, on both sides")
        cfg = replace(cfg, vocab_size=n_tokens)
    return cfg


def fmt(speed: tuple[float, float] | None) -> str:
    return "-" if speed is None else f"{speed[0]:.1f} ± {speed[1]:.1f}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-3.1-8b,llama-3.2-1b", help="models.toml shape presets, comma-separated")
    ap.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M", help=f"GGUF file types: {', '.join(TYPES)}")
    ap.add_argument("--vocab", type=Path, default=Path(".out/ggml-vocab-llama-bpe.gguf"),
                    help="a vocab-only GGUF whose tokenizer.* keys the files get")
    ap.add_argument("--llama-bench", type=Path, help="a llama-bench binary (default: BUILD_DIR/bin/llama-bench)")
    ap.add_argument("--build", type=Path, metavar="SRC_TGZ", help="build llama-bench from this llama.cpp tarball")
    ap.add_argument("--build-dir", type=Path, default=Path(".out/llama-build"))
    ap.add_argument("--build-only", action="store_true", help="only build llama-bench (needs --build)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count(), help="build jobs")
    ap.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (90: H100, H200)")
    ap.add_argument("--workdir", type=Path, default=Path(".out/gguf"), help="where the GGUF files are written")
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--device", default="auto", help="localllm's device (and where the weights are made)")
    ap.add_argument("--no-localllm", action="store_true", help="run llama.cpp only")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.build_only and args.build is None:
        fail("--build-only needs --build SRC_TGZ")
    if args.build is not None:
        exe = build_llama_bench(args.build, args.build_dir, args.jobs, args.cuda_arch)
        if args.build_only:
            return
    exe = args.llama_bench or args.build_dir / "bin" / "llama-bench"
    if not exe.is_file():
        fail(f"llama-bench not found at {exe}: pass --build SRC_TGZ (and --build-dir DIR) or --llama-bench PATH")
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad:
        fail(f"unknown type {bad[0]!r} (types: {', '.join(TYPES)})")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    tokenizer = read_vocab(args.vocab)
    configs = {name: preset_config(name, len(tokenizer["tokenizer.ggml.tokens"].value)) for name in presets}
    try:
        device = pick_device(args.device)
    except LocalLLMError as e:
        fail(str(e))
    args.workdir.mkdir(parents=True, exist_ok=True)
    roof = None if args.no_localllm else measure_roofline(torch.device(device))
    dev_name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"localllm on {dev_name}; tokens/s, mean ± sd over {args.reps} runs; tg{args.gen} after {args.prompt} "
          "tokens of context")
    print("| model | type | test | llama.cpp | localllm | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: |", flush=True)
    gpu = "?"
    for name, cfg in configs.items():
        for wtype in types:
            path = args.workdir / f"{name}-{wtype}.gguf"
            t0 = time.perf_counter()
            write_synthetic_gguf(cfg, wtype, path, tokenizer, device)
            free_memory(device)
            log(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
            try:
                theirs, gpu = llamacpp_speeds(exe, path, args.prompt, args.gen, args.reps)
            finally:
                path.unlink(missing_ok=True)
            ours_type = LOCALLLM_TYPE.get(wtype, wtype)
            ours = {} if args.no_localllm else localllm_speeds(cfg, ours_type, device, args.prompt, args.gen,
                                                               args.reps, roof)
            label = wtype if ours_type == wtype or args.no_localllm else f"{wtype} (localllm {ours_type})"
            for test, speed in theirs.items():
                mine = ours.get(test)
                ratio = "-" if mine is None else f"{mine[0] / speed[0]:.2f}"
                print(f"| {name} | {label} | {test} | {fmt(speed)} | {fmt(mine)} | {ratio} |", flush=True)
    ours_on = "" if args.no_localllm else f"; localllm: bench_model on {dev_name}"
    print(f"\nllama.cpp: llama-bench on {gpu}, -ngl 99 -fa 1{ours_on}")


if __name__ == "__main__":
    main()
