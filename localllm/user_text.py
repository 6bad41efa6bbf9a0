"""Text from the user: one policy per source for invalid UTF-8, and the notice for characters the
vocabulary cannot write.

The decision (issue 17), applied everywhere text enters:
- prompts typed by the user (command-line arguments, stdin of `chat`, the REPL, --system): invalid
  UTF-8 is replaced by U+FFFD (one per invalid byte or cut-off sequence, as llama.cpp does) and a
  `note:` says so once. On Linux, argv and stdin bytes that are not UTF-8 reach Python as lone
  surrogates U+DC80..U+DCFF (surrogateescape); `repair` turns them back into bytes and decodes those
  with replacement, so "caf\\xe9" and "caf\\xff" both become "caf\\ufffd".
- files (chat template, conversation, perplexity or calibration text, tokenizer JSON): refused with
  one error line naming the file and the byte offset of the first invalid byte; a file is fixed, not
  guessed at.
- characters the vocabulary cannot write (Tokenizer.unrepresentable): tokenized as the vocabulary
  does (dropped, or <unk>), and one `note:` names them.
- library callers: Tokenizer.encode takes any str; a lone surrogate is encoded as U+FFFD.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import LocalLLMError

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def repair(text: str) -> tuple[str, int]:
    """(text with invalid UTF-8 replaced by U+FFFD, how many replacements were made).

    Surrogate escapes (U+DC80..U+DCFF, the bytes Python could not decode) become their bytes again
    and are decoded with replacement; any other lone surrogate (e.g. from a JSON "\\ud800" escape)
    cannot be written as UTF-8 at all and becomes one U+FFFD each."""
    if text.isascii() or not _SURROGATE.search(text):  # isascii: a flag Python keeps, no scan
        return text, 0
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate outside the escape range
        return _SURROGATE.sub(REPLACEMENT, text), len(_SURROGATE.findall(text))
    fixed = data.decode("utf-8", "replace")
    return fixed, fixed.count(REPLACEMENT) - text.count(REPLACEMENT)


class PromptText:
    """Repairs user-typed text and tells `notify` about it once per kind of problem (a chat session
    with invalid bytes on every line gets one note, not one per line)."""

    def __init__(self, notify: Callable[[str], None]) -> None:
        self._notify = notify
        self._said: set[str] = set()

    def note(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self._notify(message)

    def clean(self, text: str, what: str = "the input") -> str:
        fixed, n = repair(text)
        if n:
            self.note(f"{what} is not valid UTF-8: invalid bytes replaced by U+FFFD")
        return fixed

    def check_vocabulary(self, tok, text: str) -> None:
        """One note naming the characters of `text` that `tok` cannot write (Tokenizer.unrepresentable)."""
        message = unrepresentable_notice(tok, text)
        if message:
            self.note(message)


def unrepresentable_notice(tok, text: str) -> str | None:
    """"the vocabulary cannot represent '\\x14' (U+0014): dropped" for the characters of text that the
    tokenizer cannot write; None when it can write them all."""
    missing = tok.unrepresentable(text)
    if not missing:
        return None
    shown = [f"{ch!r} (U+{ord(ch):04X}): {fate}" for ch, fate in missing[:8]]
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return f"the vocabulary cannot represent {', '.join(shown)}{more}"


def stdin_lines(stream) -> Iterator[str]:
    """The lines of a text stream, as str, without failing on bytes that are not UTF-8: they arrive as
    surrogate escapes for PromptText.clean to replace. Reads the binary buffer where there is one."""
    raw = getattr(stream, "buffer", None)
    if raw is None:
        yield from stream
        return
    for line in raw:
        yield line.decode("utf-8", "surrogateescape")


def lenient_stdin(stream) -> None:
    """Make input() on this text stream deliver invalid bytes as surrogate escapes, not raise
    UnicodeDecodeError (interactive chat: the REPL repairs each message)."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):  # a stream that cannot change its error handler: keep it
            pass


def decode_utf8(data: bytes, name: str | Path) -> str:
    """data as UTF-8, or one error naming the file and the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalLLMError(
            f"{name} is not UTF-8 text: invalid byte 0x{data[e.start]:02x} at byte offset {e.start}"
        ) from None


def read_utf8_file(path: str | Path, what: str = "text file") -> str:
    """The text of a UTF-8 file, or one error line naming it (missing, a folder, unreadable, not UTF-8)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LocalLLMError(f"{what} not found: {path}")
    if not p.is_file():
        raise LocalLLMError(f"{what} {path} is not a file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror}") from None
    return decode_utf8(data, path)
