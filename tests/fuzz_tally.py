"""Counting fuzz outcomes: per target and outcome, the distinct failure classes (exception class and
innermost project frame) with their first case kept on disk, and which LocalLLMError messages were
reached (the loader's checks the mutations get to: coverage)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

FAILURES = ("exception", "hang", "crash", "memory", "error-not-one-line", "lossy-round-trip",
            "fuzzer-bug")
OUTCOMES = ("ok", "error") + FAILURES
SUSPECT = "despite"  # an "ok" detail of a success that should have been refused (fuzz_worker.run_case)


def normalize(message: str) -> str:
    """A LocalLLMError message with its particulars (quoted names, numbers, paths) blanked."""
    text = re.sub(r"(/[\w.+-]+)+", "PATH", message)
    text = re.sub(r"'[^']*'|\"[^\"]*\"|b'[^']*'", "'…'", text)
    return re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", text)


@dataclass
class FailureClass:
    outcome: str
    exc: str
    frame: str
    message: str
    inner: str
    first: tuple[str, int]
    what: list[str]
    reproducer: str = ""
    count: int = 0


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)  # (target, outcome) -> n
    details: Counter = field(default_factory=Counter)  # (target, "ok: text"/"ok: empty") -> n
    messages: Counter = field(default_factory=Counter)  # (target, normalized error message) -> n
    classes: dict = field(default_factory=dict)  # (target, outcome, exc, frame) -> FailureClass
    recycles: Counter = field(default_factory=Counter)  # target of the case after which a worker outgrew its memory
    suspects: dict = field(default_factory=dict)  # (target, detail) -> reproducer of the first suspect success

    def add(self, result: dict, save: Callable[[str, int, str], tuple[str, list[str]]]) -> None:
        """save(target, idx, slug) keeps a reproducer and returns (its path, the case's mutations)."""
        target, outcome = result["target"], result["outcome"]
        if outcome == "recycle":
            self.recycles[target] += 1
            return
        self.counts[target, outcome] += 1
        if outcome == "ok":
            self.details[target, result["detail"]] += 1
            if SUSPECT in result["detail"] and (target, result["detail"]) not in self.suspects:
                slug = f"suspect-{target}-{result['detail'].replace(' ', '_').replace('/', '_')}"
                self.suspects[target, result["detail"]] = save(target, result["idx"], slug)[0]
        elif outcome == "error":
            self.messages[target, normalize(result["message"])] += 1
        else:
            key = (target, outcome, result.get("exc", ""), result.get("frame") or result.get("inner", ""))
            if key not in self.classes:
                slug = re.sub(r"[^\w.-]+", "_", "-".join(key))[:120] + f"-{len(self.classes)}"
                try:
                    path, what = save(target, result["idx"], slug)
                except Exception as e:  # noqa: BLE001 - a case the fuzzer cannot rebuild is still counted
                    path, what = f"(not rebuilt: {type(e).__name__}: {e})", []
                self.classes[key] = FailureClass(outcome, key[2], result.get("frame", ""), result.get("message", ""),
                                                 result.get("inner", ""), (target, result["idx"]), what, path)
            self.classes[key].count += 1

    def failures(self) -> int:
        return sum(n for (_, o), n in self.counts.items() if o in FAILURES)

    def total(self) -> int:
        return sum(self.counts.values())


def summary(tally: Tally, seed: int, seconds: float, jobs: int, coverage: int = 0) -> str:
    """The counts by target and outcome (a table to paste into a note), then each failure class."""
    targets = sorted({t for t, _ in tally.counts})
    rows = [f"fuzz seed {seed}: {tally.total()} cases in {seconds:.0f} s with {jobs} job(s)"
            f" ({tally.total() / max(seconds, 1e-9):.1f} cases/s)", "",
            "| target | " + " | ".join(OUTCOMES) + " | total |", "|---" * (len(OUTCOMES) + 2) + "|"]
    for t in targets:
        cells = [tally.counts[t, o] for o in OUTCOMES]
        rows.append(f"| {t} | " + " | ".join(map(str, cells)) + f" | {sum(cells)} |")
    ok_detail = ", ".join(f"{t} {d}: {n}" for (t, d), n in sorted(tally.details.items()))
    rows += ["", f"ok outcomes: {ok_detail or 'none'}",
             f"distinct LocalLLMError messages reached: {len({m for m in tally.messages})}"]
    if tally.recycles:
        rows.append(f"workers restarted after their address space passed half the limit (a leak), by the target of"
                    f" the last case: {dict(tally.recycles)}")
    rows += [f"suspect success ({t}, {d}): first kept at {path}" for (t, d), path in tally.suspects.items()]
    if coverage:
        rows.append("most frequent (normalized):")
        rows += [f"  {n:7d}  {t}: {m[:150]}" for (t, m), n in tally.messages.most_common(coverage)]
    rows += ["", f"failure classes: {len(tally.classes)} ({tally.failures()} failing cases)"]
    for (t, o, exc, frame), c in sorted(tally.classes.items(), key=lambda kv: -kv[1].count):
        rows.append(f"- [{t}] {o} {exc} at {frame or c.inner or '?'} x{c.count}: {c.message[:200]}"
                    f"\n    first: case {c.first[1]} ({'; '.join(c.what)[:300]})\n    reproducer: {c.reproducer}")
    return "\n".join(rows)


def save_json(tally: Tally, path: Path) -> None:
    data = dict(counts={f"{t}/{o}": n for (t, o), n in tally.counts.items()},
                classes=[dict(target=k[0], outcome=k[1], exc=k[2], frame=k[3], message=c.message, inner=c.inner,
                              count=c.count, case=c.first[1], what=c.what, reproducer=c.reproducer)
                         for k, c in tally.classes.items()])
    path.write_text(json.dumps(data, indent=1))
