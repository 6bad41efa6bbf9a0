"""CUDA correctness and kernel speed, run on the GPU machine:

    python bench/cuda_check.py [--out DIR]

1. each kernel's relative error at real (Llama 3.1 8B) shapes against its torch reference:
   dequantize (fp32 and bf16 values must be equal to quantize.dequantize_torch's), the fused
   dequantize+matvec (vs the fp64 product of the reference values), its fused RMSNorm / silu*mul /
   residual forms (vs model.py's module ops in bf16), rope_store and decode attention (vs SDPA);
2. logits of synthetic models on CUDA (bf16, quantized weights kept quantized, CUDA-graph decode)
   against the same weights on the CPU in fp32 (prefill and 6 decode steps);
   greedy: graph steps ending in greedy_ids (localllm bench's form) against plain graph steps and
   torch's argmax, ids and logits bit for bit;
3. a sweep of the matvec kernels' tile configs at 8B shapes (GB/s of weight bytes; K split as in
   decode), cuBLAS for bf16;
   the best configs go to DIR/gemv_configs.json (to copy into triton_gemv.CONFIGS).
"""

from __future__ import annotations

import argparse
import json
import traceback

import gguf
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from localllm.kernels import triton_attention, triton_gemv
from localllm.kernels.qweight import KERNEL_TYPES, QWeight
from localllm.quantize import dequantize_torch, quantize_tensor

Q = gguf.GGMLQuantizationType
DEV = "cuda"


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_qweight(n: int, k: int, qtype: Q, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.from_numpy(quantize_tensor(torch.randn(n, k, device=DEV, generator=g), qtype)).to(DEV)
    return raw, QWeight.from_raw(raw, qtype)


def check_kernels() -> list[str]:
    out = []
    for qtype in sorted(KERNEL_TYPES, key=lambda t: t.name):
        for n, k in ((1024, 4096), (512, 14336)):
            raw, qw = random_qweight(n, k, qtype)
            ref = dequantize_torch(raw, qtype)
            eq32 = torch.equal(triton_gemv.dequantize(qw, torch.float32), ref)
            eq16 = torch.equal(triton_gemv.dequantize(qw, torch.bfloat16), ref.bfloat16())
            x = torch.randn(1, k, device=DEV)
            e_gemv = rel(triton_gemv.gemv(x, qw, act_dtype=torch.float32), x.double() @ ref.double().T)
            xb, res = x.bfloat16(), torch.randn(1, n, device=DEV)
            nw = (1 + 0.1 * torch.randn(k, device=DEV)).bfloat16()
            xf = x.float()
            h = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
            want = res + F.linear(h, ref.bfloat16())
            e_norm = rel(triton_gemv.gemv(x, qw, residual=res, norm_weight=nw, eps=1e-5), want)
            y = F.linear(xb, ref.bfloat16())  # rows interleaved (gate, up)
            e_glu = rel(triton_gemv.gemv(xb, qw, glu=True), F.silu(y[:, 0::2]) * y[:, 1::2])
            e_bf16 = rel(triton_gemv.gemv(xb, qw), F.linear(xb, ref.bfloat16()))
            out.append(f"| {qtype.name} | {n}x{k} | {eq32} | {eq16} | {e_gemv:.1e} | {e_bf16:.1e} | {e_norm:.1e} | {e_glu:.1e} |")
    w = torch.randn(4096, 4096, device=DEV).bfloat16()
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    out.append(f"| bf16 dense | 4096x4096 | - | - | - | {rel(triton_gemv.gemv(x, w), F.linear(x, w)):.1e} | - | - |")
    return ["| type | shape | dequant fp32 equal | dequant bf16 equal | gemv fp32 vs fp64 | gemv bf16 vs cuBLAS(ref) | +norm+residual | glu epilogue |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"] + out


def check_attention() -> list[str]:
    out = []
    for H, HKV, D, S, pos in ((32, 8, 128, 1024, 639), (32, 8, 64, 1024, 639)):
        qkv = torch.randn(1, (H + 2 * HKV) * D, device=DEV).bfloat16()
        kc = torch.randn(HKV, S, D, device=DEV).bfloat16()
        vc = torch.randn(HKV, S, D, device=DEV).bfloat16()
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
        p = torch.tensor([pos], dtype=torch.int32, device=DEV)
        q = triton_attention.rope_store(qkv, kc, vc, p, inv, H, HKV, D)
        ang = pos * inv
        from localllm.model import rope_rotate

        qr, kr, _ = qkv.view(H + 2 * HKV, D).split([H, HKV, HKV])
        e_q = rel(q, rope_rotate(qr[None, :, None], ang.cos(), ang.sin())[0, :, 0])
        e_k = rel(kc[:, pos], rope_rotate(kr[None, :, None], ang.cos(), ang.sin())[0, :, 0])
        att = triton_attention.decode_attention(q, kc, vc, p, HKV)
        ref = F.scaled_dot_product_attention(q[None, :, None].float(), kc[None, :, :pos + 1].float(),
                                             vc[None, :, :pos + 1].float(), enable_gqa=True).reshape(1, -1)
        out.append(f"| H{H} Hkv{HKV} D{D} pos{pos} | rope q {e_q:.1e}, k {e_k:.1e} | attention vs fp32 SDPA {rel(att, ref):.1e} |")
    return out


def check_logits() -> list[str]:
    from localllm.cache import make_cache
    from localllm.generate import decode_one, prefill
    from localllm.load import build_model
    from localllm.registry import shape_preset
    from localllm.synthetic import synthetic_state
    from localllm.weights import QuantizedTensor

    out = ["| shape | type | prefill logits rel err | prefill graph replay equal | decode steps rel err (max) | top-1 agree |",
           "| --- | --- | --- | --- | --- | --- |"]
    for preset in ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"):
        cfg = shape_preset(preset)
        for wtype in ("bf16", "Q8_0", "Q4_K_M", "Q4_0"):
            state, _ = synthetic_state(cfg, wtype, DEV, seed=3)
            # The same values on both sides: dense tensors rounded to bf16, quantized blocks as they are.
            cpu_state = {k: QuantizedTensor(v.qtype, v.data.cpu()) if isinstance(v, QuantizedTensor)
                         else v.float().cpu() if k == "rope_freqs" else v.bfloat16().float().cpu()
                         for k, v in state.items()}
            state = {k: v if isinstance(v, QuantizedTensor) else cpu_state[k] for k, v in state.items()}
            gpu = build_model(cfg, state, DEV, torch.bfloat16)
            cpu = build_model(cfg, cpu_state, "cpu", torch.float32)
            ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
            cg, cc = make_cache(cfg, 32, dtype=torch.bfloat16, device=DEV), make_cache(cfg, 32)
            lg, lc = prefill(gpu, cg, ids[:14]), prefill(cpu, cc, ids[:14])
            replays = [prefill(gpu, cg, ids[:14]) for _ in range(3)]  # 2nd: captured, 3rd: replayed
            same = all(torch.equal(r, lg) for r in replays)
            e_pre, errs, agree = rel(lg.float().cpu(), lc), [], 0
            for t in ids[14:]:
                lg = decode_one(gpu, cg, torch.tensor(t, device=DEV)).float().cpu()
                lc = decode_one(cpu, cc, torch.tensor(t))
                errs.append(rel(lg, lc))
                agree += int(lg.argmax() == lc.argmax())
            out.append(f"| {preset} | {wtype} | {e_pre:.1e} | {same} | {max(errs):.1e} | {agree}/{len(errs)} |")
            del gpu, cpu, state, cpu_state
            torch.cuda.empty_cache()
    return out


def check_greedy(steps: int = 24) -> list[str]:
    """GraphDecoder(greedy=True).step_greedy (ids fed back uncopied) against a plain GraphDecoder fed
    torch's argmax of its logits, on two caches holding the same prompt (llama-3.2-1b shape); and
    generate() with a temperature-0 sampler (which steps through greedy_rows) on a third."""
    from localllm.cache import make_cache
    from localllm.cuda_decode import GraphDecoder
    from localllm.generate import generate, prefill
    from localllm.sampling import Sampler
    from localllm.settings import SamplingSettings
    from localllm.registry import shape_preset
    from localllm.commands.spec_bench import random_prompt
    from localllm.synthetic import synthetic_model

    out = ["| shape | type | steps | ids equal | logits equal | generate()'s ids equal |",
           "| --- | --- | ---: | --- | --- | --- |"]
    cfg = shape_preset("llama-3.2-1b")
    for wtype in ("bf16", "Q4_0", "Q4_K_M"):
        model, _ = synthetic_model(cfg, wtype, torch.device(DEV), torch.bfloat16, seed=4)
        caches = [make_cache(cfg, 64 + steps, dtype=torch.bfloat16, device=torch.device(DEV)) for _ in range(2)]
        prompt = random_prompt(cfg.vocab_size, 64, 5)
        first = [prefill(model, c, prompt, 0).argmax(-1).view(1) for c in caches]
        greedy, plain = GraphDecoder(model, caches[0], greedy=True), GraphDecoder(model, caches[1])
        ids, want, same_ids, same_logits = first[0], first[1], True, True
        plain_ids = [int(want)]
        for _ in range(steps):
            ids = greedy.step_greedy(ids)
            logits = plain.step(want)
            want = logits.argmax().view(1)
            plain_ids.append(int(want))
            same_ids &= torch.equal(ids, want)
            same_logits &= torch.equal(greedy.logits[0], logits)
        cache = make_cache(cfg, 64 + steps + 1, dtype=torch.bfloat16, device=torch.device(DEV))
        sampler = Sampler(SamplingSettings(temperature=0), DEV)
        gen = list(generate(model, cache, prompt, sampler, steps + 1))
        out.append(f"| llama-3.2-1b | {wtype} | {steps} | {same_ids} | {same_logits} | {gen == plain_ids} |")
        del model, caches, cache, greedy, plain
        torch.cuda.empty_cache()
    return out


SWEEP = [(2, 16, 4), (4, 16, 4), (2, 32, 4), (4, 32, 4), (8, 32, 4), (4, 64, 4), (2, 64, 4), (4, 32, 2),
         (8, 64, 8), (8, 16, 2), (16, 32, 8), (2, 32, 2)]


def sweep(cfg_out: dict) -> list[str]:
    out = ["| format | shape | best config (BN, G, warps) | GB/s | all configs GB/s |", "| --- | --- | --- | --- | --- |"]
    cases = [("bf16", None), ("Q8_0", Q.Q8_0), ("Q4_0", Q.Q4_0), ("Q4_K", Q.Q4_K), ("Q6_K", Q.Q6_K)]
    for name, qtype in cases:
        totals = {}
        for n, k in ((28672, 4096), (4096, 14336)):
            if qtype is None:
                w = torch.randn(n, k, device=DEV).bfloat16()
                nbytes = w.numel() * 2
                x = torch.randn(1, k, device=DEV).bfloat16()
                ms = do_bench(lambda: F.linear(x, w), warmup=10, rep=40)
                out.append(f"| bf16 cuBLAS | {n}x{k} | - | {nbytes / ms / 1e6:.0f} | |")
            else:
                _, w = random_qweight(min(n, 2048), k, qtype)
                w = QWeight.cat([w] * (n // w.shape[0]))
                nbytes = w.nbytes
                x = torch.randn(1, k, device=DEV).bfloat16()
            res = {}
            for c in SWEEP:
                try:
                    ms = do_bench(lambda: triton_gemv.gemv(x, w, config=c, split=None), warmup=10, rep=40)
                    res[c] = nbytes / ms / 1e6
                except Exception:  # a config that does not compile (registers, shared memory)
                    res[c] = 0.0
                totals[c] = totals.get(c, 0.0) + res[c]
            best = max(res, key=res.get)
            out.append(f"| {name} | {n}x{k} | {best} | {res[best]:.0f} | {', '.join(f'{v:.0f}' for v in res.values())} |")
        fmt = triton_gemv.DENSE if qtype is None else triton_gemv.FMT_OF[qtype]
        cfg_out[fmt] = max(totals, key=totals.get)
        if qtype == Q.Q4_K:
            cfg_out[triton_gemv.Q5_K] = cfg_out[fmt]
        if qtype == Q.Q4_0:
            cfg_out[triton_gemv.Q4_1] = cfg_out[fmt]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: kernels,attention,logits,greedy,sweep")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    skip = set(args.skip.split(","))
    cfg_out: dict = {}
    for name, fn in (("kernels", check_kernels), ("attention", check_attention), ("logits", check_logits),
                     ("greedy", check_greedy), ("sweep", lambda: sweep(cfg_out))):
        if name in skip:
            continue
        print(f"\n## {name}\n", flush=True)
        try:
            print("\n".join(fn()), flush=True)
        except Exception:
            traceback.print_exc()
    if cfg_out:
        with open(f"{args.out}/gemv_configs.json", "w") as f:
            json.dump({str(k): list(v) for k, v in cfg_out.items()}, f)
        print(f"\nconfigs: {cfg_out}")


if __name__ == "__main__":
    main()
