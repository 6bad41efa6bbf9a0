"""The tiled quantized products alone at one token (decode), one thread: ps a weight, streamed and hot.

    python bench/tile_products.py [--type Q6_K Q8_0 ...] [--matrices 60] [-r 7]

Random GGUF blocks of each type (every bit pattern; the fp16 d fields set to small finite values),
repacked into the CPU tiles as the runtime holds them (kernels/cpu.py pack_for_cpu), shaped as the
default model's products of that type: 576 x 1536 (the ffn_down width, K-quants' 256-value blocks) or
1536 x 576 (32-value types). "streamed": one pass over --matrices distinct matrices (more bytes than
any cache); "hot": the first matrix that many times (cache-resident in L3). Process CPU time, the
best of -r passes, through the extension's qmatmul (x of one row, torch threads 1), so it includes
a call's fixed cost (~15 us, quantizing x). No model file is read.
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from localllm.kernels.cpu import BlockQWeight, load_extension, pack_for_cpu, qlinear
from localllm.settings import DEFAULT_CPU

Q = gguf.GGMLQuantizationType
# values a block, bytes a block, byte offsets of its fp16 scale fields
BLOCKS = {
    "Q8_0": (32, 34, [0]), "Q4_0": (32, 18, [0]), "Q5_0": (32, 22, [0]), "Q5_1": (32, 24, [0, 2]),
    "Q4_K": (256, 144, [0, 2]), "Q5_K": (256, 176, [0, 2]), "Q6_K": (256, 210, [208]),
}


def tiled(ext, name: str, N: int, K: int, g: torch.Generator):
    values, nb, fp16_at = BLOCKS[name]
    raw = torch.randint(0, 256, (N, K // values * nb), generator=g, dtype=torch.uint8)
    for p in fp16_at:
        d = (torch.rand(N, K // values, generator=g) * 0.01).to(torch.float16)
        raw.view(N, -1, nb)[:, :, p:p + 2] = d.view(torch.uint8).view(N, -1, 2)
    return pack_for_cpu(BlockQWeight.from_blocks(raw, Q[name], torch.float32), ext)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", nargs="+", default=["Q6_K", "Q8_0"], choices=sorted(BLOCKS))
    ap.add_argument("--matrices", type=int, default=60)
    ap.add_argument("-r", "--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ext = load_extension(DEFAULT_CPU.cache_dir)
    g = torch.Generator().manual_seed(0)
    for name in args.type:
        N, K = (576, 1536) if BLOCKS[name][0] == 256 else (1536, 576)
        ws = [tiled(ext, name, N, K, g) for _ in range(args.matrices)]
        x = torch.randn(1, K, generator=g)
        for label, seq in (("streamed", ws), ("hot", ws[:1] * len(ws))):
            best = float("inf")
            for _ in range(args.reps):
                t = time.process_time()
                for w in seq:
                    qlinear(x, w)
                best = min(best, time.process_time() - t)
            weights, nbytes = len(seq) * N * K, len(seq) * ws[0].nbytes
            print(f"{name} {label}: {best / weights * 1e12:.1f} ps a weight, {nbytes / best / 1e9:.1f} GB/s of tiles "
                  f"({ws[0].nbytes * 8 / (N * K):.2f} bits a weight)")


if __name__ == "__main__":
    main()
