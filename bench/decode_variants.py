"""Decode speed of GraphDecoder variants against the default, same model and card.

    python bench/decode_variants.py --preset llama-3.1-8b --types Q8_0,Q4_0,Q4_K_M --variant "split=16"

A variant is `;`-separated settings: `split=N` (split K aiming at N programs an SM:
triton_epilogue.SPLIT_PROGRAMS_PER_SM), `splitcap=N` (at most N parts: triton_epilogue.SPLIT_MAX),
`qwarps=N` (warps of the one-program activation quantizer), `chunk=N` (cache rows an attention
program takes, 16..64: triton_attention.CHUNK), `preload=0|1|2` or `preload.q6_k=N`
(integer-dot products, or one type's, load their first N steps' weights before their PDL wait:
triton_q8.PRELOAD), `q4_k=BN,BK,W` (a type's integer-dot tile config: triton_q8.CONFIGS),
`nochain` (separate q, k, v products wait for each other: GraphDecoder(chain=False)), `ropekernel`
(rope_store before the attention instead of inside it: GraphDecoder(fuse_rope=False)),
`torchargmax` (the next id by torch's argmax after each replay instead of the graph's own greedy_ids,
GraphDecoder(greedy=True), as localllm bench steps). Printed per type and variant: decode tokens/s
after a --depth prompt (median of --reps runs of --steps greedy steps, one replayed graph a step),
the share of the copy bandwidth measured here, and how the first step's logits compare with the
default's (split K's parts truncate to fixed point apart, so another split moves the last bits).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import gguf
import torch

from localllm.kernels import triton_attention, triton_epilogue, triton_q8
from localllm.commands.bench import copy_bandwidth, free_memory, kv_bytes_per_token, weight_bytes_per_token
from localllm.cache import make_cache
from localllm.cuda_decode import GraphDecoder
from localllm.generate import prefill
from localllm.registry import shape_preset
from localllm.commands.spec_bench import random_prompt
from localllm.synthetic import synthetic_model

# module constants the kernels' launchers read as the graph is captured
Q = gguf.GGMLQuantizationType
CONSTANTS = {"split": (triton_epilogue, "SPLIT_PROGRAMS_PER_SM"), "splitcap": (triton_epilogue, "SPLIT_MAX"),
             "qwarps": (triton_q8, "WHOLE_ROW_WARPS"), "chunk": (triton_attention, "CHUNK")}


def variant(text: str) -> tuple[dict, list]:
    """-> (GraphDecoder keyword arguments, [(module or dict, name or key, value)])."""
    kwargs, consts = {}, []
    for part in filter(None, text.split(";")):
        key, _, value = part.partition("=")
        name, _, qtype = key.partition(".")
        if key in CONSTANTS:
            consts.append((*CONSTANTS[key], int(value)))
        elif key.upper() in Q.__members__:  # a type's integer-dot tile config, e.g. q4_k=32,2,1
            consts.append((triton_q8.CONFIGS, Q[key.upper()], tuple(int(v) for v in value.split(","))))
        elif name == "preload" and (not qtype or qtype.upper() in Q.__members__):  # preload=N, preload.q6_k=N
            types = [Q[qtype.upper()]] if qtype else list(triton_q8.PRELOAD)
            if int(value) not in (0, 1, 2):
                raise SystemExit(f"preload takes 0, 1 or 2 steps, not {value}")
            consts += [(triton_q8.PRELOAD, t, int(value)) for t in types]
        elif key == "nochain":
            kwargs["chain"] = False
        elif key == "ropekernel":
            kwargs["fuse_rope"] = False
        elif key == "torchargmax":  # the next id by torch's argmax after the graph, not inside it
            kwargs["greedy"] = False
        else:
            raise SystemExit(f"unknown variant setting {part!r}")
    return kwargs, consts


@contextlib.contextmanager
def constants(consts: list):
    """Set (module, attribute, value) or (dict, key, value) for the block, then restore them."""
    def put(where, key, value):
        if isinstance(where, dict):
            where[key] = value
        else:
            setattr(where, key, value)

    kept = [(w, k, w[k] if isinstance(w, dict) else getattr(w, k)) for w, k, _ in consts]
    for w, k, v in consts:
        put(w, k, v)
    try:
        yield
    finally:
        for w, k, v in reversed(kept):
            put(w, k, v)


def gpu_state() -> str:
    """The card's SM clock (MHz), temperature (C) and power (W) now, by NVML ("" without pynvml)."""
    try:
        return f"{torch.cuda.clock_rate()} MHz {torch.cuda.temperature()} C {torch.cuda.power_draw() / 1000:.0f} W"
    except Exception:  # no pynvml
        return ""


def decode_rate(dec: GraphDecoder, cache, depth: int, steps: int, reps: int) -> tuple[float, torch.Tensor, str]:
    """-> (median tokens/s of `steps` greedy steps from depth, the logits of the first step, the
    card's gpu_state while the last run's steps were still queued)."""
    rates, first, state = [], None, ""
    for r in range(reps + 1):
        cache.length = depth
        tok = torch.zeros(1, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(steps):
            if dec.greedy:  # as localllm bench steps (generate.greedy_rows)
                tok = dec.step_greedy(tok)
                logits = dec.logits.view(-1)
            else:
                logits = dec.step(tok)
                tok = logits.argmax().view(1)
            if s == 0 and first is None:
                first = logits.clone()
        state = gpu_state()
        torch.cuda.synchronize()
        if r:
            rates.append(steps / (time.perf_counter() - t0))
    return statistics.median(rates), first, state


@torch.inference_mode()
def one_type(preset: str, wtype: str, plans: list[str], args, bw: float) -> None:
    cfg = shape_preset(preset)
    model, _ = synthetic_model(cfg, wtype, torch.device("cuda"), torch.bfloat16, seed=0)
    cache = make_cache(cfg, args.depth + args.steps + 1, dtype=torch.bfloat16, device=torch.device("cuda"))
    prefill(model, cache, random_prompt(cfg.vocab_size, args.depth, 0), 0)
    nbytes = weight_bytes_per_token(model) + kv_bytes_per_token(cache, args.depth + args.steps / 2)
    # A decode graph captured and stepped, then dropped: once a second decode graph has been captured,
    # the driver runs every decode graph's PDL overlap slower (8B Q4_0 470 against 487 tokens/s, H100,
    # driver 580, 2026-11-26). Without it the process's first decoder (the default) ran in the faster
    # state and every variant in the slower one.
    cache.length = args.depth
    GraphDecoder(model, cache).step(torch.zeros(1, dtype=torch.long, device="cuda"))
    free_memory("cuda")
    base = None
    for text in plans:
        kwargs, consts = variant(text)
        dec = GraphDecoder(model, cache, **{"greedy": True, **kwargs})
        with constants(consts):
            rate, logits, state = decode_rate(dec, cache, args.depth, args.steps, args.reps)
        base = logits if base is None else base
        same = "same bits" if torch.equal(logits, base) else \
            f"rel. diff {((logits - base).norm() / base.norm()).item():.1e}, top-1 {'=' if logits.argmax() == base.argmax() else '!='}"
        print(f"| {preset} {wtype} | {text or '(default)'} | {rate:.1f} | {nbytes * rate / bw:.1%} | {same} | {state} |",
              flush=True)
        del dec
        free_memory("cuda")
    del model, cache
    free_memory("cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--variant", action="append", default=None, help="a variant (repeat); the default comes first")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    plans = [""] + [v for v in args.variant or [] if v]
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| model | variant | tokens/s | of copy bandwidth | logits as the default's | card (SM clock, temperature, power) |")
    print("| --- | --- | ---: | ---: | --- | --- |")
    for wtype in args.types.split(","):
        one_type(args.preset, wtype, plans, args, bw)


if __name__ == "__main__":
    main()
