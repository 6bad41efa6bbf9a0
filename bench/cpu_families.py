"""What the dense families' layer fields cost the CPU's one-call decoder: decode speed of one synthetic
(random-weight) shape as the Llama layer and with Gemma 2 / Gemma 3 / Phi-3 / SmolLM3 fields.

    python bench/cpu_families.py [--shape smollm2-135m] [-w Q4_0] [-t THREADS] [-n 128] [-r 3] [--depth 0]
                                 [--cpu-time]

Timed as bench/vs_llamacpp.py times tgN: N single-token steps (each feeding the previous argmax)
from a cache holding --depth prompt tokens, after one warm-up; mean ± sd of tokens/s over the
repetitions, which run the variants in turn (round-robin) so a busy machine slows them alike. Every
variant keeps the shape's sizes; only the layer fields differ (their values: Gemma 2's and Gemma 3's,
sliding windows of 4096, so at these depths the window hides no keys and every variant attends to
the same rows). --cpu-time (with -t 1) times the process's CPU seconds instead of wall time: on a
machine other jobs share, the work done, not the time slices granted. "gemma2 eager" is the same Gemma 2 model on the torch forward (CpuEagerRuntime: C++
products, Python between them), the path these configs took before the C++ decoder covered them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from localllm.backends.cpu import CpuEagerRuntime, CpuRuntime
from localllm.config import ModelConfig
from localllm.kernels.cpu import physical_cores
from localllm.load import build_model
from localllm.registry import shape_preset
from localllm.runtime import Runtime
from localllm.synthetic import quantize_embedding, synthetic_state


def variants(cfg: ModelConfig) -> dict[str, tuple[ModelConfig, type[Runtime]]]:
    L, D = cfg.n_layers, cfg.head_dim
    gemma = dict(embed_scale=cfg.dim**0.5, activation="gelu_tanh", post_norms=True, attn_scale=D**-0.5,
                 sliding_window=4096)
    gemma2 = replace(cfg, **gemma, attn_softcap=50.0, final_softcap=30.0,
                     sliding_layers=tuple(i % 2 == 0 for i in range(L)))
    gemma3 = replace(cfg, **gemma, qk_norm=True, rope_theta_local=10000.0,
                     sliding_layers=tuple(i % 6 != 5 for i in range(L)))
    phi3 = replace(cfg, rotary_dim=3 * D // 4, rope_attn_factor=1.19)
    smollm3 = replace(cfg, rope_layers=tuple(i % 4 != 3 for i in range(L)))
    return {"llama": (cfg, CpuRuntime), "gemma2": (gemma2, CpuRuntime), "gemma3": (gemma3, CpuRuntime),
            "phi3": (phi3, CpuRuntime), "smollm3": (smollm3, CpuRuntime), "gemma2 eager": (gemma2, CpuEagerRuntime)}


def build(cfg: ModelConfig, backend: type[Runtime], wtype: str) -> Runtime:
    """The same random weights for every variant (seed 0), the embedding quantized as a GGUF file's."""
    state = quantize_embedding(synthetic_state(cfg, wtype, "cpu", seed=0)[0], wtype)
    return build_model(cfg, state, "cpu", torch.float32, backend=backend)


@torch.inference_mode()
def tg(rt: Runtime, n: int, depth: int, clock=time.perf_counter) -> float:
    """tokens/s of n decode steps after a depth-token prompt."""
    cache = rt.new_cache(depth + n + 1)
    prompt = torch.arange(100, 100 + depth + 1).remainder(rt.cfg.vocab_size)
    if depth:
        rt.prefill(cache, [prompt[:depth].tolist()], 0)
    token = prompt[depth:]
    t = clock()
    for _ in range(n):
        token = rt.decode(cache, token).argmax(-1)
    return n / (clock() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a models.toml shape preset")
    ap.add_argument("-w", "--weights", default="Q4_0", help="GGUF block type of every linear weight")
    ap.add_argument("-t", "--threads", type=int, default=physical_cores())
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=0, help="prompt tokens in the cache before the steps")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU seconds of the process (use with -t 1)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    runtimes = {name: build(cfg, backend, args.weights) for name, (cfg, backend) in variants(shape_preset(args.shape)).items()}
    for name, rt in runtimes.items():
        assert isinstance(rt, CpuEagerRuntime) or rt.cpp_decoder(rt.new_cache(8)) is not None, name
        tg(rt, 4, args.depth)  # warm-up
    speeds: dict[str, list[float]] = {name: [] for name in runtimes}
    for _ in range(args.reps):
        for name, rt in runtimes.items():
            speeds[name].append(tg(rt, args.gen, args.depth, clock))
    base = statistics.mean(speeds["llama"])
    print(f"{args.shape} {args.weights}, threads {args.threads}, tg{args.gen} at depth {args.depth}; tokens per "
          f"{'CPU' if args.cpu_time else 'wall'} second, mean ± sd over {args.reps} runs")
    print("| layer | tokens/s | / llama |\n| --- | ---: | ---: |")
    for name, s in speeds.items():
        print(f"| {name} | {statistics.mean(s):.1f} ± {statistics.pstdev(s):.1f} | {statistics.mean(s) / base:.2f} |")


if __name__ == "__main__":
    main()
