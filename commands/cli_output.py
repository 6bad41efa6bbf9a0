"""What every command prints on stderr: the `error:` and `note:` lines (one line each, never rich
markup read from user text), the spinner over a GPU's first tokens, and the width at which a table
prints unfolded."""

from __future__ import annotations

import json
import sys
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.table import Table

err = Console(stderr=True)


def print_error(message: str) -> None:
    # escape(): a message quoting user input such as "[/x]" must not be read as rich markup.
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def note(message: str) -> None:
    """One `note:` line on stderr (escaped: notes quote user text and token texts)."""
    err.print(f"[yellow]note:[/yellow] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def unfolded_width(table: Table) -> int:
    """The width at which rich prints `table` without folding any cell (its widest natural row)."""
    return Console(width=10**4).measure(table).maximum


FIRST_TOKENS_COMPILE = "compiling and loading the GPU kernels (first run: cached for later runs)"


def first_tokens_shown(runtime, pieces: Iterator[str]) -> Iterator[str]:
    """Generated text pieces; where the runtime's first tokens compile kernels (Runtime.first_tokens_compile:
    CUDA, seconds on a fresh machine, silent otherwise) the wait for the first ones under a spinner once
    it passes a couple of seconds."""
    if not runtime.first_tokens_compile:
        return pieces
    from localllm.progress import first_items_announced  # rich.progress: imported where it is drawn

    return first_items_announced(pieces, FIRST_TOKENS_COMPILE)


def print_completion(pieces: Iterator[str], json_out: bool, record) -> None:
    """`complete`'s output: the pieces streamed to stdout as they come (then a newline), or with json_out
    one JSON object, record(text), at the end."""
    if json_out:
        print(json.dumps(record("".join(pieces)), ensure_ascii=False))
        return
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
