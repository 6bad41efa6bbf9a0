"""`localllm bench --draft/--lookup`: generation with speculative decoding against plain decoding of the
same target, prompt and length, measured in the same run.

Greedy, so both must give the same ids ("same output" checks it on every repetition). For each prompt
length p and generation length n: a random prompt of p ids (seeded per repetition), then n ids without
stop ids, plain then speculative; t/s is stats.generate_tps() of each (the prompt's prefill excluded).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from localllm.commands.bench import BenchModel, bench_models, check_context, check_grid, mean_std
from localllm.backends.measure import device_name
from localllm.draft import open_drafter
from localllm.generate import Stats, generate
from localllm.sampling import Sampler
from localllm.settings import DraftSettings, SamplingSettings
from localllm.runtime import Runtime
from localllm.speculative import Drafter, SpecStats, generate_speculative

GREEDY = SamplingSettings(temperature=0.0)


@dataclass
class SpecRow:
    model: str
    draft: str
    device: str
    test: str
    plain_tps: float
    spec_tps: float
    spec_std: float
    speedup: float  # mean over repetitions of spec / plain t/s
    speedup_std: float
    acceptance: float
    tokens_per_pass: float
    same_output: bool


def random_prompt(vocab_size: int, p: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (p,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_pair(rt: Runtime, cache, drafter: Drafter, ds: DraftSettings, prompt: list[int], n: int
             ) -> tuple[Stats, SpecStats, bool]:
    """Plain then speculative greedy generation of n ids after prompt (no stop ids), in cache."""
    plain, spec = Stats(), SpecStats()
    cache.length = 0
    rt.warm_verify(cache)  # graph captures stay out of the timings
    plain_ids = list(generate(rt, cache, prompt, Sampler(GREEDY, rt.device), n, (), plain))
    cache.length = 0
    spec_ids = list(generate_speculative(rt, cache, prompt, Sampler(GREEDY, rt.device), drafter, n, (), spec,
                                         settings=ds))
    return plain, spec, plain_ids == spec_ids


def bench_spec_model(bm: BenchModel, drafter: Drafter, ds: DraftSettings, prompts, gens, reps: int) -> list[SpecRow]:
    check_context(bm, prompts, gens, [0])
    rt = bm.runtime
    dev_name = device_name(rt.device)
    draft = ds.draft or f"lookup {ds.lookup}"
    rows = []
    for p in prompts:
        for n in gens:
            cache = rt.new_cache(p + n + 1)
            vocab = rt.cfg.vocab_size
            one_pair(rt, cache, drafter, ds, random_prompt(vocab, p, -1), min(n, 4))  # warm-up: CUDA graphs
            runs = [one_pair(rt, cache, drafter, ds, random_prompt(vocab, p, r), n) for r in range(reps)]
            plain = statistics.mean(a.generate_tps() for a, _, _ in runs)
            spec = mean_std([b.generate_tps() for _, b, _ in runs])
            speedup = mean_std([b.generate_tps() / a.generate_tps() for a, b, _ in runs])
            drafted = sum(b.drafted for _, b, _ in runs)
            rows.append(SpecRow(
                bm.name, draft, dev_name, f"tg{n} after pp{p}", plain, *spec, *speedup,
                sum(b.accepted for _, b, _ in runs) / drafted if drafted else 0.0,
                sum(b.generated_tokens for _, b, _ in runs) / sum(b.target_passes for _, b, _ in runs),
                all(same for _, _, same in runs),
            ))
    return rows


def format_spec_rows(rows: list[SpecRow], fmt: str = "md") -> str:
    if fmt == "json":
        return json.dumps([asdict(r) for r in rows], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        w = csv.DictWriter(out, fieldnames=[f for f in SpecRow.__dataclass_fields__])
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
        return out.getvalue()
    head = ("| model | draft | device | test | plain t/s | speculative t/s | speedup | acceptance | tokens/pass "
            "| same output |\n| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |\n")
    lines = [
        f"| {r.model} | {r.draft} | {r.device} | {r.test} | {r.plain_tps:.2f} | {r.spec_tps:.2f} ± {r.spec_std:.2f} "
        f"| {r.speedup:.2f} ± {r.speedup_std:.2f} | {r.acceptance:.1%} | {r.tokens_per_pass:.2f} "
        f"| {'yes' if r.same_output else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def run_spec_bench(specs, presets, wtypes, prompts, gens, reps, device, dtype, ds: DraftSettings, fmt="md") -> str:
    """The whole `localllm bench --draft/--lookup`: every target (files, then synthetic presets x types)
    with the drafter ds asks for -> formatted table."""
    check_grid(prompts, gens, [0], reps, least_gen=1)
    rows = []
    for bm in bench_models(specs, presets, wtypes, device, dtype):
        check_context(bm, prompts, gens, [0])  # before the drafter is built
        drafter = open_drafter(bm.runtime, bm.tokenizer, ds, GREEDY)
        rows += bench_spec_model(bm, drafter, ds, prompts, gens, reps)
        del drafter
    return format_spec_rows(rows, fmt)
