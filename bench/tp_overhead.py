"""The driver/worker protocol's per-step cost (localllm/tp_runtime.py, issue 23) on the CPU: 2 processes
(gloo), a runtime whose steps do nothing, so what is timed is the message alone: a decode step's call
(one token tensor + a KV cache handle with its length) through tp_runtime.Driver, against the same call
on the bare runtime.

    python bench/tp_overhead.py [STEPS]
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Idle:
    """A runtime whose steps cost nothing: new_cache gives a KVCache, decode returns its input."""
    device = torch.device("cpu")

    def new_cache(self, capacity: int, batch: int = 1):
        from localllm.cache import KVCache

        return KVCache(torch.zeros(1), torch.zeros(1))

    def decode(self, cache, tokens):
        return tokens


def rank_main(rank: int, port: int, steps: int) -> None:
    from localllm.parallel import TensorParallel
    from localllm.tp_runtime import Driver, follow

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TensorParallel(rank, 2)
    if rank:
        follow(Idle(), tp)
        return
    bare, tok = Idle(), torch.tensor([7])
    with Driver(Idle(), tp) as driver:
        for rt, name in ((bare, "bare runtime"), (driver, "through Driver")):
            cache = rt.new_cache(8)
            for _ in range(100):  # warm-up
                rt.decode(cache, tok)
            t0 = time.perf_counter()
            for i in range(steps):
                cache.length = i
                rt.decode(cache, tok)
            dt = (time.perf_counter() - t0) / steps
            print(f"{name}: {dt * 1e6:.1f} us per decode call")
        t0 = time.perf_counter()  # the driver's own CPU work per message: wire form + pickle
        for i in range(steps):
            data = pickle.dumps(("decode", driver.wire((cache, tok)), {}, [], None), protocol=pickle.HIGHEST_PROTOCOL)
        dt = (time.perf_counter() - t0) / steps
        print(f"message encoding alone: {dt * 1e6:.1f} us, {len(data)} bytes")


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else 2000
    if "--rank" in sys.argv:
        i = sys.argv.index("--rank")
        rank_main(int(sys.argv[i + 1]), int(sys.argv[i + 2]), steps)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, str(steps), "--rank", str(r), str(port)]) for r in range(2)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
