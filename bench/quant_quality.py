"""Quantization quality against llama.cpp, on the default model's unquantized base.

    python bench/quant_quality.py [--work DIR] [--eval bench/data/eval.txt] [--ctx 512]

1. base: `localllm quantize smollm2-135m base-f32.gguf --type F32` (the Q4_1 file's values, decoded).
2. llama.cpp's own Q4_K_M and Q4_0 of that base (llama_model_quantize, in the cached llama-cpp-python
   venv of bench/llamacpp_env.py).
3. ours: the Q4_K_M preset, and `--target-size` equal to each llama.cpp file's size.
4. `localllm perplexity FILE --file EVAL --kld-base base-logits` for each; EVAL is disjoint from the
   calibration text (localllm/data/calibration.txt).
5. llama.cpp loads each of our files and completes a prompt (proves the files are valid GGUF for it).
Prints a markdown table: file, size, bits per weight, PPL, mean KLD, ratio to llama.cpp's at that size.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_env import run_llamacpp  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

QUANTIZE = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3]); p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""

LOAD_AND_COMPLETE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
out = llm("Once upon a time, there was a little", max_tokens=16, temperature=0)
print(out["choices"][0]["text"])
"""


def localllm(*args: str) -> str:
    cmd = [sys.executable, str(ROOT / "cli.py"), *args]
    print("+", " ".join(cmd[1:]), file=sys.stderr)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def evaluate(path: Path, eval_text: Path, base_logits: Path, ctx: int) -> dict:
    out = localllm("perplexity", str(path), "--file", str(eval_text), "--ctx", str(ctx),
                   "--kld-base", str(base_logits), "--device", "cpu", "--dtype", "float32")
    nums = {}
    for key, pattern in (("ppl", r"PPL = ([\d.]+)"), ("kld", r"mean KLD = ([\d.e-]+)"), ("kld99", r"99% KLD = ([\d.e-]+)"),
                         ("same_top", r"same top = ([\d.]+)")):
        m = re.search(pattern, out)
        nums[key] = float(m.group(1)) if m else float("nan")
    return nums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/localllm-quant-quality")
    ap.add_argument("--eval", default=str(ROOT / "bench" / "data" / "eval.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base-f32.gguf"
    if not base.exists():
        localllm("quantize", "smollm2-135m", str(base), "--type", "F32")
    base_logits = work / "base.logits"
    if not base_logits.exists():
        localllm("perplexity", str(base), "--file", args.eval, "--ctx", str(args.ctx), "--save-logits",
                 str(base_logits), "--device", "cpu", "--dtype", "float32")
    files = {}
    for ftype in ("Q4_K_M", "Q4_0"):
        ref = work / f"llamacpp-{ftype}.gguf"
        if not ref.exists():
            run_llamacpp(QUANTIZE, str(base), str(ref), ftype)
        files[f"llama.cpp {ftype}"] = (ref, ftype)
        mixed = work / f"ours-size-of-{ftype}.gguf"
        if not mixed.exists():
            localllm("quantize", str(base), str(mixed), "--target-size", str(ref.stat().st_size))
        files[f"ours --target-size {ftype}"] = (mixed, ftype)
    preset = work / "ours-Q4_K_M.gguf"
    if not preset.exists():
        localllm("quantize", str(base), str(preset), "--type", "Q4_K_M")
    files["ours preset Q4_K_M"] = (preset, "Q4_K_M")
    n_params = sum(int(t.n_elements) for t in gguf.GGUFReader(base).tensors)
    rows = {}
    for label, (path, ref_type) in files.items():
        rows[label] = {"size": path.stat().st_size, "bpw": path.stat().st_size * 8 / n_params,
                       **evaluate(path, Path(args.eval), base_logits, args.ctx), "ref": ref_type}
        if not label.startswith("llama.cpp"):
            rows[label]["llama.cpp says"] = run_llamacpp(LOAD_AND_COMPLETE, str(path)).strip()
    print("| file | bytes | bpw | PPL | mean KLD | 99% KLD | same top | KLD / llama.cpp's |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        ratio = r["kld"] / rows[f"llama.cpp {r['ref']}"]["kld"]
        print(f"| {label} | {r['size']:,} | {r['bpw']:.3f} | {r['ppl']:.4f} | {r['kld']:.5f} | {r['kld99']:.4f} "
              f"| {r['same_top']:.2f}% | {ratio:.3f} |")
    print(json.dumps({k: v.get("llama.cpp says") for k, v in rows.items() if "llama.cpp says" in v}, indent=1))


if __name__ == "__main__":
    main()
