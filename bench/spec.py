"""Speculative decoding on one device with synthetic (random-weight) models: the verify pass's cost and
end-to-end speedups (issue 7).

    python bench/spec.py                              # CUDA: llama-3.1-8b bf16 target, llama-3.2-1b bf16 draft
    python bench/spec.py --preset smollm2-135m        # small shapes for both (runs on the CPU, slowly)

Measured in one process, on one device, after warm-up (medians of --reps timings):
  1. a plain decode step of the target: generate.decode_one (on CUDA the captured CUDA graph);
  2. a verify pass of K+1 ids (speculative.verify: on CUDA the decode step's graph for K+1 tokens)
     for K = 1..7, each as a ratio to (1). The bar: K = 5 costs at most 1.3x a plain step. Also the
     model's eager multi-token forward of K+1 = 6 ids, for comparison;
  3. a decode step of each draft: the draft model, and the target quantized in memory (self:TYPE);
  4. end to end, greedy, -n ids after a prompt of --depth ids: plain decoding against speculative
     decoding with the draft model, with self:TYPE, and with prompt lookup on a repetitive prompt (a
     block of 64 random ids repeated). Speedup, acceptance, tokens per target pass, and whether the
     ids equal plain decoding's (they must).
Random weights: an unrelated random draft keeps almost nothing, and what self:TYPE and lookup keep
depends on how a random model repeats itself, so (4) shows what the machinery costs and gains here,
not what a trained pair would; (2) does not depend on the weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.backends.measure import device_name
from localllm.device import pick_device, pick_dtype
from localllm.draft import ModelDrafter, open_drafter, step_bytes
from localllm.generate import decode_one, generate, prefill
from localllm.registry import shape_preset
from localllm.sampling import Sampler
from localllm.settings import DEFAULT_DRAFT, DraftSettings, SamplingSettings
from localllm.commands.spec_bench import one_pair, random_prompt
from localllm.speculative import verify
from localllm.synthetic import synthetic_model

GREEDY = SamplingSettings(temperature=0.0)
BAR_K, BAR_RATIO = 5, 1.3


def median_ms(fn, rt, reps: int) -> float:
    """Median wall time of fn() in ms, after two warm-up calls (CUDA graph capture, cuBLAS plans)."""
    times = []
    for i in range(reps + 2):
        rt.sync()
        t0 = time.perf_counter()
        fn()
        rt.sync()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def at_depth(rt, depth: int, new: int):
    """A cache holding depth random ids, and `new` other random ids (1, new) to run after them."""
    cache = rt.new_cache(depth + new + 16)
    prefill(rt, cache, random_prompt(rt.cfg.vocab_size, depth, 0), 0)
    return cache, torch.tensor([random_prompt(rt.cfg.vocab_size, new, 1)], device=rt.device)


@torch.inference_mode()
def step_ms(rt, depth: int, reps: int) -> float:
    """One plain decode step at position depth (the cache rolled back after each)."""
    cache, ids = at_depth(rt, depth, 1)

    def step():
        decode_one(rt, cache, ids[0, 0])
        cache.length = depth

    return median_ms(step, rt, reps)


@torch.inference_mode()
def verify_ms(rt, depth: int, k: int, reps: int, eager: bool = False) -> float:
    """One verify pass of k + 1 ids at position depth (rolled back after each), as speculative
    decoding runs it; eager: the model's multi-token forward instead."""
    cache, ids = at_depth(rt, depth, k + 1)
    listed = ids[0].tolist()

    def run():
        if eager:
            rt.forward(ids, cache, depth)
        else:
            verify(rt, cache, listed)
        cache.length = depth

    return median_ms(run, rt, reps)


def end_to_end(rt, name: str, drafter, ds: DraftSettings, prompt: list[int], n: int) -> dict:
    cache = rt.new_cache(len(prompt) + n + 1)
    one_pair(rt, cache, drafter, ds, prompt, min(n, 8))  # warm-up
    plain, spec, same = one_pair(rt, cache, drafter, ds, prompt, n)
    return dict(drafter=name, plain=plain.generate_tps(), spec=spec.generate_tps(),
                speedup=spec.generate_tps() / plain.generate_tps(), acceptance=spec.acceptance(),
                per_pass=spec.tokens_per_pass(), same=same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llama-3.1-8b", help="models.toml shape preset of the target")
    ap.add_argument("--draft", default="llama-3.2-1b", help="shape preset of the draft model (same vocabulary)")
    ap.add_argument("--preset", default=None, help="one preset for both (e.g. smollm2-135m for a CPU run)")
    ap.add_argument("--type", default="bf16", help="target weight type (synthetic.py: bf16, Q8_0, Q4_0, ...)")
    ap.add_argument("--draft-type", default="bf16", help="draft model weight type")
    ap.add_argument("--self-type", default="Q4_0", help="TYPE of the self:TYPE draft")
    ap.add_argument("--lookup", type=int, default=3, help="longest n-gram of the lookup drafter")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="dense weights' dtype (default: the device's)")
    ap.add_argument("--depth", type=int, default=512, help="prompt length: the context the steps run at")
    ap.add_argument("-n", type=int, default=128, help="ids generated end to end")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of each step")
    args = ap.parse_args()
    target_name, draft_name = (args.preset, args.preset) if args.preset else (args.target, args.draft)
    dev = pick_device(args.device)
    dtype = pick_dtype(dev, args.dtype)
    tcfg, dcfg = shape_preset(target_name), shape_preset(draft_name)
    if tcfg.vocab_size != dcfg.vocab_size:
        raise SystemExit(f"{draft_name} has {dcfg.vocab_size} tokens, {target_name} {tcfg.vocab_size}: no draft for it")
    target, _ = synthetic_model(tcfg, args.type, dev, dtype, seed=0)
    draft, _ = synthetic_model(dcfg, args.draft_type, dev, dtype, seed=1)
    t0 = time.perf_counter()
    self_ds = DraftSettings(draft=f"self:{args.self_type}", dtype=args.dtype)
    self_drafter = open_drafter(target, None, self_ds, GREEDY)
    quantize_s = time.perf_counter() - t0
    device = target.device
    name = device_name(device)
    print(f"device {name}; target {target_name} {args.type}, draft {draft_name} {args.draft_type}, dtype {dtype}; "
          f"self:{args.self_type} built in {quantize_s:.1f} s; depth {args.depth}", flush=True)

    rows = [("plain decode step, target", step_ms(target, args.depth, args.reps), 1.0)]
    for k in range(1, 8):
        ms = verify_ms(target, args.depth, k, args.reps)
        rows.append((f"verify K+1 = {k + 1} ids", ms, ms / rows[0][1]))
    ms = verify_ms(target, args.depth, BAR_K, args.reps, eager=True)
    rows.append((f"verify K+1 = {BAR_K + 1} ids, the model's eager forward (for comparison)", ms, ms / rows[0][1]))
    rows.append((f"decode step, draft {draft_name} {args.draft_type}", step_ms(draft, args.depth, args.reps), 0.0))
    rows.append((f"decode step, self:{args.self_type}", step_ms(self_drafter.rt, args.depth, args.reps), 0.0))
    for i in (-2, -1):
        rows[i] = (rows[i][0], rows[i][1], rows[i][1] / rows[0][1])

    model_drafter = ModelDrafter(draft, Sampler(GREEDY, device), DEFAULT_DRAFT.min_p, step_bytes(draft.model) / step_bytes(target.model))
    lookup_ds = DraftSettings(lookup=args.lookup)
    natural = random_prompt(tcfg.vocab_size, args.depth, 2)
    repetitive = (random_prompt(tcfg.vocab_size, 64, 3) * (args.depth // 64 + 1))[: args.depth]
    e2e = [
        end_to_end(target, f"draft model {draft_name}", model_drafter, DEFAULT_DRAFT, natural, args.n),
        end_to_end(target, f"self:{args.self_type}", self_drafter, self_ds, natural, args.n),
        end_to_end(target, f"self:{args.self_type}, repetitive prompt", self_drafter, self_ds, repetitive, args.n),
        end_to_end(target, f"lookup {args.lookup}, repetitive prompt", open_drafter(target, None, lookup_ds, GREEDY),
                   lookup_ds, repetitive, args.n),
    ]

    # plain decoding against itself: split-K products must reduce deterministically for "same ids" to mean much
    runs = []
    for _ in range(2):
        cache = target.new_cache(len(natural) + args.n + 1)
        runs.append(list(generate(target, cache, natural, Sampler(GREEDY, device), args.n)))
    print(f"plain decoding twice, {args.n} greedy ids: {'identical' if runs[0] == runs[1] else 'DIFFERENT'}")

    print("\n| step | ms | x plain step |\n| --- | ---: | ---: |")
    for label, ms, ratio in rows:
        print(f"| {label} | {ms:.3f} | {ratio:.3f} |")
    verify_bar = rows[BAR_K][2]
    verdict = "met" if verify_bar <= BAR_RATIO else "NOT met"
    print(f"\nbar: verifying {BAR_K} drafted ids costs {verify_bar:.3f}x a plain step (at most {BAR_RATIO}): {verdict}")
    print(f"\n| drafter (greedy, {args.n} ids after {args.depth}) | plain t/s | speculative t/s | speedup | acceptance "
          "| tokens/pass | same ids |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in e2e:
        print(f"| {r['drafter']} | {r['plain']:.1f} | {r['spec']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.1%} "
              f"| {r['per_pass']:.2f} | {'yes' if r['same'] else 'NO'} |")


if __name__ == "__main__":
    main()
