"""Token ids -> text pieces, ending before the first stop string, one id at a time (push, not pull).

generate.stream_text drives it from an iterator of ids; the server (localllm/server/) pushes ids as its
engine emits them. Text that might be the start of a stop string is held back until it is known not to
be one, so the pieces never show any part of a stop string.
"""

from __future__ import annotations

from .tokenizer import StreamDecoder, Tokenizer


class StopText:
    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = ()):
        # "" would match at once and end every stream before its first piece
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=0)
        self.dec = StreamDecoder(tok)
        self.pending = ""
        self.stopped = False  # a stop string was found: nothing more comes out

    def _cut(self) -> int:
        return min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)

    def push(self, token_id: int) -> str:
        """The text that is now safe to show ("" when held back); sets .stopped at a stop string."""
        if self.stopped:
            return ""
        self.pending += self.dec.push(token_id)
        cut = self._cut()
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        safe = len(self.pending) - (self.hold - 1) if self.hold else len(self.pending)
        if safe <= 0:
            return ""
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def flush(self) -> str:
        """At the end of the ids: the held-back text (up to a stop string completed by the flush)."""
        if self.stopped:
            return ""
        self.pending += self.dec.flush()
        cut = self._cut()
        out, self.pending = (self.pending[:cut] if cut >= 0 else self.pending), ""
        self.stopped = cut >= 0
        return out
