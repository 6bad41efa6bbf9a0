"""A chat conversation over one KV cache that is kept between turns.

Each turn renders the whole conversation with the chat template, tokenizes it, and prefills only the
tokens after the longest common prefix with what the cache already holds (the new message and the
template's glue). When the context would overflow, the oldest turns are dropped (the system message
stays) and the conversation is prefilled again, with a notice: never silent truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from .cache import KVCache
from .chat_template import Message, render_with_spans
from .conversation import Conversation, dropped_note, drop_oldest
from .errors import LocalLLMError
from .generate import Stats, generate, stream_text
from .load import LoadedModel
from .sampling import Sampler
from .settings import DEFAULT_DRAFT, DraftSettings, GenerationSettings, SamplingSettings
from .speculative import Drafter, SpecStats, generate_speculative
from .tokenizer import Tokenizer
from .user_text import PromptText


def chat_prompt(tok: Tokenizer, template: str, messages: list[Message]) -> tuple[str, list[int]]:
    """(text, ids) of the prompt: template special tokens are parsed, message text is not; no extra
    BOS (the template writes it where the model wants one, as transformers' apply_chat_template does)."""
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    text, spans = render_with_spans(template, messages, True, bos, eos)
    return text, tok.encode_protected(text, spans)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class ChatSession(Conversation):
    lm: LoadedModel
    template: str
    gen: GenerationSettings
    sampling: SamplingSettings
    system: str | None = None
    messages: list[Message] = field(default_factory=list)  # without the system message
    notify: Callable[[str], None] = lambda text: None
    cache: KVCache | None = None
    cached: list[int] = field(default_factory=list)  # the ids whose k/v fill cache rows [0, len)
    last: Stats = field(default_factory=Stats)
    drafter: Drafter | None = None  # speculative decoding (draft.open_drafter), with these settings:
    draft: DraftSettings = DEFAULT_DRAFT
    plain_steps: int = 0  # see generate_speculative

    def __post_init__(self):
        if self.cache is None:
            ctx = max(2, min(self.gen.ctx, self.lm.config.context_length))
            self.cache = self.lm.runtime.new_cache(ctx)
        self.sampler = Sampler(self.sampling, self.lm.runtime.device)
        self.text = PromptText(self.notify)  # typed text: invalid UTF-8 replaced, one note per problem

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return chat_prompt(self.lm.tokenizer, self.template, messages)[1]

    def fit(self, messages: list[Message]) -> tuple[list[Message], list[int]]:
        """(messages, prompt ids): the oldest turns dropped until a reply fits. Works on a copy, so a
        message too long for the context leaves the conversation as it was."""
        reserve = min(self.gen.max_tokens if self.gen.max_tokens >= 0 else self.cache.capacity, self.cache.capacity // 2)
        messages, dropped = list(messages), 0
        while True:
            ids = self.prompt_ids(self.conversation(messages))
            if len(ids) + reserve <= self.cache.capacity:
                break
            if len(messages) <= 1:
                raise LocalLLMError(
                    f"the message needs {len(ids)} tokens but the context holds {self.cache.capacity}"
                    f" with {reserve} kept for the reply: shorten it or raise --ctx"
                )
            dropped += drop_oldest(messages)
        if dropped:
            self.notify(dropped_note(dropped, len(messages), self.system))
        return messages, ids

    def reply(self, text: str) -> Iterator[str]:
        """Add a user message and stream the assistant's reply; the reply is recorded even if cut short.

        The user message is kept only once the prompt fits: an error (or Ctrl-C) before the reply starts
        must not leave it without an answer, which would break the user/assistant alternation that
        templates such as Llama 2's and Mistral's enforce."""
        text = self.text.clean(text, "the message")
        if self.system:
            self.system = self.text.clean(self.system, "the system message")
        self.messages, ids = self.fit(self.messages + [{"role": "user", "content": text}])
        self.text.check_vocabulary(self.lm.tokenizer, (self.system or "") + text)
        reuse = min(common_prefix(self.cached, ids), len(ids) - 1)
        self.cache.length = reuse
        produced: list[int] = []
        if self.drafter is not None:
            self.last = SpecStats()
            tokens = generate_speculative(
                self.lm.runtime, self.cache, ids, self.sampler, self.drafter, self.gen.max_tokens,
                self.lm.tokenizer.stop_ids, self.last, reuse, self.draft, self.plain_steps,
            )
        else:
            self.last = Stats()
            tokens = generate(
                self.lm.runtime, self.cache, ids, self.sampler, self.gen.max_tokens, self.lm.tokenizer.stop_ids, self.last, reuse
            )
        try:
            for piece in stream_text(self.lm.tokenizer, _collect(tokens, produced), self.gen.stop):
                yield piece
        finally:
            tokens.close()
            self.cached = (ids + produced)[: self.cache.length]
            self.messages.append({"role": "assistant", "content": self.lm.tokenizer.decode(produced)})
            if len(ids) + len(produced) >= self.cache.capacity:
                self.notify("context full: the reply was cut; older turns will be dropped next turn")

    def tokens_in_context(self) -> int:
        return self.cache.length

    def context_capacity(self) -> int:
        return self.cache.capacity


def _collect(tokens: Iterator[int], out: list[int]) -> Iterator[int]:
    for t in tokens:
        out.append(t)
        yield t
