"""Engine events -> OpenAI's response objects: text (stop strings cut at text level), log-probs, usage.

Shapes follow OpenAI's API reference: chat.completion / chat.completion.chunk (logprobs.content: one
{token, logprob, bytes, top_logprobs} per id) and text_completion (logprobs: tokens, token_logprobs,
top_logprobs as {text: logprob}, text_offset).
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring  # a str as a JSON string literal, ensure_ascii=False (C)

from ..engine import Event
from ..stop_text import StopText
from ..tokenizer import Tokenizer


class Reply:
    """One request's answer as it grows; take() turns each event into (text, log-prob entries)."""

    def __init__(self, tok: Tokenizer, model: str, chat: bool, stop: tuple[str, ...], logprobs: int | None,
                 prompt_tokens: int):
        self.tok, self.model, self.chat, self.logprobs = tok, model, chat, logprobs
        self.text = StopText(tok, stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish: str | None = None  # "stop" | "length" once ended
        self.error: str | None = None  # set when the engine ended it with an error or at shutdown
        self.offset = 0  # characters of text so far (completions' text_offset)
        self._text_sse: tuple[str, str] | None = None  # text_sse's event around the text (made once)

    # ---- events -------------------------------------------------------------------------------

    def take(self, ev: Event) -> tuple[str, list]:
        """-> (new text, new log-prob entries); sets .finish (or .error) at the end."""
        if ev.token is None:
            text = self.text.flush()
            if ev.finish in ("stop", "length"):
                self.finish = "stop" if self.text.stopped else ev.finish
            else:
                self.error = ev.message or f"generation ended: {ev.finish}"
            return text, []
        self.completion_tokens += 1
        text = self.text.push(ev.token)
        entries = [self._entry(ev)] if self.logprobs is not None else []
        if self.text.stopped:
            self.finish = "stop"
        return text, entries

    def _piece(self, token: int) -> tuple[str, bytes]:
        data = self.tok.token_bytes(token)
        return data.decode("utf-8", errors="replace"), data

    def _entry(self, ev: Event):
        text, data = self._piece(ev.token)
        top = [(self._piece(t), lp) for t, lp in ev.top]
        if self.chat:
            return {"token": text, "logprob": ev.logprob, "bytes": list(data),
                    "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(b)} for (s, b), lp in top]}
        return text, ev.logprob, {s: lp for (s, _), lp in top}

    def logprob_object(self, entries: list, text_start: int):
        """Entries of take() as the response's `logprobs` (None when not asked for)."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets, pos = [], text_start
        for text, _, _ in entries:
            offsets.append(pos)
            pos += len(text)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries] if self.logprobs else None, "text_offset": offsets}

    # ---- response objects ----------------------------------------------------------------------

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, entries: list) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": self.logprob_object(entries, 0), "finish_reason": self.finish}
        return self._head("chat.completion" if self.chat else "text_completion") | {
            "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, entries: list, finish: str | None = None, role: bool = False) -> dict:
        """One streamed chunk: new text (and, first for chat, the role), or the finish reason."""
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        start = self.offset
        self.offset += len(text or "")
        choice |= {"logprobs": self.logprob_object(entries, start) if entries else None, "finish_reason": finish}
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}

    def text_sse(self, text: str) -> str:
        """sse(self.chunk(text, [])) byte for byte, for the chunks of a stream that carry only text (one
        per token): the event's JSON around the text is rendered once per reply, then each chunk
        encodes only its text, instead of building and encoding the whole object per token."""
        if self._text_sse is None:
            offset, mark = self.offset, "\x00"  # mark: a text no chunk carries (rendered as \u0000)
            head, _, tail = sse(self.chunk(mark, [])).partition(encode_basestring(mark))
            self.offset, self._text_sse = offset, (head, tail)
        self.offset += len(text)
        return self._text_sse[0] + encode_basestring(text) + self._text_sse[1]

    def usage_chunk(self) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": self.usage()}


def sse(obj) -> str:
    """One server-sent event holding obj as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
