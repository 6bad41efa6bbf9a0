"""Speculative decoding's verify pass on CUDA against plain decode steps, per weight type: are its rows
the plain steps' logits bit for bit, and what does it cost (issue 7).

    python bench/verify_rows.py --preset llama-3.2-1b --types bf16,Q8_0,Q4_0,Q4_K_M --tokens 6

For each type, a synthetic model (random weights) holds --depth random ids; then (a) one verify pass of
--tokens ids (cuda_decode.GraphDecoder for that many tokens, a replayed graph) and (b) the same ids
through that many plain decode steps from the same cache length. Printed: whether the logits are
identical, their largest difference, whether the greedy ids agree, and the pass's time over a plain
step's (medians of --reps, each ending in a host sync as speculative decoding's rounds do). Split-K
products add fp32 partial sums atomically in any order, so both (a) and (b) may move in the last bit
from run to run; the same row computed twice by (b) shows that floor ("plain vs plain").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.cache import make_cache
from localllm.cuda_decode import decoder_for
from localllm.generate import prefill
from localllm.registry import shape_preset
from localllm.commands.spec_bench import random_prompt
from localllm.synthetic import synthetic_model


def timed(fn, reps: int) -> float:
    """Median ms of fn() followed by a host sync, after two warm-up calls."""
    out = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


@torch.inference_mode()
def one_type(preset: str, wtype: str, depth: int, tokens: int, reps: int) -> str:
    cfg = shape_preset(preset)
    model, _ = synthetic_model(cfg, wtype, torch.device("cuda"), torch.bfloat16, seed=0)
    cache = make_cache(cfg, depth + tokens + 1, dtype=torch.bfloat16, device=torch.device("cuda"))
    prefill(model, cache, random_prompt(cfg.vocab_size, depth, 0), 0)
    ids = torch.tensor(random_prompt(cfg.vocab_size, tokens, 1), device="cuda")
    many, one = decoder_for(model, cache, tokens), decoder_for(model, cache)

    def plain() -> torch.Tensor:
        cache.length = depth
        return torch.stack([one.step(ids[i]).clone() for i in range(tokens)])

    def verify() -> torch.Tensor:
        cache.length = depth
        return many.step(ids).clone()

    a, b, b2 = verify(), plain(), plain()
    same = torch.equal(a, b)
    diff = (a - b).abs().max().item()
    floor = (b - b2).abs().max().item()
    argmax = bool((a.argmax(-1) == b.argmax(-1)).all())
    step_ms = timed(lambda: (setattr(cache, "length", depth), one.step(ids[0]).argmax().item()), reps)
    pass_ms = timed(lambda: (setattr(cache, "length", depth), many.step(ids).argmax(-1).tolist()), reps)
    return (f"| {preset} {wtype} | {tokens} | {'yes' if same else 'no'} | {diff:.2e} | {floor:.2e} | "
            f"{'yes' if argmax else 'NO'} | {step_ms:.3f} | {pass_ms:.3f} | {pass_ms / step_ms:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", help="models.toml shape preset")
    ap.add_argument("--types", default="bf16,Q8_0,Q4_0,Q4_K_M", help="comma-separated weight types")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=6, help="ids in the verify pass (K + 1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dense-config", default=None,
                    help="kernels/triton_dense.py tile config to try, e.g. 64,128,3,4 (default: its CONFIG)")
    ap.add_argument("--split-target", type=int, default=None,
                    help="kernels/triton_epilogue.SPLIT_PROGRAMS_PER_SM to try (auto_split's programs per SM)")
    args = ap.parse_args()
    if args.split_target:
        from localllm.kernels import triton_epilogue

        triton_epilogue.SPLIT_PROGRAMS_PER_SM = args.split_target
        print(f"split target {args.split_target} programs per SM")
    if args.dense_config:
        from localllm.kernels import triton_dense

        triton_dense.CONFIG = tuple(int(v) for v in args.dense_config.split(","))
        print(f"dense config {triton_dense.CONFIG}")
    print(f"device {torch.cuda.get_device_name()}; depth {args.depth}")
    print("| model | ids | identical | max diff | plain vs plain | same argmax | plain step ms | verify ms | ratio |\n"
          "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for wtype in args.types.split(","):
        print(one_type(args.preset, wtype, args.depth, args.tokens, args.reps), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
