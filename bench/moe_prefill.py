"""One mixture-of-experts layer's prompt on CUDA, old against new: MoE.forward (the eager per-expert
loop: a host sync and ~5 launches per chosen expert) against backends/cuda_moe_prefill.moe_prefill
(device routing, grouped GEMMs), eagerly and replayed from a captured CUDA graph.

    python bench/moe_prefill.py --preset qwen3-30b-a3b --type Q4_K_M --tokens 512
    python bench/moe_prefill.py --preset gpt-oss-20b --type MXFP4 --tokens 512

Builds the preset's first layer with random weights as `localllm bench --synthetic` does
(localllm.synthetic.synthetic_model), feeds --tokens random rows of the model dim (bf16) to the
layer's MoE, and prints ms a call (CUDA events, median of --reps) for each path, the speedup, the
layer's tokens/s and the relative difference of the two outputs (bf16 rounding only: the same
experts, the same weights). --device cpu (with TRITON_INTERPRET=1 and a tiny --set shape) is a smoke
run of this script. Errors exit non-zero with one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from profile_step import model_config


def timed(fn, reps: int, device: str) -> float:
    """Median seconds of fn() over reps calls (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph -> (a replay function, the graph's output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE config override")
    args = ap.parse_args(argv)
    try:
        from localllm.backends.cuda import CudaRuntime
        from localllm.backends.cuda_moe_prefill import moe_prefill
        from localllm.synthetic import synthetic_model

        cfg = model_config(args.preset, 1, args.set)
        if not cfg.n_experts:
            raise ValueError(f"{args.preset} has no experts")
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        if args.device == "cuda":
            rt, types = synthetic_model(cfg, args.type, "cuda", dtype)
        else:  # the CUDA backend's layout on the CPU (interpreted kernels)
            from localllm.load import build_model
            from localllm.synthetic import synthetic_state

            state, types = synthetic_state(cfg, args.type, "cpu")
            rt = build_model(cfg, state, "cpu", dtype, backend=CudaRuntime)
        if not isinstance(rt, CudaRuntime):
            raise ValueError(f"{args.preset} does not take the CUDA graph runtime")
        moe = rt.model.blk[0].moe
        h = torch.randn(1, args.tokens, cfg.dim, generator=torch.Generator().manual_seed(0)).to(args.device, dtype)
        with torch.inference_mode():
            old_out, new_out = moe(h), moe_prefill(moe, h)
            err = ((new_out.double() - old_out.double()).norm() / old_out.double().norm()).item()
            old = timed(lambda: moe(h), args.reps, args.device)
            new = timed(lambda: moe_prefill(moe, h), args.reps, args.device)
            replay = None
            if args.device == "cuda":
                run, out = graphed(lambda: moe_prefill(moe, h))
                replay = timed(run, args.reps, args.device)
                assert torch.equal(out, new_out), "the graph's output differs from the eager call's"
    except Exception as exc:  # noqa: BLE001  (one line, non-zero exit)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.preset} {args.type} layer 0 MoE, {args.tokens} tokens, {dev}; weights {dict(types)}")
    print(f"  E {cfg.n_experts} top {cfg.n_experts_used} F {cfg.expert_ffn_dim} C {cfg.dim}; new vs old rel diff {err:.2e}")
    print(f"  old MoE.forward      {old * 1e3:9.3f} ms  {args.tokens / old:10.0f} tok/s")
    print(f"  new moe_prefill      {new * 1e3:9.3f} ms  {args.tokens / new:10.0f} tok/s  {old / new:6.1f}x")
    if replay is not None:
        print(f"  new, graph replay    {replay * 1e3:9.3f} ms  {args.tokens / replay:10.0f} tok/s  {old / replay:6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
