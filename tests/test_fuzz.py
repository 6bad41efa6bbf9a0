"""The fuzzer in CI: a bounded, seeded campaign over the GGUF and safetensors loaders and the
tokenizers (tests/fuzz_gguf.py). Any outcome other than success or one LocalLLMError line (another
exception, a hang, a crash, unbounded memory, a multi-line error) fails, with the failure classes
listed and their cases kept in the test's tmp folder."""

from __future__ import annotations

import random

from fuzz_cases import Seeds, build_case
from fuzz_gguf import fuzz, parse_args
from fuzz_gguf_layout import assemble, parse
from fuzz_gguf_mutate import mutate
from fuzz_seeds import gguf_seeds, hf_seeds, write_seeds
from fuzz_tally import FAILURES

SEED = 17
SECONDS = 30  # of fuzzing, all three targets in turn (plus ~15 s for the seeds and the workers to start)
JOBS = 2  # CI's two cores


def test_seeds_parse_back_and_mutations_are_deterministic(tmp_path):
    write_seeds(tmp_path)
    seeds = Seeds(gguf_seeds(tmp_path), hf_seeds(tmp_path), ["vocab.gguf"])
    for raw in seeds.gguf.values():
        lay = parse(raw)
        assert assemble(lay) == raw  # the entry-level mutators rebuild files from this split
        categories = {s.category for s in lay.slots}
        assert {"header", "value", "dim", "tensor_type", "tensor_offset", "array_count"} <= categories
    for target in ("gguf", "safetensors", "tokenizer"):
        a, b = build_case(SEED, target, 5, seeds), build_case(SEED, target, 5, seeds)
        assert a.data == b.data and a.what == b.what
    raw = seeds.gguf["tiny_f32.gguf"]
    changed = sum(mutate(raw, raw, random.Random(i))[0] != raw for i in range(50))
    assert changed >= 45, f"only {changed} of 50 mutations changed the file"


def test_fuzz_campaign(tmp_path):
    args = parse_args(["--target", "all", "--seconds", str(SECONDS), "--jobs", str(JOBS), "--seed", str(SEED),
                       "--small-vocabs", "--out", str(tmp_path), "--coverage", "10"])
    print(f"fuzz seed {SEED}; cases kept in {tmp_path}")
    tally = fuzz(args)
    per_target = {t: sum(n for (t2, _), n in tally.counts.items() if t2 == t) for t in args.targets}
    assert all(n >= 20 for n in per_target.values()), f"too few cases ran: {per_target}"
    # The unmutated seeds and light mutations must get through to generation, or nothing deep is fuzzed.
    assert tally.counts["gguf", "ok"] and tally.counts["safetensors", "ok"], dict(tally.counts)
    failing = {k: n for k, n in tally.counts.items() if k[1] in FAILURES}
    assert not failing, "\n".join(
        [f"fuzz seed {SEED}: failing outcomes {failing}; failure classes (first case kept on disk):"]
        + [f"- [{t}] {o} {exc} at {frame or c.inner}: {c.message[:200]} x{c.count}\n  {'; '.join(c.what)[:200]}"
           f"\n  reproducer: {c.reproducer}" for (t, o, exc, frame), c in tally.classes.items()])
