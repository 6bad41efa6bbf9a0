"""Where a served load's time went, from `localllm serve --log-level debug`'s engine lines (issue 22).

The engine logs one line per prefill pass and per decode step (localllm/engine.py), each with its start
(time.perf_counter) and durations. This splits the log into busy periods (a pause of more than --pause
seconds with neither ends one: the load generator's phases) and prints for each: its wall time, the
decode steps (count, time to their ids, time emitting their events, mean rows), the prefill passes
(count, time, prompts and ids), and the rest: the engine's time between one step or pass and the next
(the loop's host work, and waits for requests).

    localllm serve MODEL -np 64 --log-level debug 2> serve.log &
    python bench/serve_load.py --clients 1,16,64 ...
    python bench/serve_timeline.py serve.log
"""

from __future__ import annotations

import argparse
import re
import statistics

STEP = re.compile(r"decode step: (\d+) rows, at ([\d.]+), ([\d.]+) ms to the ids, ([\d.]+) ms to the events")
PASS = re.compile(r"prefill pass: (\d+) prompts, (\d+) ids .*?at ([\d.]+), ([\d.]+) ms to the first ids")


def events(lines):
    """-> [(start s, end s, kind, rows or prompts, ids, emit s)] in start order."""
    out = []
    for line in lines:
        if m := STEP.search(line):
            rows, at, ids_ms, emit_ms = int(m[1]), float(m[2]), float(m[3]), float(m[4])
            out.append((at, at + (ids_ms + emit_ms) / 1e3, "step", rows, rows, emit_ms / 1e3))
        elif m := PASS.search(line):
            prompts, n, at, ms = int(m[1]), int(m[2]), float(m[3]), float(m[4])
            out.append((at, at + ms / 1e3, "pass", prompts, n, 0.0))
    return sorted(out)


def periods(evs, pause: float):
    """Split events at pauses longer than `pause` seconds."""
    group = []
    for e in evs:
        if group and e[0] - group[-1][1] > pause:
            yield group
            group = []
        group.append(e)
    if group:
        yield group


def summary(group) -> str:
    wall = group[-1][1] - group[0][0]
    steps = [e for e in group if e[2] == "step"]
    passes = [e for e in group if e[2] == "pass"]
    step_s = sum(e[1] - e[0] for e in steps)
    emit_s = sum(e[5] for e in steps)
    pass_s = sum(e[1] - e[0] for e in passes)
    rows = sum(e[3] for e in steps)
    between = wall - step_s - pass_s
    lines = [f"{wall:.2f} s wall, {rows} ids decoded ({rows / wall:.0f}/s)",
             f"  steps  {len(steps):5d}  {step_s:6.2f} s ({100 * step_s / wall:.0f}%; events {emit_s:.2f} s)"
             + (f", mean {rows / len(steps):.1f} rows, {1e3 * step_s / len(steps):.2f} ms" if steps else ""),
             f"  passes {len(passes):5d}  {pass_s:6.2f} s ({100 * pass_s / wall:.0f}%)"
             + (f", mean {statistics.mean(e[3] for e in passes):.1f} prompts / "
                f"{statistics.mean(e[4] for e in passes):.0f} ids, {1e3 * pass_s / len(passes):.2f} ms" if passes else ""),
             f"  between       {between:6.2f} s ({100 * between / wall:.0f}%)"]
    if steps:
        big = [e for e in steps if e[3] >= 48]
        if big:
            ms = sorted(1e3 * (e[1] - e[0] - e[5]) for e in big)
            lines.append(f"  steps of 48+ rows: {len(big)}, to their ids p50 {ms[len(ms) // 2]:.2f} ms")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the server's stderr with --log-level debug")
    ap.add_argument("--pause", type=float, default=0.1,
                    help="seconds without a step or pass that end a period (serve_load's warm-ups and rounds)")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        evs = events(f)
    for i, group in enumerate(periods(evs, args.pause)):
        print(f"period {i}: {summary(group)}")


if __name__ == "__main__":
    main()
