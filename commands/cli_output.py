"""What every command prints on stderr: the `error:` and `note:` lines (one line each, never rich
markup read from user text), and the width at which a table prints unfolded."""

from __future__ import annotations

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
