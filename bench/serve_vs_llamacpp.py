"""`localllm serve` against llama.cpp's llama-server on the same GGUF file and machine, through
bench/serve_load.py (N concurrent streaming clients), the two servers interleaved round by round.

    # CPU, the default model (llama-server built from the llama-cpp-python sdist's llama.cpp):
    python bench/serve_vs_llamacpp.py --model FILE.gguf --build-src DIR/llama.cpp --build-dir DIR/build \\
        --parallel 16 --ctx 512 --clients 1,4,16 --rounds 3
    # H100, a synthetic 8B Q4_K_M file both load (llama.cpp's source as the tarball .out/llama_src.tgz;
    # first the build and the file, each call within the device's 10 minutes, then the measurement):
    python bench/serve_vs_llamacpp.py --synthetic llama-3.1-8b --type Q4_K_M --vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf \\
        --workdir .out/gguf --build-src .out/llama_src.tgz --build-dir .out/server-build --cuda --device cuda --build-only
    python bench/serve_vs_llamacpp.py (the same) --parallel 64 --ctx 512 --clients 1,4,16,64 --rounds 2

llama-server runs with -np N and a context of N x --ctx (its slots split -c), continuous batching (its
default), every layer on the GPU with --cuda (-ngl 99); localllm serve with --parallel N --ctx C. Both
get the same prompts (token ids), greedy, ignore_eos: exactly --gen-tokens each. The llama-cpp-python
sdist lacks llama.cpp's web UI folder (tools/ui), which llama-server links: --build-src gets an empty
stub of it (the API is unchanged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_load  # noqa: E402

UI_STUB = {
    "ui.h": """// Stub of llama.cpp's embedded web UI (absent from the llama-cpp-python sdist): no assets.
#pragma once
#include <cstddef>
#include <string>
#include <vector>
struct llama_ui_asset { std::string name; const unsigned char * data; size_t size; std::string type; std::string etag; };
const std::vector<llama_ui_asset> & llama_ui_get_assets();
const llama_ui_asset * llama_ui_find_asset(const std::string & name);
bool llama_ui_use_gzip();
""",
    "ui.cpp": """#include "ui.h"
const std::vector<llama_ui_asset> & llama_ui_get_assets() { static std::vector<llama_ui_asset> v; return v; }
const llama_ui_asset * llama_ui_find_asset(const std::string &) { return nullptr; }
bool llama_ui_use_gzip() { return false; }
""",
    "CMakeLists.txt": """add_library(llama-ui STATIC ui.cpp)
target_include_directories(llama-ui PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
add_custom_target(llama-ui-assets)
set_target_properties(llama-ui PROPERTIES POSITION_INDEPENDENT_CODE ON)
""",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


CPU_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]  # AVX2 only: every x86-64 here
CUDA_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]


def source_folder(src: Path, build: Path) -> Path:
    """llama.cpp's source folder: src itself, or a tarball holding llama.cpp/ (the GPU machine's
    .out/llama_src.tgz, as bench/vs_llamacpp_gpu.py --build) unpacked beside the build folder."""
    if src.is_dir():
        return src
    if not src.is_file():
        raise SystemExit(f"llama.cpp source not found: {src}")
    into = build.with_name(build.name + "-src")
    if not (into / "llama.cpp" / "CMakeLists.txt").exists():
        into.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xzf", str(src), "-C", str(into)], check=True)
    return into / "llama.cpp"


def build_llama_server(src: Path, build: Path, cuda: bool, jobs: int) -> Path:
    exe = build / "bin" / "llama-server"
    if exe.exists():
        return exe
    src = source_folder(src, build)
    ui = src / "tools" / "ui"
    if not ui.exists():
        ui.mkdir(parents=True)
        for name, text in UI_STUB.items():
            (ui / name).write_text(text)
    flags = ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DCMAKE_BUILD_TYPE=Release",
             *(CUDA_FLAGS if cuda else CPU_FLAGS), *(["-G", "Ninja"] if shutil.which("ninja") else [])]
    t0 = time.perf_counter()
    for cmd in (["cmake", "-S", str(src), "-B", str(build), *flags],
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]):
        log("$ " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"the llama-server build failed at: {' '.join(cmd[:3])} (its output is above)")
    log(f"built {exe} in {time.perf_counter() - t0:.0f} s")
    return exe


def synthetic_file(preset: str, wtype: str, vocab: Path, workdir: Path, device: str) -> Path:
    from vs_llamacpp_gpu import preset_config, read_vocab

    from localllm.synthetic import write_synthetic_gguf

    path = workdir / f"{preset}-{wtype}.gguf"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        tokenizer = read_vocab(vocab)
        cfg = preset_config(preset, len(tokenizer["tokenizer.ggml.tokens"].value))
        write_synthetic_gguf(cfg, wtype, path, tokenizer, device)
    return path


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def wait_healthy(url: str, proc: subprocess.Popen, logfile: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready; {logfile}:\n{tail(logfile)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready; {logfile}:\n{tail(logfile)}")


def server_command(which: str, args, model: Path, port: int, exe: Path | None) -> list[str]:
    if which == "localllm":
        return [sys.executable, "-m", "localllm.cli", "serve", str(model), "--port", str(port), "-np",
                str(args.parallel), "--ctx", str(args.ctx), "--device", args.device,
                *(["-t", str(args.threads)] if args.threads else []),
                *(["--log-level", "debug"] if args.debug_log else [])]
    return [str(exe), "-m", str(model), "--port", str(port), "-np", str(args.parallel), "-c",
            str(args.parallel * args.ctx), "-ngl", "99" if args.cuda else "0",
            *(["-t", str(args.threads)] if args.threads else [])]


def run_one(which: str, args, model: Path, exe: Path | None) -> list[dict]:
    port = args.port + (0 if which == "localllm" else 1)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args.logs.mkdir(parents=True, exist_ok=True)
    logfile = args.logs / f"{which}.log"
    with open(logfile, "w") as out:
        proc = subprocess.Popen(server_command(which, args, model, port, exe), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, logfile)
        load = serve_load.parse_args(["--url", url, "--clients", args.clients, "--requests", str(args.requests),
                                      "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
                                      "--procs", str(args.procs)])
        _, rows = asyncio.run(serve_load.measure(load, report=lambda line: log(f"{which:>8}: {line}")))
        return rows
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a GGUF file both servers load")
    ap.add_argument("--synthetic", help="instead: a models.toml shape preset written as a GGUF (random weights)")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--vocab", type=Path, default=Path(".out/ggml-vocab-llama-bpe.gguf"))
    ap.add_argument("--workdir", type=Path, default=Path(".out/gguf"))
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (else built from --build-src)")
    ap.add_argument("--build-src", type=Path, help="llama.cpp's source: its folder (CMakeLists.txt at its top), or a "
                    "tarball holding llama.cpp/ (unpacked beside --build-dir)")
    ap.add_argument("--build-dir", type=Path, default=Path(".out/server-build"))
    ap.add_argument("--cuda", action="store_true", help="build and run llama-server on CUDA (-ngl 99)")
    ap.add_argument("--build-only", action="store_true", help="build llama-server (and write the synthetic file), then stop")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="auto", help="localllm serve's --device")
    ap.add_argument("-t", "--threads", type=int, help="CPU threads of both servers")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--procs", type=int, default=1, help="client processes of bench/serve_load.py (its --procs)")
    ap.add_argument("--rounds", type=int, default=1, help="localllm, llama-server, localllm, ... this many times each")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--logs", type=Path, default=Path(".out/serve-logs"), help="each server's output (the last run's)")
    ap.add_argument("--debug-log", action="store_true",
                    help="localllm serve --log-level debug: its log (--logs) gets a line per prefill pass")
    args = ap.parse_args()
    if (args.model is None) == (args.synthetic is None):
        raise SystemExit("give --model FILE or --synthetic PRESET")
    exe = args.llama_server or (build_llama_server(args.build_src, args.build_dir, args.cuda, args.jobs)
                                if args.build_src else None)
    if exe is None:
        raise SystemExit("give --llama-server BINARY or --build-src DIR")
    model = args.model or synthetic_file(args.synthetic, args.type, args.vocab, args.workdir, args.device)
    if args.build_only:
        log(f"ready: {exe} and {model}")
        return
    results = {"localllm": [], "llama-server": []}
    for _ in range(args.rounds):
        for which in results:
            results[which].append(run_one(which, args, model, exe))
    print("| clients | localllm tok/s | llama-server tok/s | ratio (median of rounds) | TTFT p50 ms ours / theirs "
          "| ITL p50 ms ours / theirs |\n| --- | --- | --- | --- | --- | --- |")
    for i, n in enumerate(int(x) for x in args.clients.split(",")):
        ours = [r[i] for r in results["localllm"]]
        theirs = [r[i] for r in results["llama-server"]]
        ratio = median([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)])
        med = lambda rows, key: median([r[key] for r in rows])  # noqa: E731
        print(f"| {n} | {med(ours, 'tokens_per_s'):.1f} | {med(theirs, 'tokens_per_s'):.1f} | {ratio:.2f} | "
              f"{med(ours, 'ttft_p50_ms'):.0f} / {med(theirs, 'ttft_p50_ms'):.0f} | "
              f"{med(ours, 'itl_p50_ms'):.1f} / {med(theirs, 'itl_p50_ms'):.1f} |")
    print(json.dumps({"model": str(model), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
