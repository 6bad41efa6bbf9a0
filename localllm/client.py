"""A client of a running `localllm serve` (or any OpenAI-compatible server): `complete --server URL` streams
from a process that already holds the model, as `ollama run` talks to ollama's server. A command that
loads the model itself pays for importing torch, opening the file and compiling GPU kernels on every run
(several seconds on CUDA: docs/PERFORMANCE.md); this one imports neither torch nor numpy (the standard
library's HTTP client; tests/test_client.py checks the imports).

The request is OpenAI's /v1/completions (the prompt as text, as `complete` takes it: no chat template)
with llama-server's top_k / min_p, streamed as server-sent events: each `data:` line one JSON chunk
whose choices[0].text is the next text piece, then `data: [DONE]`; the usage (prompt and completion
tokens) comes in the chunk stream_options.include_usage asks for.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator

from .errors import LocalLLMError
from .settings import SamplingSettings

# seconds a socket operation may wait: the server's reply headers come at once (a request waits in its
# queue after them), each later line within a prompt's prefill or a step's time
TIMEOUT = 300.0


@dataclass
class RemoteStats:
    """What a streamed completion reported: token counts, why it ended, and the client's own timings
    (seconds from the request to the first piece, and from the first piece to the last)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None
    first_piece_seconds: float = 0.0
    generate_seconds: float = 0.0

    def prompt_tps(self) -> float:
        """Prompt tokens a second, over the wait for the first piece (the server's prefill and the trip)."""
        return self.prompt_tokens / self.first_piece_seconds if self.first_piece_seconds > 0 else 0.0

    def generate_tps(self) -> float:
        """Tokens a second after the first (the first token's time is the prompt's)."""
        later = self.generated_tokens - 1
        return later / self.generate_seconds if later > 0 and self.generate_seconds > 0 else 0.0


def server_url(url: str) -> str:
    """http://host:port (a trailing / or /v1 dropped); a bare host:port gets http://."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise LocalLLMError(f"--server {url!r}: give an http:// or https:// address")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerError(LocalLLMError):
    """The server's error reply: its status and OpenAI's error code (e.g. context_length_exceeded)."""

    def __init__(self, message: str, status: int, code: str | None):
        super().__init__(message)
        self.status, self.code = status, code


def _open(request: urllib.request.Request, url: str):
    """The response, or one line naming what went wrong (no server there, or the server's error message)."""
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as e:
        message, code = _error_message(e)
        raise ServerError(f"the server at {url} answered {e.code}: {message}", e.code, code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise LocalLLMError(f"no server at {url} ({reason}); start one with `localllm serve MODEL`") from None


def _error_message(e: urllib.error.HTTPError) -> tuple[str, str | None]:
    """(message, code) of OpenAI's {"error": {"message": ..., "code": ...}} body, or the status line."""
    try:
        error = json.loads(e.read())["error"]
        return str(error["message"]), error.get("code")
    except Exception:  # noqa: BLE001 -- any other body: the status says enough
        return e.reason or "error", None


def headers(api_key: str | None) -> dict[str, str]:
    """The requests' headers: JSON, and `Authorization: Bearer KEY` for a server started with --api-key."""
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def first_model(url: str, api_key: str | None = None) -> str:
    """The first model the server lists (GET /v1/models)."""
    return model_entry(url, api_key)["id"]


def model_entry(url: str, api_key: str | None = None) -> dict:
    """The first model's entry in GET /v1/models (its id; a localllm server adds context_length)."""
    with _open(urllib.request.Request(f"{url}/v1/models", headers=headers(api_key)), url) as r:
        models = json.loads(r.read()).get("data") or []
    if not models:
        raise LocalLLMError(f"the server at {url} lists no model")
    return models[0]


def _events(response, url: str) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event stream, as they arrive; a stream that breaks off (the
    server stopped, the connection dropped, no line for TIMEOUT seconds) -> one line saying so."""
    try:
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if line.startswith("data:"):
                yield line[len("data:"):].strip()
    except (OSError, http.client.HTTPException) as e:
        raise LocalLLMError(f"the server at {url} stopped streaming ({type(e).__name__}: {e})") from None


def completion_body(model: str, prompt: str, max_tokens: int, sampling: SamplingSettings, stop: tuple[str, ...]) -> dict:
    """The /v1/completions request for `complete`'s settings (max_tokens -1: the server's own limit)."""
    return _body({"model": model, "prompt": prompt}, max_tokens, sampling, stop)


def chat_body(model: str, messages: list[dict], max_tokens: int, sampling: SamplingSettings,
              stop: tuple[str, ...]) -> dict:
    """The /v1/chat/completions request for `chat`'s settings: the conversation as role/content messages."""
    return _body({"model": model, "messages": messages}, max_tokens, sampling, stop)


def _body(body: dict, max_tokens: int, sampling: SamplingSettings, stop: tuple[str, ...]) -> dict:
    body.update({"stream": True, "stream_options": {"include_usage": True}, "temperature": sampling.temperature,
                 "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p})
    if max_tokens >= 0:
        body["max_tokens"] = max_tokens
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if stop:
        body["stop"] = list(stop)
    return body


def stream_completion(url: str, body: dict, stats: RemoteStats, api_key: str | None = None) -> Iterator[str]:
    """POST body to url's /v1/completions -> its text pieces as they arrive; stats filled as they do."""
    return _stream(url, "/v1/completions", body, stats, api_key, lambda choice: choice.get("text"))


def stream_chat(url: str, body: dict, stats: RemoteStats, api_key: str | None = None) -> Iterator[str]:
    """POST body to url's /v1/chat/completions -> the reply's text pieces as they arrive."""
    return _stream(url, "/v1/chat/completions", body, stats, api_key,
                   lambda choice: (choice.get("delta") or {}).get("content"))


def _stream(url: str, path: str, body: dict, stats: RemoteStats, api_key: str | None, piece) -> Iterator[str]:
    """The SSE stream of a POST of body to url + path -> piece(choice) of each chunk's choices, non-empty."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers=headers(api_key))
    began = time.perf_counter()
    first = None
    with _open(request, url) as r:
        for payload in _events(r, url):
            if payload == "[DONE]":
                return
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise LocalLLMError(f"the server at {url} sent a chunk that is not JSON: {payload[:80]!r}") from None
            if "error" in chunk:
                raise LocalLLMError(f"the server at {url}: {chunk['error'].get('message', chunk['error'])}")
            if chunk.get("usage"):
                stats.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                stats.generated_tokens = chunk["usage"].get("completion_tokens", 0)
            for choice in chunk.get("choices") or []:
                stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
                if text := piece(choice):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        stats.first_piece_seconds = now - began
                    stats.generate_seconds = now - first
                    yield text
    raise LocalLLMError(f"the server at {url} ended the stream before its end (no [DONE])")
