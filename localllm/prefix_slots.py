"""The engine's prefix cache: which free slot a new prompt goes to (localllm/engine.py).

Each slot keeps the ids its KV rows hold after its last request. A prompt goes to the free slot whose
ids share the longest prefix with it (the least recently used on a tie, so that other slots' prefixes
live longer); when a busy slot's rows share more, those rows are copied into the least recently used
free slot first (several clients sending one system prompt at once).
"""

from __future__ import annotations

from .chat import common_prefix


def pick_slot(prompt: list[int], held: list[list[int]], lengths: list[int], busy, last_used: list[int]
              ) -> tuple[int, int, int]:
    """-> (free slot, ids of the prompt its rows will hold, busy slot to copy them from or -1).
    held[s]: the ids of slot s's rows; lengths[s]: how many of them a busy slot's rows hold now; busy:
    the slots in use (at least one slot is free); last_used[s]: when slot s was last taken (larger:
    later)."""
    free = [s for s in range(len(held)) if s not in busy]
    slot = max(free, key=lambda s: (common_prefix(held[s], prompt), -last_used[s]))
    have = common_prefix(held[slot], prompt)
    best, src = max(((common_prefix(held[s][: lengths[s]], prompt), s) for s in busy), default=(0, -1))
    if best > have:
        return min(free, key=lambda s: last_used[s]), best, src  # keep the other free slots' prefixes
    return slot, have, -1
