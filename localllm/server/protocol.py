"""OpenAI request bodies -> checked, plain settings; anything malformed -> ApiError (400, OpenAI's JSON).

What is read, and its range, follows OpenAI's API reference for /v1/chat/completions and
/v1/completions (max_tokens / max_completion_tokens, temperature 0..2, top_p 0..1, seed, stop: a string
or up to 4, logprobs / top_logprobs 0..20, completions' logprobs 0..5, n 1 only, response_format text)
plus llama-server's extensions top_k, min_p and ignore_eos. Sampling defaults are SamplingSettings'
(llama-server's), not OpenAI's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from ..chat_template import Message
from ..settings import DEFAULT_SAMPLING, DEFAULT_SERVE, SamplingSettings, ServeSettings


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """A parsed request: what to run and how to answer."""

    sampling: SamplingSettings
    max_tokens: int  # -1: until an end-of-turn id or the context is full
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    logprobs: int | None  # None: none; k: the chosen id's log-prob and the k most likely
    ignore_eos: bool
    messages: list[Message] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text, or token ids


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None):
    """body[name] if present and not null, of one of kinds (bool is never a number here)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}, got {_type_name(value)}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number", name)
    return value


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = _get(body, name, (int, float), "a number")
    if value is None:
        return default
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None, default: int | None) -> int | None:
    value = _get(body, name, (int,), "an integer")
    if value is None:
        return default  # (the server's own default, e.g. max_tokens -1, is not the client's to range-check)
    if value < low or high is not None and value > high:
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ApiError(400, f"'{name}' must be {bound}, got {value}", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    return _get(body, name, (bool,), "a boolean", default)


def check_model(body: dict, names: tuple[str, ...]) -> None:
    model = _get(body, "model", (str,), "a string")
    if model is None:
        raise ApiError(400, "'model' is required", "model")
    if model not in names:
        raise ApiError(400, f"the model '{model}' is not served here (this server serves '{names[0]}')", "model",
                       "model_not_found")


def _stop(body: dict, limits: ServeSettings) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
    if len(stop) > limits.max_stop_strings:
        raise ApiError(400, f"'stop' holds at most {limits.max_stop_strings} strings, got {len(stop)}", "stop")
    return tuple(stop)


def _unsupported(body: dict) -> None:
    """Fields we cannot honour: refused, never silently ignored (0 / 1 / null, their no-ops, pass)."""
    if _integer(body, "n", 1, None, 1) != 1:
        raise ApiError(400, "only 'n': 1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise ApiError(400, f"'{name}' is not supported (0 only)", name)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ApiError(400, "'response_format' must be an object with a 'type'", "response_format")
        if fmt["type"] != "text":
            raise ApiError(400, f"'response_format' type '{fmt['type']}' is not supported (text only)",
                           "response_format")
    if body.get("tools"):
        raise ApiError(400, "'tools' are not supported", "tools")


def _common(body: dict, limits: ServeSettings, defaults: SamplingSettings) -> dict:
    _unsupported(body)
    stream = _flag(body, "stream")
    options = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = _flag(options, "include_usage")
    max_tokens = _integer(body, "max_completion_tokens", 1, None, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, None, limits.max_tokens)
    sampling = replace(
        defaults,
        temperature=_number(body, "temperature", 0.0, 2.0, defaults.temperature),
        top_p=_number(body, "top_p", 0.0, 1.0, defaults.top_p),
        top_k=_integer(body, "top_k", 0, None, defaults.top_k),
        min_p=_number(body, "min_p", 0.0, 1.0, defaults.min_p),
        seed=_integer(body, "seed", 0, 2**64 - 1, defaults.seed),
    )
    return dict(sampling=sampling, max_tokens=max_tokens, stop=_stop(body, limits), stream=stream,
                include_usage=include_usage, ignore_eos=_flag(body, "ignore_eos"))


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts joined."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                   f"messages[{i}].content")


def parse_chat(body: dict, names: tuple[str, ...], limits: ServeSettings = DEFAULT_SERVE,
               defaults: SamplingSettings = DEFAULT_SAMPLING) -> Generation:
    check_model(body, names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    parsed: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with a role of system, developer, user or assistant",
                           f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        parsed.append({"role": role, "content": _content(m, i)})
    common = _common(body, limits, defaults)
    logprobs = None
    if _flag(body, "logprobs"):
        logprobs = _integer(body, "top_logprobs", 0, limits.max_top_logprobs, 0)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return Generation(**common, logprobs=logprobs, messages=parsed)


def parse_completion(body: dict, names: tuple[str, ...], limits: ServeSettings = DEFAULT_SERVE,
                     defaults: SamplingSettings = DEFAULT_SAMPLING) -> Generation:
    check_model(body, names)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not (ids and prompt):
        raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    if body.get("echo") or body.get("suffix") or _integer(body, "best_of", 1, None, 1) != 1:
        raise ApiError(400, "'echo', 'suffix' and 'best_of' are not supported", "echo")
    common = _common(body, limits, defaults)
    logprobs = _integer(body, "logprobs", 0, 5, None)
    return Generation(**common, logprobs=logprobs, prompt=prompt)
