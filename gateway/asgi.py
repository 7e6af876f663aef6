"""The gateway's ASGI layer: the route table, response helpers and the uvicorn server.

This module knows HTTP and nothing of OpenAI: :class:`RouteTable` maps (method, path) and
path prefixes to handlers and answers 404 / 405; ``send_json`` / ``send_error`` write whole
responses; ``header`` / ``api_key`` / ``bus_headers`` read request headers;
:class:`HTTPServer` runs an app under uvicorn (httptools). The OpenAI handlers mounted on
it are in :mod:`gateway.openai_api`; the admin handlers in ``admin_keys`` and
``admin_routing``.

Raw ASGI rather than a framework: on the hot path (one SSE event per token) every layer
costs CPU that a 2-core machine would otherwise give to the engine or the client; see
docs/benchmarks.md for the measurement that chose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import marks

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Route = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]


# -- responses ------------------------------------------------------------------------------
async def send_json(send: Send, status: int, obj: Any, headers: Headers | None = None) -> None:
    """A whole JSON response."""
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *JSON_HEADERS,
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: E.TokenbusError, request_id: str | None = None) -> None:
    """An OpenAI-shaped error with the right status (and Retry-After when retrying helps)."""
    hdrs = [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    if err.retryable and "retry-after" not in {k.lower() for k in err.headers}:
        hdrs.append((b"retry-after", b"1"))
    if request_id:
        hdrs.append((b"x-request-id", request_id.encode()))
    await send_json(send, E.http_status(err), err.openai_body(), hdrs)


# -- request headers ------------------------------------------------------------------------
def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower-case bytes), None when absent."""
    for k, v in scope.get("headers") or ():
        if k == name:
            return bytes(v).decode("latin-1")
    return None


def api_key(scope: Scope) -> dict[str, str]:
    """The caller's API key (``Authorization: Bearer``, or Azure-style ``api-key``) as the
    bus header auth reads; empty when none was sent."""
    auth = header(scope, b"authorization") or ""
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else header(scope, b"api-key")
    return {H.API_KEY: key} if key else {}


def bus_headers(scope: Scope) -> dict[str, str]:
    """What of the HTTP request travels as bus headers: the API key, the session key
    (``X-Session-Id``, for session-affinity routing) and a W3C ``traceparent``."""
    out = api_key(scope)
    session = header(scope, b"x-session-id")
    if session:
        out[H.SESSION] = session[:256]
    trace = marks.traceparent(header(scope, b"traceparent"))
    if trace:
        out[H.TRACEPARENT] = trace
    return out


# -- the route table ------------------------------------------------------------------------
class RouteTable:
    """An ASGI app that dispatches to handlers: exact (method, path) routes first, then path
    prefixes (any method), then 405 for a known path with another method, else 404."""

    def __init__(self, routes: dict[tuple[str, str], Route] | None = None) -> None:
        self.routes: dict[tuple[str, str], Route] = dict(routes or {})
        self.prefixes: list[tuple[str, Route]] = []

    def add_route(self, method: str, path: str, handler: Route) -> None:
        """``method`` on exactly ``path`` (no trailing slash) goes to ``handler``."""
        self.routes[(method, path)] = handler

    def add_prefix(self, prefix: str, handler: Route) -> None:
        """Every method on ``prefix`` and below goes to ``handler``."""
        self.prefixes.append((prefix, handler))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self.route(scope["method"], path)
        if handler is not None:
            await handler(scope, receive, send)
        elif any(p == path for _, p in self.routes):
            await send_json(
                send,
                405,
                E.InvalidRequest(f"method {scope['method']} not allowed on {path}").openai_body(),
            )
        else:
            await send_error(send, E.NotFound(f"no route for {scope['method']} {path}"))

    def route(self, method: str, path: str) -> Route | None:
        """The handler for ``method`` on ``path`` (already without a trailing slash)."""
        handler = self.routes.get((method, path))
        if handler is not None:
            return handler
        for prefix, h in self.prefixes:
            if path == prefix or path.startswith(prefix + "/"):
                return h
        return None


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; the services set up before they serve."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# -- the server -----------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the tokenbus service owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HTTPServer:
    """A running uvicorn server for an ASGI app, on a socket we bind (SO_REUSEPORT-able)."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        reuse_port: bool,
        shutdown_timeout: float,
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.sock.bind((host, port))
        self.sock.listen(4096)
        self.sock.setblocking(False)
        cfg = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            http="httptools",
            loop="none",
            backlog=4096,
            timeout_graceful_shutdown=int(max(1, shutdown_timeout)),
            timeout_keep_alive=30,
            # HTTPS when given a certificate (uvicorn wraps the socket we bound).
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
        )
        self.server = _Server(cfg)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve in a background task; returns once uvicorn is listening."""
        self.task = asyncio.get_running_loop().create_task(self.server.serve([self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening, let open requests finish (up to the shutdown timeout)."""
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def serve(
    app: Any,
    host: str,
    port: int,
    *,
    reuse_port: bool,
    shutdown_timeout: float,
    tls_cert: str = "",
    tls_key: str = "",
) -> HTTPServer:
    """Start serving ``app`` (HTTPS with ``tls_cert``/``tls_key``); returns the server,
    whose ``stop()`` drains it."""
    srv = HTTPServer(
        app,
        host,
        port,
        reuse_port=reuse_port,
        shutdown_timeout=shutdown_timeout,
        tls_cert=tls_cert,
        tls_key=tls_key,
    )
    await srv.start()
    return srv
