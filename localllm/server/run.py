"""Run the app under uvicorn: in the foreground (the CLI; Ctrl-C / SIGTERM shut it down gracefully), or in
a background thread on a given socket (tests, benchmarks)."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import uvicorn

from ..engine import Engine
from ..errors import LocalLLMError
from .app import Served, create_app


class Activity:
    """The /v1 requests in flight and when the last one ended (serve --idle-exit); /health does not count
    (a monitor's probe is no use of the model)."""

    def __init__(self) -> None:
        self.active = 0
        self.last = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self.active else time.monotonic() - self.last

    def counting(self, app):
        """app (ASGI) with its /v1 requests counted, each until its response (a whole stream) has gone."""

        async def counted(scope, receive, send):
            if scope["type"] != "http" or not scope["path"].startswith("/v1"):
                return await app(scope, receive, send)
            self.active += 1
            try:
                return await app(scope, receive, send)
            finally:
                self.active -= 1
                self.last = time.monotonic()

        return counted


class GracefulServer(uvicorn.Server):
    """uvicorn's server that, on Ctrl-C / SIGTERM, also stops the engine: running streams end at its next
    step (an error chunk naming the shutdown, then [DONE]) instead of holding the exit until they finish;
    uvicorn stops accepting, lets the responses go out (within shutdown_seconds) and returns. idle_exit
    (seconds, 0: never): the same clean shutdown once no /v1 request has come for that long."""

    def __init__(self, config: uvicorn.Config, engine: Engine, activity: Activity | None = None,
                 idle_exit: float = 0.0):
        super().__init__(config)
        self.engine = engine
        self.activity = activity or Activity()
        self.idle_exit = idle_exit

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own records the signal and raises it again once shut down (the process would then
        # die of it, status 130 / 143); a requested shutdown is a clean exit here: status 0.
        self.engine.stop()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for the streams
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's check, every 0.1 s, whether to shut down."""
        if self.idle_exit > 0 and self.activity.idle_seconds() >= self.idle_exit:
            logging.getLogger("uvicorn.error").warning("no request for %g s: stopping (--idle-exit)", self.idle_exit)
            self.engine.stop()
            return True
        return await super().on_tick(counter)


def server_for(served: Served, host: str, port: int, log_level: str = "info", idle_exit: float = 0.0) -> GracefulServer:
    activity = Activity()
    config = uvicorn.Config(activity.counting(create_app(served)), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=served.limits.shutdown_seconds, lifespan="off")
    return GracefulServer(config, served.engine, activity, idle_exit)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is one error line at once."""
    try:
        return bind(host, port)
    except OSError as e:
        raise LocalLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve_forever(served: Served, sock: socket.socket, log_level: str = "info", idle_exit: float = 0.0) -> None:
    """Until Ctrl-C / SIGTERM (or idle_exit seconds without a request, when > 0); then the engine's thread
    is joined and this returns (exit 0). log_level
    "debug" (or uvicorn's finer "trace"): the engine's line per prefill pass too (localllm/engine.py's
    log), on stderr."""
    host, port = sock.getsockname()[:2]
    if uvicorn.config.LOG_LEVELS[log_level] <= logging.DEBUG:
        engine_log = logging.getLogger("localllm.engine")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        engine_log.addHandler(handler)
        engine_log.setLevel(logging.DEBUG)
    server = server_for(served, host, port, log_level, idle_exit)
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()
        served.engine.join(served.limits.shutdown_seconds)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: accepted connections inherit it, and asyncio switches Nagle's algorithm off
    # (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP. With proto 0 every SSE chunk after
    # the first of a reused connection waited for the client's delayed ACK: ~40 ms added to each
    # streamed request's first token (docs/PERFORMANCE.md, thirteenth session).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_in_thread(served: Served, host: str = "127.0.0.1", port: int = 0) -> tuple[GracefulServer, str]:
    """Start serving in a daemon thread -> (server, base URL "http://host:port"); stop it with
    stop_thread_server(server)."""
    sock = bind(host, port)
    server = server_for(served, host, sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    server.thread = thread
    return server, f"http://{host}:{sock.getsockname()[1]}"


def stop_thread_server(server: GracefulServer) -> None:
    server.engine.stop()
    server.should_exit = True
    server.thread.join(30)
    server.engine.join(30)
