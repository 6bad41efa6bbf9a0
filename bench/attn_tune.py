"""Decode attention variants on the GPU: µs per call (CUDA graph over 32 layers' caches) for the
per-head and the GQA-group kernels at several chunk sizes, and their error against fp32 SDPA.

    python bench/attn_tune.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from localllm.kernels import triton_attention

sys.path.insert(0, "bench")
from q8_tune import graph_time  # noqa: E402


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    print("| shape | pos | variant | µs per layer | rel err vs fp32 SDPA |\n| --- | ---: | --- | ---: | ---: |")
    for h, hkv, d in ((32, 8, 128), (32, 8, 64)):
        for pos in (639, 4095):
            s = pos + 2
            layers = [(torch.randn(hkv, s, d, device="cuda").bfloat16(), torch.randn(hkv, s, d, device="cuda").bfloat16())
                      for _ in range(32)]
            q = torch.randn(h, d, device="cuda")
            p = torch.tensor([pos], dtype=torch.int32, device="cuda")
            kc, vc = layers[0]
            ref = F.scaled_dot_product_attention(q[None, :, None], kc[None, :, :pos + 1].float(),
                                                 vc[None, :, :pos + 1].float(), enable_gqa=True).reshape(1, -1)
            for gqa in (False, True):
                for chunk in (16, 32, 64, 128):
                    out = triton_attention.decode_attention(q, kc, vc, p, hkv, chunk=chunk, gqa=gqa)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = graph_time(lambda: [triton_attention.decode_attention(q, k, v, p, hkv, chunk=chunk, gqa=gqa)
                                             for k, v in layers]) * 1000 / 32
                    print(f"| H{h} Hkv{hkv} D{d} | {pos} | {'gqa' if gqa else 'per head'} chunk {chunk} | {us:.1f} "
                          f"| {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
