"""A conversation as chat messages, kept by the client side of `chat`: saved and loaded as JSON (/save,
/load), and streamed from a server (`chat --keep-alive`, RemoteChat: /v1/chat/completions through
localllm/client.py, the server rendering its chat template and reusing the history's cache rows). Nothing
here imports torch: a chat with a kept-alive server starts without it. The local session is
localllm/chat.py's ChatSession; both answer the REPL (commands/repl.py) the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .chat_template import Message
from .client import RemoteStats, ServerError, chat_body, stream_chat
from .errors import LocalLLMError
from .settings import GenerationSettings, SamplingSettings
from .user_text import read_utf8_file, repair


def save_conversation(messages: list[Message], path: str | Path) -> None:
    """/save: the messages (the system message first, if any) as a JSON list."""
    try:
        Path(path).write_text(json.dumps(messages, ensure_ascii=False, indent=1), encoding="utf-8")
    except OSError as e:  # e.g. a missing folder: one line in the REPL, not a traceback
        raise LocalLLMError(f"cannot save the conversation to {path}: {e}") from None


def load_conversation(path: str | Path) -> tuple[str | None, list[Message]]:
    """/load: a file /save wrote -> (its system message or None, the other messages). The file's system
    message replaces the session's, also when it has none: /load restores the conversation that /save
    wrote, not a mix of two."""
    try:
        data = json.loads(read_utf8_file(path, "file"))
    except LocalLLMError as e:
        raise LocalLLMError(f"cannot load conversation: {e}") from None
    except json.JSONDecodeError as e:
        raise LocalLLMError(f"cannot load conversation from {path}: {e}") from None
    except RecursionError:
        raise LocalLLMError(f"cannot load conversation from {path}: nested too deeply") from None
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in data
    ):
        raise LocalLLMError(f"{path} is not a list of {{role, content}} messages")
    for i, m in enumerate(data):
        if repair(m["role"])[1] or repair(m["content"])[1]:  # a JSON escape such as "\ud800"
            raise LocalLLMError(f"{path}: message {i + 1} is not valid text (it holds a lone surrogate)")
    system = data[0]["content"] if data and data[0]["role"] == "system" else None
    if system is not None:
        data = data[1:]
    return system, [{"role": m["role"], "content": m["content"]} for m in data]



def drop_oldest(messages: list[Message]) -> int:
    """Drop the oldest turn (a user message and its reply, or one message) in place -> how many."""
    drop = 2 if len(messages) > 2 and messages[1]["role"] == "assistant" else 1
    del messages[:drop]
    return drop


def dropped_note(dropped: int, kept: int, system: str | None) -> str:
    return (f"context full: dropped the {dropped} oldest messages ({kept} kept"
            f"{', with the system message' if system else ''})")


class Conversation:
    """The messages side of a chat session (a mixin of dataclasses that hold `system` and `messages`,
    the latter without the system message)."""

    system: str | None
    messages: list[Message]

    def conversation(self, messages: list[Message] | None = None) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + (self.messages if messages is None else messages)

    def clear(self) -> None:
        self.messages.clear()

    def save(self, path: str | Path) -> None:
        save_conversation(self.conversation(), path)

    def load(self, path: str | Path) -> None:
        self.system, self.messages = load_conversation(path)


@dataclass
class RemoteChat(Conversation):
    """A chat whose replies a server streams (url: its base, model: its id, capacity: a slot's context
    in tokens). Each reply sends the whole conversation; one too long for the context (the server's
    context_length_exceeded) loses its oldest turns, as ChatSession.fit drops them, and is sent again."""

    url: str
    model: str
    capacity: int
    gen: GenerationSettings
    sampling: SamplingSettings
    system: str | None = None
    messages: list[Message] = field(default_factory=list)  # without the system message
    notify: Callable[[str], None] = lambda text: None
    last: RemoteStats = field(default_factory=RemoteStats)

    def reply(self, text: str) -> Iterator[str]:
        """Add a user message and stream the reply; the reply is recorded even if cut short, the user
        message only once the server has taken the request (as ChatSession.reply)."""
        messages, dropped = self.messages + [{"role": "user", "content": text}], 0
        while True:
            self.last = RemoteStats()
            body = chat_body(self.model, self.conversation(messages), self.gen.max_tokens, self.sampling, self.gen.stop)
            pieces = stream_chat(self.url, body, self.last)
            try:
                first = next(pieces, None)
                break
            except ServerError as e:
                if e.code != "context_length_exceeded" or len(messages) <= 1:
                    raise
                dropped += drop_oldest(messages)
        if dropped:
            self.notify(dropped_note(dropped, len(messages), self.system))
        self.messages = messages
        said: list[str] = []
        try:
            if first is not None:
                said.append(first)
                yield first
            for piece in pieces:
                said.append(piece)
                yield piece
        finally:
            pieces.close()
            self.messages.append({"role": "assistant", "content": "".join(said)})

    def tokens_in_context(self) -> int:
        return self.last.prompt_tokens + self.last.generated_tokens

    def context_capacity(self) -> int:
        return self.capacity
