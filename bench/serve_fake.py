"""`localllm serve`'s own stack (the engine thread, starlette / uvicorn, SSE) over a stand-in runtime whose
steps only sleep, as a GPU step's host sync does (the GIL released): what the HTTP and engine layers
cost and cap, apart from any model. Drive it with bench/serve_load.py:

    python bench/serve_fake.py --port 8090 --step-ms 2 --prompt-ms 3 &
    python bench/serve_load.py --url http://127.0.0.1:8090 --clients 1,16,64 --requests 4

A step of B rows sleeps --step-ms, a prefill pass --prompt-ms per prompt; every row's logits pick a
fixed id (1000 + 7 b) of a 2048-id vocabulary, detokenized with the default model's tokenizer. On
exit (Ctrl-C) it prints the engine's gap between the end of one decode step and the start of the next
at >= 48 rows (the per-step host work: sampling, events, everything that holds the GIL). How serve's
Nagle delay was found (docs/PERFORMANCE.md, thirteenth session): one client's first token took 46 ms
here for a 3 ms prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from localllm.chat_template import resolve_template
from localllm.engine import Engine
from localllm.load import load_model
from localllm.server.app import Served
from localllm.server.run import listen, serve_forever

VOCAB = 2048  # a small row: the engine's argmax over it costs what a GPU's would on the host, nothing


@dataclass
class FakeSlots:
    lengths: list[int]
    capacity: int

    @property
    def n(self) -> int:
        return len(self.lengths)


@dataclass
class SleepingRuntime:
    """The Runtime methods Engine calls, each a sleep and the slots' lengths moved as a real one's."""

    step_s: float
    prompt_s: float
    device: torch.device = torch.device("cpu")
    steps_async: bool = False  # each step sleeps inside decode_slots
    model: object = None
    gaps: list[float] = field(default_factory=list)
    last: float | None = None

    def __post_init__(self):
        self.logits = torch.zeros(64, VOCAB)
        self.logits[torch.arange(64), 1000 + 7 * torch.arange(64)] = 1.0

    def new_slots(self, n: int, capacity: int) -> FakeSlots:
        return FakeSlots([0] * n, capacity)

    def prefill_slot(self, slots, slot, ids, start):
        return self.prefill_slots(slots, [slot], [ids], [start])[0]

    def prefill_slots(self, slots, which, prompts, starts):
        time.sleep(self.prompt_s * len(which))
        for s, ids, st in zip(which, prompts, starts):
            slots.lengths[s] = st + len(ids)
        return self.logits[: len(which)]

    def decode_slots(self, slots, which, tokens):
        begin = time.perf_counter()
        if self.last is not None and len(which) >= 48:
            self.gaps.append(begin - self.last)
        time.sleep(self.step_s)
        self.last = time.perf_counter()
        for s in which:
            slots.lengths[s] += 1
        return self.logits[: len(which)]

    def copy_prefix(self, slots, src, dst, n):
        slots.lengths[dst] = n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--step-ms", type=float, default=2.0, help="a decode step's sleep (any row count)")
    p.add_argument("--prompt-ms", type=float, default=3.0, help="a prefill pass's sleep per prompt")
    p.add_argument("-np", "--parallel", type=int, default=64)
    p.add_argument("--log-level", default="warning", help="debug: the engine's lines for bench/serve_timeline.py")
    args = p.parse_args()
    lm = load_model(None, device="cpu")  # the default model's tokenizer and chat template
    rt = SleepingRuntime(args.step_ms / 1e3, args.prompt_ms / 1e3)
    engine = Engine(rt, lm.tokenizer.stop_ids, args.parallel, 512).start()
    template, _ = resolve_template(None, lm.tokenizer.chat_template)
    print(f"serving on 127.0.0.1:{args.port}", flush=True)
    try:
        serve_forever(Served(engine, lm.tokenizer, template, ("fake",)), listen("127.0.0.1", args.port), args.log_level)
    finally:
        if rt.gaps:
            q = statistics.quantiles(rt.gaps, n=10)
            print(f"engine gap between decode steps of >= 48 rows: p50 {1e3 * statistics.median(rt.gaps):.2f} ms, "
                  f"p90 {1e3 * q[-1]:.2f} ms over {len(rt.gaps)} steps", flush=True)


if __name__ == "__main__":
    main()
