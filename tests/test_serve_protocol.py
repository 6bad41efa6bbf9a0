"""OpenAI request bodies -> settings, or a 400 naming the field (localllm/server/protocol.py), without a
server: every malformed shape is an ApiError, never another exception."""

from __future__ import annotations

import pytest

from localllm.server.protocol import ApiError, parse_chat, parse_completion, parse_json

NAMES = ("m", "m.gguf")
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": MSG, **fields}, NAMES)


@pytest.mark.parametrize("fields, param", [
    ({"messages": "hi"}, "messages"), ({"messages": []}, "messages"), ({"messages": [None]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 2.5}, "temperature"), ({"seed": 2**64}, "seed"), ({"stop": [1]}, "stop"), ({"stop": {"a": 1}}, "stop"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"), ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"), ({"response_format": "text"}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"model": 5}, "model"), ({"model": "other"}, "model"),
])
def test_bad_chat_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_defaults_and_values():
    g = chat()
    assert (g.max_tokens, g.stream, g.logprobs, g.stop, g.messages) == (-1, False, None, (), MSG)
    g = chat(max_tokens=7, max_completion_tokens=9, temperature=0, top_p=0.5, seed=3, stop="x", logprobs=True,
             top_logprobs=2, stream=True, stream_options={"include_usage": True}, presence_penalty=0, n=1,
             response_format={"type": "text"}, top_k=5, min_p=0.1)
    assert (g.max_tokens, g.sampling.temperature, g.sampling.top_p, g.sampling.seed, g.stop) == (9, 0.0, 0.5, 3, ("x",))
    assert (g.logprobs, g.stream, g.include_usage, g.sampling.top_k, g.sampling.min_p) == (2, True, True, 5, 0.1)
    parts = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": None}])
    assert parts.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]


def test_completion_prompts():
    assert parse_completion({"model": "m.gguf", "prompt": "x"}, NAMES).prompt == "x"
    assert parse_completion({"model": "m", "prompt": ["x"]}, NAMES).prompt == "x"
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}, NAMES).prompt == [1, 2]
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 0}, NAMES).logprobs == 0
    for prompt in (["a", "b"], [], [1, "a"], [True], None, 5):
        with pytest.raises(ApiError, match="prompt"):
            parse_completion({"model": "m", "prompt": prompt}, NAMES)
    with pytest.raises(ApiError, match="echo"):
        parse_completion({"model": "m", "prompt": "x", "echo": True}, NAMES)


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"\xff\xfe", b"1", b"[" * 100000])
def test_bodies_that_are_not_an_object(raw):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("chat_reply", [False, True])
def test_text_chunks_are_the_whole_objects_encoded(chat_reply):
    """Reply.text_sse (the streams' per-token fast path) against the reference: the chunk object built and
    encoded whole (sse(chunk(...))), byte for byte, text_offset bookkeeping included."""
    from types import SimpleNamespace

    from localllm.server.replies import Reply, sse

    tok = SimpleNamespace(_strip_leading_space=False)
    fast, ref = (Reply(tok, 'm "x"', chat_reply, (), None, 3) for _ in range(2))
    fast.id, fast.created = ref.id, ref.created
    for text in ["hi", ' a "quoted" \\ back\nslash\t', "é中文🙂", "\x00\u2028", "</script>"]:
        assert fast.text_sse(text) == sse(ref.chunk(text, []))
        assert fast.offset == ref.offset
    assert fast.chunk(None if chat_reply else "", [], finish="stop") == ref.chunk(None if chat_reply else "", [], finish="stop")
