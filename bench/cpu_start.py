"""Start to first generated token on the CPU, and the memory it takes.

    python bench/cpu_start.py [MODEL] [--prompt TEXT] [--ctx 4096]

Prints the seconds spent importing (torch, localllm), loading the model (open, repack, tokenizer)
and producing the first token of a greedy completion, and the process's resident memory (VmRSS)
after the imports and after the first token, beside the file's size and the KV cache's bytes.
Run it twice: the first run of a file also parses its metadata and caches it (localllm/gguf_cache.py),
and the first run on a machine builds the C++ kernels.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402

import torch  # noqa: E402

from localllm.generate import generate  # noqa: E402
from localllm.runner import context_size, encode_prompt, open_model  # noqa: E402
from localllm.cache import make_cache  # noqa: E402
from localllm.sampling import Sampler  # noqa: E402
from localllm.settings import SamplingSettings  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--prompt", default="Once upon a time, there was a little")
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    from localllm.kernels.cpu import load_extension
    from localllm.settings import DEFAULT_CPU

    load_extension(DEFAULT_CPU.cache_dir)  # the extension's import (or build) counts as an import
    t_import, rss0 = time.perf_counter(), rss_bytes()
    lm = open_model(args.model, "cpu")
    t_load = time.perf_counter()
    cache = make_cache(lm.config, context_size(lm, args.ctx), dtype=lm.model.token_embd.weight.dtype)
    ids = encode_prompt(lm, args.prompt)
    first = next(generate(lm.model, cache, ids, Sampler(SamplingSettings(temperature=0)), 1))
    t_first = time.perf_counter()
    rss1 = rss_bytes()
    kv = cache.k.numel() * cache.k.element_size() * 2
    print(f"model {lm.path.name}, {len(ids)}-token prompt, first token {lm.tokenizer.decode([first])!r}")
    print(f"imports {t_import - T0:.2f} s | load {t_load - t_import:.2f} s | first token {t_first - t_load:.2f} s"
          f" | load to first token {t_first - t_import:.2f} s | total {t_first - T0:.2f} s")
    print(f"RSS after imports {rss0 / 2**20:.0f} MiB, after the first token {rss1 / 2**20:.0f} MiB: "
          f"+{(rss1 - rss0) / 2**20:.0f} MiB; file {lm.file_bytes / 2**20:.0f} MiB, KV cache "
          f"{kv / 2**20:.0f} MiB allocated ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
