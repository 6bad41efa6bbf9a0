"""`localllm bench`: prompt processing (pp) and generation (tg) speed against a roofline measured in-process.

Tests, for each prompt length p, generation length n, depth d and batch B of the grid:
  pp{p}: one prefill of p tokens after d tokens already in the cache (tokens/s; achieved TFLOP/s as
         2 x (linear parameters x p + head parameters) / time, against a bf16 (CPU: fp32) matmul measured here);
  tg{n}: n decode steps (greedy) right after that prompt, context d + p (tokens/s; achieved GB/s as
         (weight bytes + KV cache bytes at the mean context) read per step x steps/s, against a
         device-to-device copy measured here, bytes read + written).
With B > 1 (" bB" after the test's name) B random prompts of the same length run at once, each with
its own cache rows: one prefill of B x p tokens, and decode steps of B tokens (one per prompt) through
the same kernels, which read the weights once for all B; tokens/s counts every prompt's tokens.
Each repetition gives one figure; rows show mean ± standard deviation over repetitions.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch


from localllm import options
from localllm.errors import LocalLLMError
from localllm.backends.measure import device_name, free_memory, measure_roofline
from localllm.runtime import Runtime
from localllm.footprint import kv_bytes_per_token, linear_params, model_stats, weight_bytes_per_token
from localllm.tokenizer import Tokenizer


@dataclass
class BenchModel:
    name: str
    runtime: Runtime
    types: Counter  # weight type -> tensor count
    tokenizer: Tokenizer | None = None  # a file's (a draft model's vocabulary is checked against it)


@dataclass
class Row:
    model: str
    size_gib: float
    params_b: float
    types: str
    device: str
    test: str
    tps_mean: float
    tps_std: float
    achieved: float  # GB/s (tg) or TFLOP/s (pp)
    unit: str
    roofline_share: float
    tp: int = 1  # tensor-parallel degree (--tp): ranks the model ran on


def one_run(rt: Runtime, p: int, n: int, depth: int, cache, seed: int) -> tuple[float, float]:
    """-> (prefill seconds of p tokens at depth, seconds of n decode steps after it), for each of the
    cache's B sequences at once (a random prompt each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rt.cfg.vocab_size, (cache.k.shape[1], depth + p), generator=g)
    cache.length = 0
    if depth:
        rt.prefill(cache, ids[:, :depth].tolist(), 0)
    rt.sync()
    t0 = time.perf_counter()
    logits = rt.prefill(cache, ids[:, depth:].tolist(), depth)
    rt.sync()
    t1 = time.perf_counter()
    tokens = logits.argmax(-1)
    for _ in range(n):
        tokens = rt.greedy_step(cache, tokens)
    rt.sync()
    return t1 - t0, time.perf_counter() - t1


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.pstdev(xs) if len(xs) > 1 else 0.0


def describe_types(types: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in types.most_common())


def check_grid(prompts, gens, depths, reps: int, batches=(1,), least_gen: int = 0) -> None:
    """The grid's values, before any model loads: a prompt of 0 tokens has no logits to start from,
    statistics need a repetition (least_gen: 1 where a test is generation only)."""
    for name, values, low in (("-p/--n-prompt", prompts, 1), ("-n/--n-gen", gens, least_gen), ("-d/--depth", depths, 0),
                              ("-b/--batch", batches, 1)):
        if not values or min(values) < low:
            raise LocalLLMError(f"{name} takes whole numbers of at least {low}, got {list(values)}")
    options.at_least("-r/--repetitions", reps, 1)


def check_context(bm: BenchModel, prompts, gens, depths) -> None:
    """The grid's longest test fits the model's context (past it, positions the model was not trained
    for, and a cache as large as the user typed: minutes, gigabytes)."""
    d, p, n = max(depths), max(prompts), max(gens)
    ctx = bm.runtime.cfg.context_length
    if d + p + n > ctx:
        raise LocalLLMError(f"{bm.name}: the longest test needs depth {d} + prompt {p} + generated {n} = {d + p + n} "
                            f"tokens but the model's context is {ctx}: lower -d, -p or -n")


def bench_model(bm: BenchModel, prompts, gens, depths, reps: int, roof: dict, batches=(1,)) -> list[Row]:
    check_context(bm, prompts, gens, depths)
    rt = bm.runtime
    held, params = model_stats(rt.model)
    wbytes, lparams = weight_bytes_per_token(rt.model), linear_params(rt.model)
    dev_name = device_name(rt.device)
    base = dict(model=bm.name, size_gib=held / 2**30, params_b=params / 1e9, types=describe_types(bm.types),
                device=dev_name)
    rows, seen_pp = [], set()
    for b, depth, p, n in itertools.product(batches, depths, prompts, gens):
        cache = rt.new_cache(depth + p + n + 1, b)
        for _ in range(2):  # warm-up: compile, cuBLAS plans, capture (a prefill shape's second run)
            one_run(rt, p, min(n, 2), depth, cache, seed=-1)
        runs = [one_run(rt, p, n, depth, cache, seed=r) for r in range(reps)]
        at = (f" @ d{depth}" if depth else "") + (f" b{b}" if b > 1 else "")
        if (b, p, depth) not in seen_pp:
            seen_pp.add((b, p, depth))
            tps = mean_std([b * p / t for t, _ in runs])
            rate = 2 * (lparams[0] + lparams[1] / p) * tps[0]
            rows.append(Row(**base, test=f"pp{p}{at}", tps_mean=tps[0], tps_std=tps[1],
                            achieved=rate / 1e12, unit="TFLOP/s", roofline_share=rate / roof["flops"]))
        if n:
            tps = mean_std([b * n / t for _, t in runs])
            # the speed limit: weights plus the KV cache read (every sequence's), at the mean context
            bw = (wbytes + kv_bytes_per_token(cache, depth + p + n / 2)) * tps[0] / b
            rows.append(Row(**base, test=f"tg{n} after pp{p}{at}", tps_mean=tps[0], tps_std=tps[1],
                            achieved=bw / 1e9, unit="GB/s", roofline_share=bw / roof["bandwidth"]))
        del cache
    return rows


def format_rows(rows: list[Row], roof: dict, fmt: str = "md") -> str:
    if fmt == "json":
        return json.dumps({"roofline": roof, "rows": [asdict(r) for r in rows]}, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        w = csv.DictWriter(out, fieldnames=list(asdict(rows[0]).keys()) if rows else ["model"])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
        return out.getvalue()
    with_tp = any(r.tp > 1 for r in rows)  # the tp column only where a row ran on several ranks
    head = "| model | size | params | weight types | device | " + ("tp | " if with_tp else "") + "test | t/s | achieved | roofline |\n"
    head += "| --- | --- | --- | --- | --- | " + ("---: | " if with_tp else "") + "--- | ---: | ---: | ---: |\n"
    lines = [
        f"| {r.model} | {r.size_gib:.2f} GiB | {r.params_b:.2f} B | {r.types} | {r.device} | "
        + (f"{r.tp} | " if with_tp else "") + f"{r.test} "
        f"| {r.tps_mean:.2f} ± {r.tps_std:.2f} | {r.achieved:.3g} {r.unit} | {r.roofline_share:.0%} |"
        for r in rows
    ]
    foot = (f"\nroofline: copy {roof['bandwidth'] / 1e9:.0f} GB/s (read + write), "
            f"matmul {roof['flops'] / 1e12:.1f} TFLOP/s\n")
    return head + "\n".join(lines) + "\n" + foot


def bench_models(specs: list[str], presets: list[str], wtypes: list[str], device: str, dtype: str | None, tp=None):
    """Yield BenchModels one at a time (the previous one is freed first): files/names, then synthetic
    models of each shape preset x weight type, built on the device. tp: this rank's shard of each."""
    from localllm.device import pick_device, pick_dtype, rank_device
    from localllm.registry import shape_preset
    from localllm.runner import open_model
    from localllm.synthetic import synthetic_model

    dev = pick_device(device)
    for spec in specs:
        lm = open_model(spec, dev, dtype, tp)
        yield BenchModel(lm.path.name, lm.runtime, lm.tensor_types, lm.tokenizer)
        del lm
        free_memory(dev)
    for preset in presets:
        cfg = shape_preset(preset)
        for wtype in wtypes:
            rt, types = synthetic_model(cfg, wtype, rank_device(dev, tp), pick_dtype(dev, dtype), tp=tp)
            yield BenchModel(f"{preset} {wtype} (synthetic)", rt, types)
            del rt
            free_memory(dev)


def run_bench(specs, presets, wtypes, prompts, gens, depths, reps, device="auto", dtype=None, fmt="md",
              batches=(1,), tp=None) -> str:
    """The whole `localllm bench`: roofline once, then every model over the grid -> formatted table.
    tp (a rank's parallel.TensorParallel, commands/tp_cmd.py): rank 0 drives each model's steps
    (tp_runtime.Driver) and returns the table, the other ranks follow them and return ""."""
    from localllm.tp_runtime import Driver, follow

    check_grid(prompts, gens, depths, reps, batches)
    rows, roof = [], None
    for bm in bench_models(specs, presets, wtypes, device, dtype, tp):
        if tp is not None and not tp.driver:
            follow(bm.runtime, tp)
            continue
        check_context(bm, prompts, gens, depths)  # before the roofline's seconds
        roof = roof or measure_roofline(bm.runtime.device)
        if tp is None:
            rows += bench_model(bm, prompts, gens, depths, reps, roof, batches)
            continue
        with Driver(bm.runtime, tp) as driver:  # stops the workers' model also on an error
            bm.runtime = driver
            rows += [replace(r, tp=tp.world) for r in bench_model(bm, prompts, gens, depths, reps, roof, batches)]
    if tp is not None and not tp.driver:
        return ""
    return format_rows(rows, roof or {"bandwidth": 0.0, "flops": 0.0}, fmt)
