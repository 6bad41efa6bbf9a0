"""Load test of an OpenAI-compatible server: N concurrent streaming clients, fixed prompt and output lengths.

    localllm serve MODEL --parallel 16 --port 8080 &
    python bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,16,64

The same script drives llama.cpp's llama-server (`llama-server -m FILE -np 16 -c $((16*CTX)) --port 8081`),
or any server speaking /v1/completions with streaming. Each client sends its own prompt of exactly
--prompt-tokens token ids with
`ignore_eos` (llama-server's and our extension) and greedy sampling, so every request generates exactly
--gen-tokens tokens; then the next of its --requests.

After an untimed warm-up at each client count (first-use costs: kernel compilation, graphs per batch size),
per client count it prints: aggregate generated tokens/s (all completion tokens / wall time of the
round), time to first token p50 / p99 (request sent -> first text chunk), inter-token latency p50 / p99
(gaps between a stream's text chunks; llama-server and localllm send one chunk per token, except where
a chunk holds back the start of a multi-byte character). A request whose stream carries no text at all
(random weights may emit only special or partial-character tokens) has no TTFT: the percentiles skip it
and the row counts it ("no_text").

Every prompt of a run (warm-ups and rounds) starts with its own id, so no server's prefix cache serves any
part of one: an earlier version repeated prompts (each warm-up's prompts were the measured rounds' first
requests, and client c's prompts were the same in every round), so localllm's prefix cache prefilled
those as 1-id parts -- other prefill shapes than the measured ones, each compiled on first use on CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import openai


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def prompt_ids(number: int, n: int, first_id: int, span: int) -> list[int]:
    """The run's prompt `number` (0, 1, .. < span): n ids in [first_id, first_id + span), the first one
    first_id + number, so two prompts of a run share no prefix at all."""
    assert 0 <= number < span, f"prompt {number} of a run needs --id-span > {number}"
    return [first_id + (number + 31 * i * (i + 1)) % span for i in range(n)]


class Prompts:
    """Hands out the run's prompts in order: each one new (warm-ups, every round, every request)."""

    def __init__(self, args):
        self.args, self.used = args, 0

    def next(self) -> list[int]:
        self.used += 1
        return prompt_ids(self.used - 1, self.args.prompt_tokens, self.args.first_id, self.args.id_span)


async def one_request(api: openai.AsyncOpenAI, model: str, ids: list[int], gen: int) -> dict:
    """One streamed request -> its TTFT, gaps and tokens. A connection the server dropped before any text
    (a pooled keep-alive connection it had just closed: llama-server did, once in a 16-client round) is
    retried once, timed from the retry, and counted ("retried"); any other failure ends the run."""
    for attempt in (0, 1):
        t0 = time.perf_counter()
        stamps, tokens = [], 0
        try:
            stream = await api.completions.create(model=model, prompt=ids, max_tokens=gen, temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True, "top_k": 1})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.APIConnectionError:
            if attempt or stamps:
                raise
            continue
        return {"ttft": stamps[0] - t0 if stamps else None, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
                "tokens": tokens or len(stamps), "retried": attempt}


async def client_loop(api, model, prompts: list[list[int]], gen: int) -> list[dict]:
    return [await one_request(api, model, ids, gen) for ids in prompts]


def new_api(args) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0,
                              timeout=args.timeout)


async def clients_of(api, model, plan: list[list[list[int]]], gen: int) -> tuple[list[list[dict]], float, float, float]:
    """Each client of the plan runs its requests in turn, all at once -> (results by client, this
    process's CPU seconds, start, end: time.monotonic, comparable between processes)."""
    cpu, t0 = time.process_time(), time.monotonic()
    results = await asyncio.gather(*(client_loop(api, model, mine, gen) for mine in plan))
    return list(results), time.process_time() - cpu, t0, time.monotonic()


_START: multiprocessing.synchronize.Barrier | None = None  # a worker process's barrier (--procs)


def _worker_init(barrier) -> None:
    global _START
    _START = barrier


def _worker_round(args, model: str, plan: list[list[list[int]]]):
    """One worker's share of a round (--procs): its own client and event loop, started with the others."""
    async def go():
        api = new_api(args)
        _START.wait()
        try:
            return await clients_of(api, model, plan, args.gen_tokens)
        finally:
            await api.close()
    return asyncio.run(go())


def split(plan: list, procs: int) -> list[list]:
    """Client c of a plan goes to process c % procs (none empty: at most len(plan) processes)."""
    return [plan[i::procs] for i in range(min(procs, len(plan)))]


def merge(parts: list[tuple[list[list[dict]], float, float, float]]) -> tuple[list[dict], float, float]:
    """Worker results -> (every request's result, the round's wall seconds: first start to last end, the
    busiest process's CPU share of that wall)."""
    wall = max(p[3] for p in parts) - min(p[2] for p in parts)
    flat = [r for p in parts for rs in p[0] for r in rs]
    return flat, wall, max(p[1] for p in parts) / wall


async def round_of(api, model, clients: int, args, prompts: Prompts, pool=None) -> dict:
    plan = [[prompts.next() for _ in range(args.requests)] for _ in range(clients)]
    if pool is None or clients == 1:
        parts = [await clients_of(api, model, plan, args.gen_tokens)]
    else:  # the workers each take one share (a share waits at the barrier until all have one)
        shares = split(plan, args.procs)
        shares += [[]] * (args.procs - len(shares))
        jobs = [(args, model, s) for s in shares]
        parts = [p for p in await asyncio.to_thread(pool.starmap, _worker_round, jobs, 1) if p[0]]
    flat, wall, cpu = merge(parts)
    tokens = sum(r["tokens"] for r in flat)
    ttft = [r["ttft"] for r in flat if r["ttft"] is not None]
    itl = [g for r in flat for g in r["itl"]]
    return {"clients": clients, "requests": len(flat), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "short": sum(r["tokens"] != args.gen_tokens for r in flat), "no_text": len(flat) - len(ttft),
            "retried": sum(r.get("retried", 0) for r in flat), "client_cpu": cpu,
            "procs": len(parts)}


async def warm_up(api, model, counts: list[int], args, prompts: Prompts) -> None:
    """Untimed: each client count's concurrency once (prompts of the measured length, 8 tokens each), so
    a server's first-use costs (kernel compilation, graphs per batch size, allocator growth) fall outside
    the rounds, as they would for a server that has been up a while. Prompts differ from the measured ones."""
    for n in counts:
        await asyncio.gather(*(one_request(api, model, prompts.next(), 8) for _ in range(n)))


async def measure(args, report=print) -> tuple[str, list[dict]]:
    """-> (model id, one row per client count of args.clients); report(line) after each round."""
    api = new_api(args)
    model = args.model or (await api.models.list()).data[0].id
    counts = [int(x) for x in args.clients.split(",")]
    prompts = Prompts(args)
    pool = None
    if args.procs > 1:  # started before the warm-up: the workers' imports are done before any round
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(args.procs, initializer=_worker_init, initargs=(ctx.Barrier(args.procs),))
    try:
        await warm_up(api, model, counts, args, prompts)
        rows = []
        for n in counts:
            rows.append(await round_of(api, model, n, args, prompts, pool))
            report(describe(rows[-1], args.gen_tokens))
    finally:
        if pool is not None:
            pool.terminate()
        await api.close()
    return model, rows


def describe(r: dict, gen_tokens: int) -> str:
    return (f"{r['clients']:>4} clients  {r['requests']:>4} requests  {r['tokens']:>6} tokens  {r['wall_s']:7.2f} s  "
            f"{r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  "
            f"ITL p50 {r['itl_p50_ms']:7.1f} ms  p99 {r['itl_p99_ms']:7.1f} ms  "
            f"client CPU {100 * r['client_cpu']:3.0f}% ({r['procs']} proc)"
            + (f"  ({r['short']} requests short of {gen_tokens} tokens)" if r["short"] else "")
            + (f"  ({r['no_text']} requests without text: no TTFT)" if r.get("no_text") else "")
            + (f"  ({r['retried']} requests retried after a dropped connection)" if r.get("retried") else ""))


async def main(args) -> None:
    model, rows = await measure(args, report=(lambda line: None) if args.json else (lambda line: print(line, flush=True)))
    if args.json:
        print(json.dumps({"url": args.url, "model": model, "prompt_tokens": args.prompt_tokens,
                          "gen_tokens": args.gen_tokens, "rounds": rows}))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL (without /v1)")
    p.add_argument("--model", help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--clients", default="1,4,16,64", help="concurrent clients per round, comma-separated")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--first-id", type=int, default=1000, help="prompt ids are drawn from [first-id, first-id + span)")
    p.add_argument("--id-span", type=int, default=20000,
                   help="more than the run's prompts (warm-ups and rounds), each of which starts with its own id")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--procs", type=int, default=1,
                   help="client processes a round's clients are spread over (one event loop each): one process's "
                        "streams at 64 clients can fill its core (its CPU share is printed as client CPU)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
