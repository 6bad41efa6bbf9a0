"""Where a CUDA decode step's time goes: per-kernel GPU time of one step (eager, so every kernel is
seen) against the replayed CUDA graph's time per token, for synthetic models; with --prefill, the
same for one prefill of --ctx tokens (wall time against the sum of its kernels' GPU time). With
--graph, the replayed graph itself is profiled (PDL overlap included): each kernel's marginal time
(its end minus the previous kernel's end), summed by the kernel's place in a layer.

    python bench/decode_profile.py llama-3.1-8b:bf16 llama-3.1-8b:Q4_K_M [--ctx 640] [--prefill | --graph]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from localllm.cache import make_cache
from localllm.cuda_decode import GraphDecoder
from localllm.generate import prefill
from localllm.registry import shape_preset
from localllm.synthetic import synthetic_model

from decode_variants import constants, variant


def step_time(dec: GraphDecoder, token: torch.Tensor, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        dec.step(token)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def kernel_table(prof, title: str) -> None:
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name[:60]][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"\n### {title}; kernels {total / 1e3:.3f} ms (sum of GPU time); {sum(v[1] for v in per.values())} kernels")
    print("| kernel | calls | us | share |\n| --- | ---: | ---: | ---: |")
    for name, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"| {name} | {calls} | {us:.0f} | {us / total:.0%} |")


def profile_prefill(preset: str, wtype: str, ctx: int) -> None:
    cfg = shape_preset(preset)
    model, _ = synthetic_model(cfg, wtype, "cuda", torch.bfloat16)
    cache = make_cache(cfg, ctx + 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
    GraphDecoder(model, cache).step(prefill(model, cache, ids).argmax())  # as in `bench`: fused decode weights
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill(model, cache, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        prefill(model, cache, ids)
        torch.cuda.synchronize()
    kernel_table(prof, f"{preset} {wtype} prefill {ctx}: wall {sorted(times)[3] * 1e3:.2f} ms (median of 6: "
                 + ", ".join(f"{t * 1e3:.1f}" for t in times) + ")")
    del model, cache
    torch.cuda.empty_cache()


def graph_decoder(preset: str, wtype: str, ctx: int, plan: str = ""):
    """A synthetic model after a ctx-token prompt, its graph decoder (captured) and the step time."""
    cfg = shape_preset(preset)
    model, _ = synthetic_model(cfg, wtype, "cuda", torch.bfloat16)
    cache = make_cache(cfg, ctx + 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
    token = prefill(model, cache, ids).argmax()
    kwargs, consts = variant(plan)
    graph = GraphDecoder(model, cache, **kwargs)
    with constants(consts):  # read as the graph is captured
        graph.step(token)
    return cfg, model, cache, token, graph, step_time(graph, token, 20)


def profile_one(preset: str, wtype: str, ctx: int) -> None:
    cfg, model, cache, token, graph, t_graph = graph_decoder(preset, wtype, ctx)
    cache.length = ctx
    eager = GraphDecoder(model, cache, use_graph=False)
    eager.step(token)
    cache.length = ctx
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager.step(token)
        torch.cuda.synchronize()
    kernel_table(prof, f"{preset} {wtype}: graph step {t_graph * 1e3:.3f} ms, eager step")
    del model, cache, graph, eager
    torch.cuda.empty_cache()


def period(names: list[str], layers: int) -> int:
    """Kernels per layer: the smallest c such that the middle layers repeat with period c."""
    for c in range(1, len(names) // layers + 1):
        mid = names[c:c + (layers - 2) * c]
        if all(a == b for a, b in zip(mid, mid[c:])):
            return c
    raise ValueError("no period")


def profile_graph(preset: str, wtype: str, ctx: int, plan: str = "") -> None:
    cfg, model, cache, token, graph, t_graph = graph_decoder(preset, wtype, ctx, plan)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.step(token)
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    ks = [e for e in ks if "Memcpy" not in e.name and "Memset" not in e.name]
    names = [e.name[:40] for e in ks]
    marginal = [ks[0].time_range.end - ks[0].time_range.start] + [
        max(0, ks[i].time_range.end - ks[i - 1].time_range.end) for i in range(1, len(ks))]
    try:
        c = period(names, cfg.n_layers)
    except ValueError:  # layers of different kernels (a mix of weight types): totals by kernel name
        print(f"\n### {preset} {wtype} {plan} graph step {t_graph * 1e3:.3f} ms; {len(ks)} kernels")
        per = defaultdict(float)
        for name, us in zip(names, marginal):
            per[name] += us
        print("| kernel | us a step (marginal) |\n| --- | ---: |")
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {us:.0f} |")
        # layers are told apart by their attention combine (one a layer, with or without rope_store)
        marks = [i for i, n in enumerate(names) if n.startswith("_attn_combine")]
        lo, hi = marks[min(3, len(marks) - 1)], marks[min(7, len(marks) - 1)]
        print(f"\nkernels {lo}..{hi} (from the 4th layer's attention combine): marginal us")
        for i in range(lo, hi):
            print(f"| {names[i]} | {marginal[i]:.1f} |")
        return
    first = next(i for i in range(len(names)) if names[i:i + c] == names[i + c:i + 2 * c])
    span = ks[-1].time_range.end - ks[0].time_range.start
    print(f"\n### {preset} {wtype} {plan} graph step {t_graph * 1e3:.3f} ms; profiled span {span / 1e3:.3f} ms; "
          f"{len(ks)} kernels, {c} a layer")
    print("| place | kernel | us a layer (marginal) | us alone (duration) |\n| --- | --- | ---: | ---: |")
    body = range(first, first + cfg.n_layers * c)
    for j in range(c):
        idx = [i for i in body if (i - first) % c == j]
        marg = sum(marginal[i] for i in idx) / len(idx)
        dur = sum(ks[i].time_range.end - ks[i].time_range.start for i in idx) / len(idx)
        print(f"| {j} | {names[first + j]} | {marg:.1f} | {dur:.1f} |")
    rest = [i for i in range(len(ks)) if i not in body]
    for i in rest:
        print(f"| outside | {names[i]} | {marginal[i]:.1f} | {ks[i].time_range.end - ks[i].time_range.start:.1f} |")
    del model, cache, graph
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="PRESET:TYPE")
    ap.add_argument("--ctx", type=int, default=640)
    ap.add_argument("--prefill", action="store_true", help="profile a prefill of --ctx tokens instead")
    ap.add_argument("--graph", action="store_true", help="profile the replayed decode graph (marginal times)")
    ap.add_argument("--variant", default="", help="with --graph: a GraphDecoder variant (bench/decode_variants.py)")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    for case in args.cases:
        preset, wtype = case.split(":")
        if args.graph:
            profile_graph(preset, wtype, args.ctx, args.variant)
        else:
            (profile_prefill if args.prefill else profile_one)(preset, wtype, args.ctx)


if __name__ == "__main__":
    main()
