"""Tokenizer throughput (chars/s of encode on one long text) per vocab kind, ours against llama.cpp's
tokenizer (llama-cpp-python, vocab_only), interleaved, with the ids compared.

    python bench/tokenizer_speed.py                     # llama.cpp's vocab test files, 3 rounds
    python bench/tokenizer_speed.py --rounds 5 --vocab llama-spm --vocab phi-3
    LLAMACPP_VENV=/path python bench/tokenizer_speed.py # the llama.cpp venv to use (bench/llamacpp_env.py)

The text: the repository's prose (bench/data/eval.txt, README.md, docs/*.md) then its Python source,
each about half of --kb KiB. For SentencePiece vocabs "cold" is a fresh word cache (the first encode
of a text), "warm" the same text again, "1 thread" the first encode with sentencepiece on one thread,
"cpu" the first encode's process CPU time (all threads: what a shared machine's load does not
stretch); "python" is the pure-Python merge (on a tenth of the text).
Ratios (vs_llamacpp, vs_python) are medians of per-round ratios, the runs of a round side by side.
"build" is the tokenizer's construction from parsed metadata (start-up cost), "fast build" the
sentencepiece engine's part of it. --synthetic builds a 256k-token SPM vocab (Gemma's size) to time
the first use alone. --parts splits an SPM vocab's first encode into its steps (process CPU time,
best of 7: what the machine's load stretches least).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from localllm.gguf_file import open_gguf  # noqa: E402
from localllm.tokenizer import load_gguf_tokenizer  # noqa: E402
from localllm.tokenizer.base import encodable, split_special  # noqa: E402
from localllm.tokenizer.spm import SPACE, spm_tokenize  # noqa: E402
from localllm.tokenizer.spm_fast import fast_spm  # noqa: E402

VOCAB_DIR = ROOT / "tests" / "data" / "vocab"
VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gemma-4"]

# runs in the llama.cpp venv: tokenize the text file `rounds` times, print the best time and the ids
LLAMACPP_CODE = r"""
import json, sys, time, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
data = open(sys.argv[2], "rb").read()
times = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter(); ids = llm.tokenize(data, add_bos=False, special=False)
    times.append(time.perf_counter() - t0)
print(json.dumps({"time": min(times), "ids": ids}))
"""


def bench_text(kib: int) -> str:
    prose = [ROOT / "bench" / "data" / "eval.txt", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    code = sorted((ROOT / "localllm").rglob("*.py"))
    half = kib * 512

    def take(paths: list[Path]) -> str:
        out = ""
        for p in paths:
            out += p.read_text(encoding="utf-8")
            if len(out) >= half:
                break
        return out[:half]

    return take(prose) + take(code)


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def llamacpp(path: Path, text_file: Path, repeat: int) -> dict | None:
    from llamacpp_env import has_llama_cpp, venv_python

    if not has_llama_cpp(venv_python()):
        return None
    out = subprocess.run([venv_python(), "-c", LLAMACPP_CODE, str(path), str(text_file), str(repeat)],
                         capture_output=True, text=True)
    if out.returncode != 0:  # e.g. a tokenizer model that build of llama.cpp does not know
        print(f"{path.name}: llama.cpp failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_vocab(name: str, text: str, text_file: Path, rounds: int) -> dict:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    meta = open_gguf(path).metadata
    build = timed(lambda: load_gguf_tokenizer(meta))
    tok = load_gguf_tokenizer(meta)
    row: dict = {"vocab": name, "kind": tok.kind, "chars": len(text), "build_s": build}
    spm_fast = getattr(tok, "_fast", None)
    if tok.kind == "spm":
        row["fast"] = spm_fast is not None or tok.fast_reason
        row["fast_build_s"] = timed(lambda: fast_spm(tok._tokens, tok._scores, tok._unk_id, tok._to_id))
    ours, theirs, warm, python, cpu, one = [], [], [], [], [], []
    part = text[: len(text) // 10]
    esc = (" " + part).replace(" ", SPACE)
    same = None

    def first_encode(threads: int | None) -> tuple[list[int], float, float]:
        """(ids, wall s, process CPU s) of an encode from a fresh word cache; threads: sentencepiece's
        (None: the tokenizer's own)."""
        if spm_fast is not None:
            spm_fast.clear_cache()
            keep, spm_fast.threads = spm_fast.threads, threads or spm_fast.threads
        t0, c0 = time.perf_counter(), time.process_time()
        ids = tok.encode(text)
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        if spm_fast is not None:
            spm_fast.threads = keep
        return ids, wall, cpu_s

    for r in range(rounds):  # interleaved: ours (cold, 1 thread, warm), llama.cpp's, the Python merge, ...
        if spm_fast is not None and r % 2:  # the one-thread run first in odd rounds
            one.append(first_encode(1)[1] / len(text))
        ids, wall, cpu_s = first_encode(None)
        ours.append(wall / len(text))
        cpu.append(cpu_s / len(text))
        if spm_fast is not None:
            warm.append(timed(lambda: tok.encode(text)) / len(text))
            if not r % 2:
                one.append(first_encode(1)[1] / len(text))
        ref = llamacpp(path, text_file, 1)
        if ref is not None:
            theirs.append(ref["time"] / len(text))
            same = ids == ref["ids"] if same is None else same and ids == ref["ids"]
        if tok.kind == "spm":
            python.append(timed(lambda: spm_tokenize(esc, tok._to_id, tok._scores, tok._byte_ids)) / len(part))
    row["ours_chars_s"] = 1 / statistics.median(ours)
    row["ours_cpu_chars_s"] = 1 / statistics.median(cpu)
    if warm:
        row["ours_warm_chars_s"] = 1 / statistics.median(warm)
        row["threads"] = spm_fast.threads
        row["ours_1thread_chars_s"] = 1 / statistics.median(one)
        row["vs_1thread"] = statistics.median(t / o for o, t in zip(ours, one))
    if theirs:  # ratios: median over rounds of (their time per char / ours), each round side by side
        row["llamacpp_chars_s"] = 1 / statistics.median(theirs)
        row["vs_llamacpp"] = statistics.median(t / o for o, t in zip(ours, theirs))
        row["ids_equal_llamacpp"] = same
    if python:
        row["python_chars_s"] = 1 / statistics.median(python)
        row["vs_python"] = statistics.median(p / o for o, p in zip(ours, python))
    return row


def spm_parts(name: str, text: str, repeat: int = 7) -> dict:
    """CPU ms of each step of a first encode (SpmTokenizer.encode -> FastSpm.encode), best of repeat."""
    from itertools import chain

    tok = load_gguf_tokenizer(open_gguf(VOCAB_DIR / f"ggml-vocab-{name}.gguf").metadata)
    fast = tok._fast
    row: dict = {"vocab": name, "chars": len(text)}

    def cpu(step: str, fn):
        best = float("inf")
        for _ in range(repeat):
            c0 = time.process_time()
            out = fn()
            best = min(best, time.process_time() - c0)
        row[step + "_ms"] = round(best * 1e3, 2)
        return out

    cpu("repair", lambda: encodable(text))
    cpu("special_split", lambda: split_special(text, tok._specials, False))
    esc = cpu("escape", lambda: (" " + text).replace(" ", SPACE))
    words = cpu("word_split", lambda: fast._words(esc))
    new = cpu("distinct", lambda: list(dict.fromkeys(words)))
    row["words"], row["distinct_words"], row["distinct_chars"] = len(words), len(new), sum(map(len, new))
    ids = cpu("sentencepiece_1thread", lambda: fast._sp.encode(new, num_threads=1))
    cpu(f"sentencepiece_{fast.threads}threads", lambda: fast._sp.encode(new, num_threads=fast.threads))
    cache = cpu("cache_fill", lambda: dict(zip(new, ids)))
    cpu("assemble", lambda: list(chain.from_iterable(map(cache.__getitem__, words))))
    cpu("whole_text_in_one_call", lambda: fast._sp.encode(esc))

    def first() -> None:
        fast.clear_cache()
        tok.encode(text)

    cpu("first_encode_total", first)  # the steps above plus the calls between them
    return row


def synthetic_build() -> dict:
    """First use on a Gemma-sized SPM vocab: llama-spm's tokens plus made-up ones to 256k."""
    import random

    meta = open_gguf(VOCAB_DIR / "ggml-vocab-llama-spm.gguf").metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta["tokenizer.ggml.scores"])
    rng, seen = random.Random(0), set(tokens)
    while len(tokens) < 256_000:
        t = SPACE + "".join(rng.choice("abcdefghijklmnopqrstuvwxyzéü你") for _ in range(rng.randint(2, 9)))
        if t not in seen:
            seen.add(t)
            tokens.append(t)
            scores.append(-float(len(tokens)))
    big = {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
           "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], *[1] * (len(tokens) - 32000)]}
    tok = load_gguf_tokenizer(big)
    return {"vocab": "synthetic-256k", "tokens": len(tokens), "fast": tok._fast is not None,
            "build_s": timed(lambda: load_gguf_tokenizer(big)),
            "fast_build_s": timed(lambda: fast_spm(tok._tokens, tok._scores, tok._unk_id, tok._to_id))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", action="append", help=f"vocab test file name (default: {', '.join(VOCABS)})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kb", type=int, default=300, help="text size in KiB (half prose, half code)")
    ap.add_argument("--synthetic", action="store_true", help="also time building a 256k SPM vocab")
    ap.add_argument("--parts", action="store_true", help="only the steps of each SPM vocab's first encode")
    args = ap.parse_args()
    text = bench_text(args.kb)
    if args.parts:
        for name in args.vocab or [v for v in VOCABS if v in ("llama-spm", "phi-3")]:
            print(json.dumps(spm_parts(name, text)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        for name in args.vocab or VOCABS:
            print(json.dumps(bench_vocab(name, text, text_file, args.rounds)), flush=True)
    if args.synthetic:
        print(json.dumps(synthetic_build()), flush=True)


if __name__ == "__main__":
    main()
