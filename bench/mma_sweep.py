"""The config space bench/mma_products.py sweeps for kernels/triton_mma.py (CONFIGS entries), and its
ahead-of-time compilation in parallel processes: Triton compiles one kernel variant per (type, BM,
BN, warps, stages, TRANS), seconds each, and the timing process then finds every variant in
Triton's disk cache (~/.triton/cache). The processes launch each variant once on small inputs of
the same specialisation as the 8B shapes (every size a multiple of 16, whole tiles, int64
accumulator with the residual, bf16 rounding); K's programs (the last entry, programs per SM) is a
runtime value: no variant of its own.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import gguf
import torch

Q = gguf.GGMLQuantizationType
# (BM x rows, BN weight rows) tiles; 8 warps only for the larger ones; stages 1 (no software
# pipelining: occupancy hides the loads), 2, 3; both MMA orientations; ptxas's register count or at
# most 128 (two 8-warp or four 4-warp programs an SM)
TILES = [(16, 64), (16, 128), (32, 64), (32, 128), (64, 32), (64, 64), (64, 128)]
STAGES = (1, 2, 3)
REGS = (0, 128)
PER_SM = 2  # the first pass's programs per SM; the best variants then try PER_SM_MORE
PER_SM_MORE = (0, 1, 4, 8)
SMALL = (256, 512)  # (N, K) of the compile runs


def configs(rows: int, full: bool = True) -> list[tuple[int, int, int, int, int, int]]:
    """The first pass's configs for a bucket of `rows` (tiles of at most `rows` x rows: larger BM would
    be cut to the bucket, a variant already in the list); full=False: 4 warps, 2 stages, ptxas's
    registers only."""
    out = []
    for bm, bn in TILES:
        if bm > rows:
            continue
        for warps in (4, 8) if full and bm * bn >= 4096 else (4,):
            for stages in STAGES if full else (2,):
                for regs in REGS if full else (0,):
                    out += [(bm, bn, warps, stages, trans, regs, PER_SM) for trans in (0, 1)]
    return out


def likely_first(config) -> tuple:
    """Sort key: the likelier winners compile first, should the compile budget run out (transposed,
    2 stages, then 1, then 3; fewer warps; ptxas's registers)."""
    return -config[4], (2, 1, 3).index(config[3]) if config[3] in (1, 2, 3) else 3, config[2], config[5]


def variant(tname: str, config) -> tuple:
    """The compiled kernel a config runs (all but its programs per SM)."""
    return (tname, *config[:6])


def random_weight(qtype, n: int, k: int, device: str = "cuda"):
    """A block-major QWeight of random bytes in the type's fields (fp16 scales kept small and finite):
    speed does not depend on the values."""
    from localllm.kernels.qweight import QWeight
    from localllm.quantize.formats import FORMATS

    fmt = FORMATS[qtype]
    raw = torch.randint(0, 256, (n, k // fmt.block * fmt.nbytes), dtype=torch.uint8, device=device)
    w = QWeight.from_raw(raw, qtype)
    for p in w.parts.values():
        if p.dtype == torch.float16:
            p.copy_(torch.rand_like(p, dtype=torch.float32).mul_(1e-3).half())
    return w.to_blocks()


@functools.cache
def _small_weight(tname: str, device: str):
    return random_weight(Q[tname], *SMALL, device)


def _compile(tname: str, rows: int, config, device: str) -> str | None:
    """Launch config once on small inputs (compiles it into the disk cache) -> None, or the error.
    (device "cpu": the plumbing under TRITON_INTERPRET=1, nothing compiled.)"""
    from localllm.kernels import triton_q8
    from localllm.kernels.triton_epilogue import to_fixed

    n, k = SMALL
    xa = (torch.randint(-127, 128, (rows, k), dtype=torch.int8, device=device),
          torch.rand(rows, k // 32, device=device),
          torch.randint(-2000, 2000, (rows, k // 16), dtype=torch.int32, device=device))
    acc = to_fixed(torch.zeros(rows, n, device=device))
    try:
        triton_q8.gemv_q8(xa, _small_weight(tname, device), residual=acc, inplace=True, split=None, mma=config)
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # a variant that does not compile or launch (resources): reported, skipped
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def precompile(jobs: list[tuple[str, int, tuple]], workers: int, budget: float,
               device: str = "cuda") -> dict[tuple, str]:
    """Compile every job's variant in `workers` processes within `budget` seconds -> {variant: why it
    is unusable} (compile errors, and variants left when the budget ran out)."""
    todo = {}
    for tname, rows, config in jobs:
        todo.setdefault(variant(tname, config), (tname, rows, config))
    t0 = time.perf_counter()
    bad = {}
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {ex.submit(_compile, *job, device): key for key, job in todo.items()}
    pending = set(futures)
    while pending and time.perf_counter() - t0 < budget:
        done, pending = wait(pending, timeout=max(0.0, budget - (time.perf_counter() - t0)),
                             return_when=FIRST_COMPLETED)
        for f in done:
            try:
                err = f.result()
            except Exception as e:  # a crashed worker process
                err = f"worker: {type(e).__name__}"
            if err:
                bad[futures[f]] = err
    for f in pending:
        bad[futures[f]] = f"not compiled within the {budget:.0f} s budget"
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # our own workers, some maybe still compiling: stop them
        p.terminate()
    print(f"compiled {len(todo) - len(bad)} of {len(todo)} kernel variants in {time.perf_counter() - t0:.0f} s "
          f"({workers} processes)", flush=True)
    return bad
