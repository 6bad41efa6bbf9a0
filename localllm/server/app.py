"""The OpenAI-compatible HTTP API (starlette): routes, authentication, errors, server-sent events.

POST /v1/chat/completions and /v1/completions submit to the Engine (localllm/engine.py) and answer whole
or as SSE chunks (starlette's StreamingResponse) ending with `data: [DONE]`; GET /v1/models lists the
one model; GET /health reports the slots. Every error is OpenAI's error JSON (protocol.ApiError). A
client that goes away cancels its request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..chat import chat_prompt
from ..engine import Engine, EngineStopped, Event, QueueFull, Request
from ..errors import LocalLLMError
from ..settings import DEFAULT_SAMPLING, DEFAULT_SERVE, SamplingSettings, ServeSettings
from ..tokenizer import Tokenizer
from .protocol import ApiError, Generation, parse_chat, parse_completion, parse_json
from .replies import Reply, sse


@dataclass
class Served:
    """What the app serves: one model's tokenizer and chat template, its engine, the API's settings."""

    engine: Engine
    tokenizer: Tokenizer
    template: str
    names: tuple[str, ...]  # the model's id (first) and the other names a request may use for it
    api_key: str | None = None
    limits: ServeSettings = DEFAULT_SERVE
    defaults: SamplingSettings = DEFAULT_SAMPLING


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(served: Served) -> Starlette:
    def guarded(handler):
        """Authentication, then the handler; an ApiError becomes its JSON response."""

        async def endpoint(request: HttpRequest):
            try:
                check_key(request, served.api_key)
                return await handler(request, served)
            except ApiError as e:
                return error_response(e)

        return endpoint

    async def health(request: HttpRequest):
        return JSONResponse({"status": "ok", **served.engine.load()})

    async def http_error(request: HttpRequest, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind))

    async def server_error(request: HttpRequest, exc: Exception):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def check_key(request: HttpRequest, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


async def models(request: HttpRequest, served: Served):
    return JSONResponse({"object": "list", "data": [
        {"id": served.names[0], "object": "model", "created": 0, "owned_by": "localllm",
         "context_length": served.engine.capacity}]})


async def chat_completions(request: HttpRequest, served: Served):
    gen = parse_chat(parse_json(await request.body()), served.names, served.limits, served.defaults)

    def render():
        try:
            return chat_prompt(served.tokenizer, served.template, gen.messages)[1]
        except LocalLLMError as e:  # the template refused the conversation (e.g. roles not alternating)
            raise ApiError(400, str(e), "messages") from None

    ids = await run_in_threadpool(render)
    return await answer(request, served, gen, ids, chat=True)


async def completions(request: HttpRequest, served: Served):
    gen = parse_completion(parse_json(await request.body()), served.names, served.limits, served.defaults)
    tok = served.tokenizer
    if isinstance(gen.prompt, str):
        ids = await run_in_threadpool(tok.encode, gen.prompt, tok.add_bos, True)
    else:
        ids = gen.prompt
        if not all(0 <= t < tok.vocab_size for t in ids):
            raise ApiError(400, f"'prompt' holds a token id outside the vocabulary (0 to {tok.vocab_size - 1})",
                           "prompt")
    return await answer(request, served, gen, ids, chat=False)


async def answer(http: HttpRequest, served: Served, gen: Generation, ids: list[int], chat: bool):
    """Submit, then reply whole or as a stream."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    request = Request(ids, gen.sampling, gen.max_tokens, gen.logprobs, gen.ignore_eos)
    try:
        handle = served.engine.submit(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}; retry later", kind="server_error", code="queue_full",
                       headers={"Retry-After": str(served.limits.retry_after_seconds)}) from None
    except EngineStopped as e:
        raise ApiError(503, str(e), kind="server_error") from None
    except LocalLLMError as e:  # the prompt does not fit the context
        param = "messages" if chat else "prompt"
        raise ApiError(400, str(e), param, code="context_length_exceeded") from None
    reply = Reply(served.tokenizer, served.names[0], chat, gen.stop, gen.logprobs, len(ids))
    if gen.stream:
        return StreamingResponse(stream(reply, handle, events, gen.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        text, entries = [], []
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while reply.finish is None and reply.error is None:
            try:
                ev = await asyncio.wait_for(events.get(), served.limits.idle_wait_seconds)
            except asyncio.TimeoutError:
                ev = None
            # a client gone while tokens keep coming is noticed too, not only in a pause between them
            if ev is None or loop.time() - checked >= served.limits.idle_wait_seconds:
                checked = loop.time()
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the finally frees the slot
            if ev is None:
                continue
            piece, new = reply.take(ev)
            text.append(piece)
            entries += new
    finally:
        handle.cancel()  # finished: a no-op; a stop string or a vanished client: frees the slot now
    if reply.error is not None:
        raise ApiError(503 if ev.finish == "cancelled" else 500, reply.error, kind="server_error")
    return JSONResponse(reply.whole("".join(text), entries))


async def stream(reply: Reply, handle, events: asyncio.Queue, include_usage: bool):
    """SSE chunks until the finish chunk, then usage (if asked) and [DONE]. Closing the generator (the
    client left: starlette cancels it) cancels the request."""
    try:
        if reply.chat:
            yield sse(reply.chunk("", [], role=True))
        while reply.finish is None and reply.error is None:
            text, entries = reply.take(await events.get())
            if entries:
                yield sse(reply.chunk(text, entries))
            elif text:
                yield reply.text_sse(text)
        if reply.error is not None:
            yield sse(ApiError(500, reply.error, kind="server_error").body())
        else:
            yield sse(reply.chunk(None if reply.chat else "", [], finish=reply.finish))
            if include_usage:
                yield sse(reply.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()
