"""Device facts for benchmarks: the roofline (copy bandwidth, matmul rate) measured on the device,
its name, and freeing its memory between models. Timing is device-specific (CUDA events), so it
lives with the backends."""

from __future__ import annotations

import gc
import statistics
import time

import torch


def op_seconds(fn, device: torch.device, reps: int) -> float:
    """Seconds one fn() takes on device. CUDA: the best of 5 runs of `reps` back-to-back calls timed by
    CUDA events (a host sync around each call would add its own latency to a sub-millisecond copy:
    docs/PERFORMANCE.md); elsewhere the median of reps calls, each synced."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / reps)
        return best
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, mib: int = 1024, reps: int = 10) -> float:
    """Bytes read + written per second by a large device-local copy (op_seconds)."""
    mib = mib if device.type == "cuda" else 256
    a = torch.randn(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / op_seconds(lambda: b.copy_(a), device, reps)


def matmul_rate(device: torch.device, reps: int = 5) -> float:
    """FLOP/s of a large random matmul: bf16 8192^3 on CUDA, fp32 1024^3 elsewhere (op_seconds)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / op_seconds(lambda: torch.mm(a, b), device, reps)


def measure_roofline(device: torch.device) -> dict:
    return {"bandwidth": copy_bandwidth(device), "flops": matmul_rate(device)}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def free_memory(device: str | torch.device) -> None:
    """Free what the previous model held before the next one loads."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
