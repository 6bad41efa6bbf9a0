"""Fuzz the model loaders and the tokenizers; any outcome but success or one LocalLLMError line fails.

Targets: gguf (mutated tiny GGUF models: load_model, then 3 greedy tokens), safetensors (mutated tiny
Hugging Face folders, the same), tokenizer (random text through encode, random ids through decode
and the stream decoder, for every vocabulary). Cases run in worker subprocesses (fuzz_worker.py)
with a per-case timeout and an address-space limit; everything is derived from --seed, so a run is
reproducible, and the first case of each failure class is kept under --out.

    python tests/fuzz_gguf.py --target all --cases 500000 --jobs 16 --seed 1
    python tests/fuzz_gguf.py --target gguf --seconds 120 --coverage 30
    python tests/fuzz_gguf.py --replay /tmp/localllm-fuzz-out/<class>/case.gguf   # its traceback, in-process
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_cases import TARGETS, Seeds, build_case, case_suffix, write_case  # noqa: E402
from fuzz_pool import PoolConfig, run_pool  # noqa: E402
from fuzz_seeds import gguf_seeds, hf_seeds, vocab_paths, write_seeds  # noqa: E402
from fuzz_tally import Tally, save_json, summary  # noqa: E402


def case_stream(targets: list[str], limit: int | None):
    """(target, index) in turn over the targets; each target numbers its own cases from 0."""
    counter = itertools.count() if limit is None else range(limit)
    for n in counter:
        yield targets[n % len(targets)], n // len(targets)


def repro_command(target: str, path: str) -> str:
    if target == "tokenizer":
        return f"python tests/fuzz_gguf.py --replay {path}"
    return (f"python -c \"from localllm.load import load_model; from localllm.runner import complete; "
            f"from localllm.settings import GenerationSettings as G, SamplingSettings as S; "
            f"lm = load_model('{path}', 'cpu'); print(repr(''.join(complete(lm, 'hello the', G(max_tokens=3),"
            f" S(temperature=0)))))\"")


def make_saver(args: argparse.Namespace, seeds: Seeds):
    def save(target: str, idx: int, slug: str) -> tuple[str, list[str]]:
        case = build_case(args.seed, target, idx, seeds)
        folder = args.out / slug
        folder.mkdir(parents=True, exist_ok=True)
        path = write_case(case, folder / f"case{case_suffix(target)}")
        (folder / "case.txt").write_text(json.dumps(dict(target=target, seed=args.seed, idx=idx, what=case.what),
                                                    indent=1) + "\n" + repro_command(target, str(path)) + "\n")
        return str(path), case.what
    return save


def replay(path: Path) -> None:
    """Run one saved case in this process, so that its traceback shows."""
    from fuzz_worker import load_tokenizers, run_model, run_tokenizer

    if path.suffix == ".json":
        case = json.loads(path.read_text())
        print(run_tokenizer({**case, "vocab": 0}, load_tokenizers([case["name"]])))
    else:
        print(run_model(path))


def findings(tally: Tally, text: str) -> str:
    """The markdown the owners of the code read: the summary, then one reproduction line per class."""
    lines = [f"# Fuzz findings ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})", "", "```", text, "```", ""]
    for (t, o, exc, frame), c in sorted(tally.classes.items(), key=lambda kv: -kv[1].count):
        lines += [f"## [{t}] {o}: {exc} at {frame or c.inner or '?'} ({c.count} cases)", "",
                  f"- message: `{c.message[:300]}`", f"- innermost frame: `{c.inner}`",
                  f"- case: {'; '.join(c.what)[:400]}", f"- reproducer: `{c.reproducer}`",
                  f"- run: `{repro_command(t, c.reproducer)}`", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="all", help="gguf, safetensors, tokenizer, a comma list, or all")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases (all targets together)")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop dispatching after this long (default: 60, or no limit with --cases)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per case before it counts as a hang")
    p.add_argument("--mem-mb", type=int, default=4096, help="address-space limit of a worker")
    p.add_argument("--small-vocabs", action="store_true", help="tokenizer target: only four quick vocabularies")
    p.add_argument("--coverage", type=int, default=0, help="list this many of the error messages reached")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "localllm-fuzz-out",
                   help="reproducers and report.json")
    p.add_argument("--findings", type=Path, default=None, help="also write the findings as markdown here")
    p.add_argument("--replay", type=Path, default=None, help="run one saved case in-process")
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = float("inf") if args.cases else 60.0
    args.targets = list(TARGETS) if args.target == "all" else args.target.split(",")
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown target {sorted(unknown)[0]!r}; known: {', '.join(TARGETS)}, all")
    return args


def fuzz(args: argparse.Namespace) -> Tally:
    """The whole run: seeds written into a scratch folder, the pool, the summary printed."""
    work = Path(tempfile.mkdtemp(prefix="localllm-fuzz-"))
    try:
        write_seeds(work / "seeds")
        vocabs = vocab_paths(args.small_vocabs) if "tokenizer" in args.targets else []
        seeds = Seeds(gguf_seeds(work / "seeds"), hf_seeds(work / "seeds"), vocabs)
        args.out.mkdir(parents=True, exist_ok=True)
        cfg = PoolConfig(work / "seeds", work, args.seed, args.targets, vocabs, args.jobs, args.timeout, args.mem_mb)
        tally, save = Tally(), make_saver(args, seeds)
        print(f"fuzz seed {args.seed}, targets {','.join(args.targets)}, {args.jobs} job(s)", flush=True)
        seconds = run_pool(cfg, case_stream(args.targets, args.cases), lambda r: tally.add(r, save), args.seconds)
        text = summary(tally, args.seed, seconds, args.jobs, args.coverage)
        print(text, flush=True)
        save_json(tally, args.out / "report.json")
        if args.findings:
            args.findings.write_text(findings(tally, text))
        return tally
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        replay(args.replay)
        return 0
    return 1 if fuzz(args).failures() else 0


if __name__ == "__main__":
    sys.exit(main())
