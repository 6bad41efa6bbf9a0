"""The terminal chat loop: reads user input (line editing and history via readline), streams replies.

Interactive (stdin is a terminal): a rich prompt, slash commands, multi-line input, Ctrl-C stops the
reply and keeps the session, Ctrl-D leaves. Scripted (stdin is not a terminal): each input line is one
user message, or a slash command (handled, never sent to the model), each reply is printed, and the loop
ends at end of input or /exit.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, TextIO

from rich.console import Console
from rich.markup import escape

from localllm.errors import LocalLLMError

# a session: localllm/chat.py's ChatSession (the model here) or localllm/conversation.py's RemoteChat
# (a server's): conversation(), reply(text), clear(), save(), load(), system, last (its stats),
# tokens_in_context(), context_capacity()
Session = Any
Shown = Callable[[Iterator[str]], Iterator[str]]  # the reply's pieces as printed (a spinner before the first)

HELP = """commands:
  /help           this text
  /clear          start a new conversation (keeps the system message)
  /system TEXT    set the system message (and start a new conversation)
  /save FILE      save the conversation as JSON messages
  /load FILE      load a conversation saved with /save
  /stats          tokens in context, last reply's prompt and generation speed
  /exit           leave (Ctrl-D too)
input: end a line with \\ to continue it, or wrap a block in \"\"\" lines; Ctrl-C stops a reply"""


def read_message(read_line: Callable[[str], str]) -> str:
    """One user message: a line, lines joined by trailing backslashes, or a \"\"\"-delimited block."""
    first = read_line(">>> ")
    if first.strip() == '"""':
        lines = []
        while (line := read_line("... ")).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read_line("... "))
    return "\n".join(lines)


def run_command(session: Session, line: str, console: Console) -> bool:
    """Handle a /command; return False when the loop should end."""
    cmd, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if cmd == "/exit":
        return False
    if cmd == "/help":
        console.print(HELP, highlight=False, markup=False)
    elif cmd == "/clear":
        session.clear()
        console.print("[dim]new conversation[/dim]")
    elif cmd == "/system":
        session.system = arg or None
        session.clear()
        console.print("[dim]system message set; new conversation[/dim]")
    elif cmd in ("/save", "/load") and not arg:
        console.print(f"[red]{cmd} needs a file name[/red]")
    elif cmd == "/save":
        session.save(arg)
        console.print(f"[dim]saved {len(session.conversation())} messages to {escape(arg)}[/dim]")
    elif cmd == "/load":
        session.load(arg)
        console.print(f"[dim]loaded {len(session.conversation())} messages from {escape(arg)}[/dim]")
    elif cmd == "/stats":
        s = session.last
        console.print(
            f"[dim]context {session.tokens_in_context()}/{session.context_capacity()} tokens | last reply: prompt "
            f"{s.prompt_tokens} tokens at {s.prompt_tps():.1f} tokens/s, {s.generated_tokens} tokens at "
            f"{s.generate_tps():.1f} tokens/s[/dim]"
        )
    else:
        console.print(f"[red]unknown command {escape(cmd)}[/red] (/help lists them)")
    return True


def stream_reply(session: Session, text: str, out: TextIO, after: Callable[[], None] = lambda: None,
                 shown: Shown = lambda pieces: pieces) -> bool:
    """Print the reply as it streams; return False if Ctrl-C cut it."""
    pieces = shown(session.reply(text))
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        pieces.close()
        out.write("\n")
        after()
        return False
    out.write("\n")
    out.flush()
    after()
    return True


def interactive(
    session: Session, console: Console, out: TextIO | None = None, after: Callable[[], None] = lambda: None,
    shown: Shown = lambda pieces: pieces,
) -> None:
    import readline  # noqa: F401  (line editing and history for input())

    out = out or sys.stdout  # looked up now, not at import: sys.stdout may have been replaced since

    console.print("[dim]chat: /help for commands, Ctrl-D to leave[/dim]")
    while True:
        try:
            text = read_message(lambda p: console.input(f"[bold green]{p}[/bold green]"))
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not text.strip():
            continue
        try:
            if text.startswith("/"):
                if not run_command(session, text, console):
                    return
                continue
            if not stream_reply(session, text, out, after, shown):
                console.print("[dim](reply stopped)[/dim]")
        except LocalLLMError as e:
            # escape(): messages quote user input and templates ("[/INST]"), which rich would read as markup
            console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)


def scripted(
    session: Session, lines: TextIO, out: TextIO | None = None, after: Callable[[], None] = lambda: None,
    console: Console | None = None, shown: Shown = lambda pieces: pieces,
) -> None:
    """One user message per line; a line starting with / is a chat command as in the interactive loop
    (never sent to the model), its output on `console` (stderr: stdout holds only the replies)."""
    out = out or sys.stdout  # looked up now, not at import: sys.stdout may have been replaced since
    console = console or Console(stderr=True)
    for line in lines:
        text = line.rstrip("\n")
        if text.startswith("/"):
            if not run_command(session, text, console):
                return
        elif text.strip():
            stream_reply(session, text, out, after, shown)


def run_chat(session: Session, after: Callable[[], None], shown: Shown = lambda pieces: pieces) -> None:
    """interactive() on a terminal, else scripted() over stdin's lines."""
    from localllm.user_text import lenient_stdin, stdin_lines

    if sys.stdin.isatty():
        lenient_stdin(sys.stdin)  # invalid UTF-8 typed in: replaced with a note (chat.py), no traceback
        interactive(session, Console(), after=after, shown=shown)
    else:
        scripted(session, stdin_lines(sys.stdin), after=after, console=Console(stderr=True), shown=shown)
