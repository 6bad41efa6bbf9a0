"""localllm's tensor parallelism against llama.cpp's own two-GPU modes (issue 23: ratio >= 1.5x), on the
same machine and the same GGUF files.

    python bench/tp_vs_llamacpp.py --llama-bench PATH [--types Q4_K_M[,BF16]] [--workdir .out/tpvs]
        [-n 128] [-r 3] [--limit 300] [--modes none,layer,row,tensor]

1. Writes each file of the llama-3.1-8b shape once (localllm.synthetic.write_synthetic_gguf with random
   valid blocks: seconds; the vocabulary of tests/data/vocab/ggml-vocab-llama-bpe.gguf, 128256 tokens,
   the preset's own), kept in --workdir for later runs.
2. llama.cpp: `llama-bench -m FILE -ngl 99 -fa 1 -sm MODE -p 0 -n 128 -r 3 -o json` for each MODE of
   --modes: none (GPU 0 alone), layer, row and tensor (both GPUs), one call a mode (a mode that fails is
   reported, the others still run); LD_LIBRARY_PATH gets the binary's folder (a shared-library build) and
   its ../lib. In the llama.cpp this project builds (llama-cpp-python 0.3.36's), `-sm row` cannot load
   any file on CUDA: upstream PR #24216 removed the CUDA split buffer type, so src/llama-model.cpp's
   make_gpu_buft_list throws "device CUDA0 does not support split buffers"; `-sm tensor` (the meta
   backend, flash attention required: -fa 1 is passed) is llama.cpp's tensor parallelism there. row stays
   in the default list so the table records that (it fails at once, before reading a weight).
   A failed call is run again with -v -r 1 (llama-bench without -v silences llama.cpp's log, so its
   stderr holds only "failed to load model"), and that run's error lines and stderr tail are printed.
3. localllm: this script again under torch's launcher (2 processes, NVLink multicast off), each file
   loaded by load_model (the GGUF path `--tp` runs: each rank reads only its shard): TP=1 (each rank the
   whole file on its own GPU, at the same time; rank 0's figure) and TP=2; greedy decode tokens/s of
   128 steps after a 16-token prompt (bench/tp_speed.decode_rate; llama-bench's tg128 starts from an
   empty context: 16 more positions of attention on our side).
Prints one table: tokens/s of each, and localllm TP=2 / each two-GPU mode of llama.cpp, TP=1 / none.
Every phase prints its seconds; a watchdog (bench/tp_watchdog.py) ends a stalled worker, naming its phase.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from localllm.parallel import launched, no_multicast_env  # noqa: E402

VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"
PRESET = "llama-3.1-8b"
MODES = ("none", "layer", "row", "tensor")
TAIL_LINES = 40  # of a failed call's verbose stderr


def log(text: str) -> None:
    print(text, flush=True)


def write_files(types: list[str], workdir: Path) -> dict[str, Path]:
    from localllm.commands.quantize_cmd import read_gguf_metadata
    from localllm.registry import shape_preset
    from localllm.synthetic import write_synthetic_gguf

    files = {}
    tok = None
    for wtype in types:
        path = workdir / f"{PRESET}-{wtype}-random.gguf"
        if not path.is_file():
            t0 = time.perf_counter()
            tok = tok or read_gguf_metadata(VOCAB, keep=lambda key: key.startswith("tokenizer."))
            cfg = replace(shape_preset(PRESET), vocab_size=len(tok["tokenizer.ggml.tokens"].value))
            write_synthetic_gguf(cfg, wtype, path, tok, device="cuda", seed=0, random_blocks=True)
            torch.cuda.empty_cache()
            log(f"wrote {path} ({path.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t0:.1f} s")
        else:
            log(f"using {path}")
        files[wtype] = path
    return files


def bench_env(exe: Path) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(exe.parent), str(exe.parent.parent / "lib"),
                                              env.get("LD_LIBRARY_PATH", "")])
    return env


def run_bench(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit status or None on a timeout, stdout, stderr) of one llama-bench call."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return None, text(e.stdout), text(e.stderr)
    return out.returncode, out.stdout, out.stderr


def cause_lines(stderr: str) -> list[str]:
    """The lines of llama-bench's stderr that name a cause (llama_model_load's "error loading model: ...",
    a GGML_ASSERT, ...): the last line is rarely the cause."""
    keys = ("error", "fail", "assert", "abort", "not supported", "unsupported")
    return [ln for ln in stderr.splitlines() if any(k in ln.lower() for k in keys)]


def print_cause(title: str, stderr: str) -> str:
    """Prints stderr's cause lines and its last TAIL_LINES lines under title; -> a one-line summary."""
    said = list(dict.fromkeys(cause_lines(stderr)))
    tail = stderr.strip().splitlines()[-TAIL_LINES:]
    log(f"  {title}: its error lines, then its last {len(tail)} stderr lines:")
    for ln in said[-8:] + ["  ----"] + tail:
        log(f"    {ln}")
    return " | ".join(said[-3:]) or (tail[-1] if tail else "(no output)")


def explain_failure(cmd: list[str], env: dict, timeout: float) -> str:
    """Runs a failed call again with -v -r 1 and prints its cause; -> a one-line summary. Without -v
    llama-bench sets a null log callback (tools/llama-bench/llama-bench.cpp, `llama_log_set(
    llama_null_log_callback, NULL)`), so llama.cpp's own error never reaches stderr."""
    env = {**env, "GGML_NO_BACKTRACE": "1"}  # a GGML_ASSERT's message stays in the tail
    rc, _, err = run_bench(cmd + ["-v", "-r", "1"], env, timeout)
    return print_cause(f"`{' '.join(cmd[1:])} -v -r 1` (exit {rc})", err)


def llama_bench(exe: Path, path: Path, mode: str, n: int, reps: int, timeout: float) -> dict:
    """{'tps': mean, 'sd': sd} of tg{n}, or {'error': summary} (the details printed)."""
    env = bench_env(exe)
    cmd = [str(exe), "-m", str(path), "-ngl", "99", "-fa", "1", "-sm", mode, "-p", "0", "-n", str(n), "-r", str(reps),
           "-o", "json"]
    t0 = time.perf_counter()
    rc, out, err = run_bench(cmd, env, timeout)
    log(f"llama-bench -sm {mode} {path.name}: {time.perf_counter() - t0:.1f} s")
    if rc is None:
        return {"error": f"timed out after {timeout:.0f} s: " + print_cause(f"-sm {mode} (timed out)", err)}
    if rc != 0:
        return {"error": explain_failure(cmd, env, timeout)}
    try:
        rec = json.loads(out[out.index("["):])[0]
    except (ValueError, IndexError) as e:
        return {"error": f"unreadable output ({e})"}
    return {"tps": rec["avg_ts"], "sd": rec["stddev_ts"], "gpu": rec.get("gpu_info", "")}


def worker(files: list[str], n: int, out: Path, row_limit: float, limit: float) -> None:
    """One rank: every file at TP=1 (each rank alone on its GPU) and TP=2 -> rank 0 writes out."""
    from localllm.backends.launch import from_launcher
    from localllm.load import load_model
    from tp_speed import decode_rate, free, gathered
    from tp_watchdog import Watchdog

    wd = Watchdog(int(os.environ["RANK"]), row_limit, limit)
    wd.enter_row("set-up")
    with wd.phase("process group"):
        tp = from_launcher("cuda")
    res = {}
    try:
        for f in files:
            name = Path(f).name
            wd.enter_row(f"{name} TP=1")
            with wd.phase("load"):
                rt = load_model(f, "cuda", torch.bfloat16).runtime
            one = gathered(decode_rate(rt, n, wd))
            free(rt)
            del rt
            free(None)
            wd.say(f"TP=1 {one[0]:.1f} tokens/s (GPU 1 alone at the same time: {one[1]:.1f})")
            wd.enter_row(f"{name} TP=2")
            with wd.phase("load (each rank its shard)"):
                rt = load_model(f, "cuda", torch.bfloat16, tp=tp).runtime
            two = decode_rate(rt, n, wd)
            res[name] = {"tp1": one[0], "tp1_gpu1": one[1], "tp2": two, "all_reduce": rt.all_reduce}
            wd.say(f"TP=2 {two:.1f} tokens/s ({rt.all_reduce})")
            free(rt)
            del rt
            free(None)
        wd.enter_row("done")
        if tp.rank == 0:
            out.write_text(json.dumps(res))
    finally:
        torch.distributed.destroy_process_group()


def print_table(theirs: dict, mine: dict, files: dict[str, Path], modes: list[str]) -> None:
    """One row a file type: llama.cpp's tokens/s a mode, ours at TP=1 and TP=2, then TP=2 / each two-GPU
    mode and TP=1 / none; a failed mode's summary under its row."""
    pairs = [("tp2", m, f"TP=2/{m}") for m in modes if m != "none"]
    pairs += [("tp1", "none", "TP=1/none")] if "none" in modes else []
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    heads = [f"llama.cpp {m}" for m in modes] + ["ours TP=1", "ours TP=2"] + [h for _, _, h in pairs]
    print(f"{'type':8} " + " ".join(f"{h:>{max(len(h), 9)}}" for h in heads))
    for w, p in files.items():
        t, m = theirs[w], mine.get(p.name, {})
        cells = [f"{t[k]['tps']:.1f}" if "tps" in t[k] else "failed" for k in modes]
        cells += [f"{m.get('tp1', 0):.1f}", f"{m.get('tp2', 0):.1f}"]
        cells += [ratio(m.get(ours), t[k].get("tps")) for ours, k, _ in pairs]
        print(f"{w:8} " + " ".join(f"{c:>{max(len(h), 9)}}" for c, h in zip(cells, heads)))
        for k, v in t.items():
            if "error" in v:
                print(f"  llama-bench -sm {k} on {w}: {v['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench (a CUDA build)")
    ap.add_argument("--types", default="Q4_K_M", help="file types, comma-separated (Q4_K_M, BF16, Q8_0, ...)")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".out" / "tpvs")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg N)")
    ap.add_argument("-r", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds the localllm workers may take")
    ap.add_argument("--modes", default=",".join(MODES), help="llama-bench -sm modes, comma-separated")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # (files, under the launcher)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if launched():
        worker(args.worker, args.n, args.out, row_limit=args.limit / 2, limit=args.limit)
        return
    if args.llama_bench is None or not args.llama_bench.is_file():
        raise SystemExit(f"error: llama-bench not found: {args.llama_bench} (pass --llama-bench PATH)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"error: --modes {args.modes}: each one of {', '.join(MODES)}")
    t0 = time.perf_counter()
    files = write_files(types, args.workdir)
    ours = args.workdir / "localllm.json"
    ours.unlink(missing_ok=True)
    env = no_multicast_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "-n", str(args.n), "--limit", str(args.limit), "--out", str(ours),
           "--worker", *map(str, files.values())]
    rc = subprocess.run(cmd, env=env).returncode
    mine = json.loads(ours.read_text()) if rc == 0 and ours.is_file() else {}
    if rc != 0:
        log(f"the localllm workers exited with {rc} (their output above)")
    theirs = {w: {m: llama_bench(args.llama_bench, p, m, args.n, args.r, 120.0) for m in modes}
              for w, p in files.items()}
    print(f"\ntg{args.n} tokens/s, {PRESET} shape, random weights, same files "
          f"({time.perf_counter() - t0:.0f} s in all)")
    print_table(theirs, mine, files, modes)
    print("goal (issue 23): ours TP=2 >= 1.5x llama.cpp's two-GPU modes (-sm layer, and row / tensor where "
          "they run)")
    sys.exit(rc)


if __name__ == "__main__":
    main()
