"""One decode step of a synthetic model on CUDA, kernel by kernel: where a token's time goes.

    python bench/profile_step.py --preset gemma-3-4b --type Q4_K_M --layers 4 [--context 512] [--replays 200]

Builds the preset's shape (models.toml) with random weights, as `localllm bench --synthetic` does
(localllm.synthetic.synthetic_model), keeping its first --layers layers (a small file, the same layer
kinds), prefills --context tokens, then
  - times --replays replays of the captured greedy decode step (backends/cuda_graph.GraphDecoder, the
    step `generate` replays; CUDA events): us a token, tokens/s;
  - profiles --steps uncaptured steps of the same decoder kind (torch.profiler) and prints each kernel's
    calls a step, us a step and share of the kernels' time, and their sum against the graph's time
    (the difference: gaps between kernels, launch and scheduling).
--set FIELD=VALUE overrides a config field (e.g. --set vocab_size=32000). --device cpu runs the same
steps eagerly on the CPU (with TRITON_INTERPRET=1 and a tiny --set shape: a smoke run of this script;
the table then lists CPU ops). Errors exit non-zero with one line.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import fields, replace

import torch


def model_config(preset: str, layers: int | None, overrides: list[str]):
    """The preset's ModelConfig, cut to its first `layers` layers (per-layer tuples too), with overrides."""
    from localllm.registry import shape_preset

    cfg = shape_preset(preset)
    if layers is not None:
        if not 0 < layers <= cfg.n_layers:
            raise ValueError(f"--layers must be in 1..{cfg.n_layers}")
        cut = {f.name: getattr(cfg, f.name)[:layers] for f in fields(cfg)
               if isinstance(getattr(cfg, f.name), tuple) and len(getattr(cfg, f.name)) == cfg.n_layers}
        cfg = replace(cfg, n_layers=layers, **cut)
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in {f.name for f in fields(cfg)}:
            raise ValueError(f"--set {item}: no config field {name!r}")
        cfg = replace(cfg, **{name: ast.literal_eval(value)})
    return cfg


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_replays(dec, ids: torch.Tensor, n: int, device: str) -> tuple[float, torch.Tensor]:
    """-> (seconds a step over n greedy steps of dec (replays of its graph on CUDA), the last ids)."""
    for _ in range(5):  # warm-up (the first step captures the graph)
        ids = dec.step_greedy(ids)
    sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            ids = dec.step_greedy(ids)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n, ids
    t0 = time.perf_counter()
    for _ in range(n):
        ids = dec.step_greedy(ids)
    return (time.perf_counter() - t0) / n, ids


def kernel_table(prof, steps: int, device: str) -> list[tuple[str, float, float]]:
    """The profiled events (CUDA kernels and copies; CPU ops on the CPU) -> [(name, calls a step, us a
    step)], longest first."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    calls, total = defaultdict(int), defaultdict(float)
    for e in prof.events():
        if e.device_type != kind or (kind == DeviceType.CPU and e.cpu_parent is not None):
            continue
        calls[e.name] += 1
        total[e.name] += e.time_range.elapsed_us()
    rows = [(name, calls[name] / steps, total[name] / steps) for name in total]
    return sorted(rows, key=lambda r: -r[2])


def print_table(rows: list[tuple[str, float, float]], step_us: float) -> None:
    busy = sum(r[2] for r in rows)
    print(f"\n{'kernel':<64} {'calls/step':>10} {'us/step':>10} {'share':>7}")
    for name, calls, us in rows:
        short = name if len(name) <= 64 else name[:61] + "..."
        print(f"{short:<64} {calls:>10.1f} {us:>10.1f} {us / busy:>7.1%}")
    n = sum(r[1] for r in rows)
    print(f"{'all kernels':<64} {n:>10.1f} {busy:>10.1f} {1:>7.0%}")
    print(f"\nkernels' sum {busy:.1f} us a step; the captured step took {step_us:.1f} us "
          f"({step_us - busy:+.1f} us outside kernels: gaps, launch, scheduling)")


def print_sequence(prof, n: int, device: str) -> None:
    """The first n kernels of the first profiled step, in start order: name and us (which product is
    slow: the table sums a kernel's calls over every shape)."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    events = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    print(f"\nthe first {n} kernels of a step, in order:")
    for e in events[:n]:
        print(f"  {e.name[:60]:<60} {e.time_range.elapsed_us():>9.1f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gemma-3-4b", help="a [shapes] preset of models.toml")
    ap.add_argument("--type", default="Q4_K_M", help="weight type (synthetic.py: bf16, Q8_0, Q4_K_M, ...)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    ap.add_argument("--context", type=int, default=512, help="tokens prefilled before the decode steps")
    ap.add_argument("--replays", type=int, default=200, help="timed graph replays")
    ap.add_argument("--steps", type=int, default=3, help="profiled uncaptured steps")
    ap.add_argument("--sequence", type=int, default=0, metavar="N",
                    help="also list the first N kernels of one profiled step in launch order, with their us")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from localllm.backends.cuda import CudaRuntime
    from localllm.backends.cuda_graph import GraphDecoder
    from localllm.device import pick_dtype
    from localllm.load import build_model
    from localllm.synthetic import synthetic_state

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (this profiles the CUDA decode step; --device cpu: a smoke run)")
    cfg = model_config(args.preset, args.layers, args.set)
    dtype = pick_dtype(args.device, args.dtype)
    # synthetic_model's weights; on the CPU the CUDA backend's layout and ops (under the interpreter)
    state, types = synthetic_state(cfg, args.type, args.device)
    rt = build_model(cfg, state, args.device, dtype, backend=CudaRuntime if args.device == "cpu" else None)
    if not isinstance(rt, CudaRuntime):
        raise RuntimeError(f"{args.preset} runs on {type(rt).__name__}, not the graph decoder (backends/cuda.covers)")
    if args.device == "cuda":
        from localllm.kernels.triton_base import PDL

        print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | PDL {PDL}")
    print(f"{args.preset} {args.type} (synthetic) | layers {cfg.n_layers} | dtype {dtype} | "
          f"types {dict(types)} | context {args.context}")

    cache = rt.new_cache(args.context + args.replays + args.steps + 16)
    with torch.inference_mode():
        prompt = torch.randint(0, cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
        ids = rt.prefill(cache, [prompt.tolist()], 0).argmax(-1).to(torch.long)
        graph = GraphDecoder(rt.model, cache, use_graph=args.device == "cuda", greedy=True)
        ids = graph.step_greedy(ids)  # (a view of graph's input buffer from here on)
        step_s, ids = time_replays(graph, ids, args.replays, args.device)
        print(f"decode step: {step_s * 1e6:.1f} us = {1 / step_s:.1f} tokens/s "
              f"({args.replays} {'graph replays' if args.device == 'cuda' else 'eager steps'} at depth "
              f"{args.context}..{cache.length})")
        plain = GraphDecoder(rt.model, cache, use_graph=False, greedy=True)
        ids = plain.step_greedy(ids.clone())  # warm-up: kernels of the uncaptured step compiled
        sync(args.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                ids = plain.step_greedy(ids)
            sync(args.device)
    rows = kernel_table(prof, args.steps, args.device)
    if not rows:
        raise RuntimeError("the profiler recorded no kernels")
    print_table(rows, step_s * 1e6)
    if args.sequence:
        print_sequence(prof, args.sequence, args.device)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # the traceback, then one line; non-zero
        traceback.print_exc()
        print(f"profile_step: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
