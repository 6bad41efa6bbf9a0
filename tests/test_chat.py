"""ChatSession on the default model (fp32, greedy): each turn prefills only the tokens after the longest
common prefix with what the KV cache holds, and still replies exactly what a fresh session prefilling
the whole conversation replies; a full context drops the oldest turns (never the system message);
/save and /load round-trip the conversation."""

from __future__ import annotations

import json

import pytest

from localllm.chat import ChatSession, chat_prompt, common_prefix
from localllm.errors import LocalLLMError
from localllm.settings import GenerationSettings, SamplingSettings

GREEDY = SamplingSettings(temperature=0)


def new_session(lm, ctx=1024, max_tokens=32, system=None, messages=None, notes=None) -> ChatSession:
    notify = notes.append if notes is not None else (lambda text: None)
    return ChatSession(lm, lm.tokenizer.chat_template, GenerationSettings(max_tokens=max_tokens, ctx=ctx), GREEDY,
                       system, messages=[dict(m) for m in messages or []], notify=notify)


def prompt_of(session: ChatSession) -> list[int]:
    """The ids the last turn was prompted with: the conversation without its last (assistant) message."""
    return chat_prompt(session.lm.tokenizer, session.template, session.conversation()[:-1])[1]


def check_cache(session: ChatSession, ids: list[int], reply: str) -> None:
    """The cache holds the prompt and the reply's tokens, except the last one when the token limit cut
    the reply (it was never fed) and the end-of-turn token."""
    assert session.cached[: len(ids)] == ids and len(session.cached) == session.cache.length
    fed = len(session.cached) - len(ids)
    generated = session.last.generated_tokens
    assert fed == generated or (fed == generated - 1 and generated == session.gen.max_tokens)
    assert reply.startswith(session.lm.tokenizer.decode(session.cached[len(ids):]))


def check_turn(session: ChatSession, question: str, before: list[int]) -> str:
    """One turn: only the new tokens are prefilled, and the reply equals a fresh session's."""
    history = [dict(m) for m in session.messages]
    reply = "".join(session.reply(question))
    ids = prompt_of(session)
    shared = common_prefix(before, ids)
    assert session.last.prompt_tokens == len(ids) - shared
    assert reply == session.messages[-1]["content"]
    check_cache(session, ids, reply)
    fresh = new_session(session.lm, session.cache.capacity, session.gen.max_tokens, session.system, history)
    assert "".join(fresh.reply(question)) == reply
    assert fresh.last.prompt_tokens == len(ids)  # it prefilled everything
    return reply


def test_prefix_reuse_matches_fresh_prefill(default_lm):
    session = new_session(default_lm)  # the template's own default system message
    first = "".join(session.reply("What is the capital of France?"))
    assert "Paris" in first
    ids = prompt_of(session)
    assert session.last.prompt_tokens == len(ids)  # nothing cached yet
    check_cache(session, ids, first)
    before = list(session.cached)
    second = check_turn(session, "And of Italy?", before)
    assert "Rome" in second
    # the whole previous prompt and reply are reused: only the reply's end, the new message and the
    # template's glue are prefilled
    assert common_prefix(before, prompt_of(session)) >= len(before)
    assert session.last.prompt_tokens < 16

    # Ctrl-C closes the reply generator: the partial reply is recorded and the cache matches it
    pieces = session.reply("Write a long story about a dragon.")
    partial = "".join(next(pieces) for _ in range(4))
    pieces.close()
    assert session.messages[-1] == {"role": "assistant", "content": partial}
    ids = prompt_of(session)
    # stopped while the 4th piece was shown: that token was never fed, the ones before were
    assert session.cached[: len(ids)] == ids and 3 <= len(session.cached) - len(ids) < 8
    assert len(session.cached) == session.cache.length
    assert partial.startswith(session.lm.tokenizer.decode(session.cached[len(ids):]))
    # ... and the next turn is again only the new tokens, and the same reply as from scratch
    check_turn(session, "What is the capital of Germany?", list(session.cached))


LONG_QUESTIONS = [  # about 40 tokens each: with 8-token replies a context of 160 fills at the third turn
    "I am planning a trip to Europe next summer with my family and our two children, who are eight and eleven"
    " years old. We have three weeks. Which country should we visit first?",
    "We also like mountains, lakes, long walks in nature and good food, and we do not like crowded cities or long"
    " queues very much. Which regions would you recommend to us?",
    "My daughter wants to see old castles and my son wants to see trains and museums about science and space."
    " We will travel by train everywhere. What do you suggest?",
]


def test_context_overflow_drops_oldest_turns(default_lm):
    notes: list[str] = []
    system = "You are a helpful travel assistant."
    session = new_session(default_lm, ctx=160, max_tokens=8, system=system, notes=notes)
    for i, q in enumerate(LONG_QUESTIONS):
        reply = "".join(session.reply(q))
        assert reply.strip(), f"turn {i}: empty reply"
        assert session.conversation()[0] == {"role": "system", "content": system}
        assert session.messages[-2:] == [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
        assert session.messages[0]["role"] == "user"
        assert len(prompt_of(session)) + 8 <= session.cache.capacity
    assert len(notes) == 1 and "dropped the 2 oldest messages" in notes[0], notes
    assert "with the system message" in notes[0]
    assert [m["content"] for m in session.messages[::2]] == LONG_QUESTIONS[1:]
    # after the drop the prompt still starts with the system message, whose tokens the cache kept
    assert 0 < session.last.prompt_tokens < len(prompt_of(session))

    # a single message larger than the context: an error, and the conversation is left as it was
    kept = [dict(m) for m in session.messages]
    with pytest.raises(LocalLLMError, match="context holds 160"):
        "".join(session.reply("Please repeat these words: " + "lorem ipsum dolor sit amet " * 40))
    assert session.messages == kept and session.system == system
    assert "".join(session.reply("Thank you!")).strip()  # and the chat goes on
    assert len(session.messages) == 6


def test_save_load_roundtrip(default_lm, tmp_path):
    conv = [{"role": "user", "content": "Ünïcödé 🦙 and \"quotes\"\nsecond line"},
            {"role": "assistant", "content": "Réponse — ok."},
            {"role": "user", "content": "<|im_end|> is just text here"},
            {"role": "assistant", "content": ""}]
    session = new_session(default_lm, system="Be brief.", messages=conv)
    path = tmp_path / "chat.json"
    session.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == [{"role": "system", "content": "Be brief."}, *conv]
    assert "🦙" in path.read_text(encoding="utf-8")  # written as text, not \u escapes

    other = new_session(default_lm, system="Another system message.", messages=[{"role": "user", "content": "x"}])
    other.load(path)
    assert other.conversation() == data and other.system == "Be brief." and other.messages == conv
    other.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text(encoding="utf-8") == path.read_text(encoding="utf-8")

    # a conversation saved without a system message loads without one
    (tmp_path / "nosys.json").write_text(json.dumps(conv[:2]))
    other.load(tmp_path / "nosys.json")
    assert other.system is None and other.conversation() == conv[:2]

    for bad in ("not json", json.dumps({"role": "user"}), json.dumps([{"role": "user"}]),
                json.dumps([{"role": "user", "content": 3}])):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(LocalLLMError):
            other.load(tmp_path / "bad.json")
    assert other.conversation() == conv[:2]
    with pytest.raises(LocalLLMError, match="cannot load"):
        other.load(tmp_path / "missing.json")
    with pytest.raises(LocalLLMError, match="cannot save"):
        other.save(tmp_path / "no" / "such" / "folder.json")
