"""The gateway's ASGI layer: the route table, response helpers and the uvicorn server.

This module knows HTTP and nothing of OpenAI: :class:`RouteTable` maps (method, path) and
path prefixes to handlers and answers 404 / 405; ``send_json`` / ``send_error`` write whole
responses; ``header`` / ``api_key`` / ``bus_headers`` read request headers;
:class:`HTTPServer` runs an app under uvicorn (httptools), with :class:`HTTPLimits` on
request heads and connections and the HTTP layer's own errors in OpenAI's shape. The
OpenAI handlers mounted on it are in :mod:`gateway.openai_api`; the admin handlers in
``admin_keys`` and ``admin_routing``.

Raw ASGI rather than a framework: on the hot path (one SSE event per token) every layer
costs CPU that a 2-core machine would otherwise give to the engine or the client; see
docs/benchmarks.md for the measurement that chose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any
from urllib.parse import parse_qs

import orjson
import uvicorn
from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserInvalidURLError,
    HttpParserUpgrade,
)
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import marks
from services.runtime import listen_socket

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


def query_of(scope: Scope) -> dict[str, str]:
    """The request's query parameters (the last value of each)."""
    raw = scope.get("query_string") or b""
    return {k: v[-1] for k, v in parse_qs(bytes(raw).decode("latin-1")).items()}


def list_page(
    newest_first: Sequence[Mapping[str, Any]],
    query: dict[str, str],
    *,
    default: int = 20,
    most: int = 100,
) -> dict[str, Any]:
    """A page of a list as OpenAI pages them: ``order`` (``desc``, newest first, by
    default), ``after`` an item's id, ``limit`` 1..``most`` (``default``)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise E.InvalidRequest("order: must be 'asc' or 'desc'", param="order")
    limit_s = query.get("limit", str(default))
    if not limit_s.isdigit() or not 1 <= int(limit_s) <= most:
        raise E.InvalidRequest(f"limit: must be an integer from 1 to {most}", param="limit")
    ordered = list(newest_first) if order == "desc" else list(reversed(newest_first))
    after = query.get("after")
    if after:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise E.InvalidRequest(f"after: no item {after!r} in this list", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit_s)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > len(page),
    }


def api_key(scope: Scope) -> dict[str, str]:
    """The caller's API key (``Authorization: Bearer``, or Azure-style ``api-key``) as the
    bus header auth reads; empty when none was sent."""
    auth = header(scope, b"authorization") or ""
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else header(scope, b"api-key")
    return {H.API_KEY: key} if key else {}


# Flow control headers of non-OpenAI clients (docs/flow.md): the class asked for, a fairness
# id (llm-d's name too) and a TTFT objective in milliseconds.
_FLOW_HEADERS = (
    (b"x-tokenbus-service-tier", H.PRIORITY),
    (b"x-fairness-id", H.FAIRNESS),
    (b"x-gateway-inference-fairness-id", H.FAIRNESS),
    (b"x-slo-ttft-ms", H.TTFT_OBJECTIVE),
)


def bus_headers(scope: Scope) -> dict[str, str]:
    """What of the HTTP request travels as bus headers: the API key, the session key
    (``X-Session-Id``, for session-affinity routing) and a W3C ``traceparent``."""
    out = api_key(scope)
    session = header(scope, b"x-session-id")
    if session:
        out[H.SESSION] = session[:256]
    for name, bus in _FLOW_HEADERS:
        value = header(scope, name)
        if value:
            out[bus] = value[:128]
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
@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    """What the HTTP layer takes from a connection before the app sees a request; the
    bridge's settings of the same names document each (docs/safety.md, "HTTP framing
    limits"). A connection limit of 0 is no limit. The defaults are the settings'."""

    max_header_bytes: int = 65_536
    header_timeout_s: float = 30.0
    max_connections_per_client: int = 4096
    max_connections: int = 0


# The scope key holding when the request's first byte was parsed (epoch ns): its t1.
RECEIVED_NS = "tokenbus.received_ns"

# Body bytes read ahead of the app before a connection's reading pauses (uvicorn: 64 KiB).
BODY_HIGH_WATER = 4 * 1024 * 1024

# The scope key holding the request's :class:`BodyNow` (on the bridge's own HTTP server).
BODY_NOW = "tokenbus.body_now"


class BodyNow:
    """Writes a piece of a started chunked response body at once, from a plain callback:
    what the ASGI ``send`` of ``http.response.body`` with ``more_body`` does, without its
    coroutine. Returns False, writing nothing, whenever ``send`` would have to wait or do
    more (the client reads slowly, is gone, the response is not a chunked one in progress):
    the caller then uses ``send``."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle  # uvicorn's RequestResponseCycle of the request

    def hold_head(self) -> None:
        """Keep the response's head, which ``send`` writes next, and write it with the first
        piece of body: one system call and one packet for both, the client woken once."""
        self._transport().holding = True

    def _transport(self) -> _HeadFirst:
        """The response's transport, made a :class:`_HeadFirst` the first time."""
        c = self._cycle
        if not isinstance(c.transport, _HeadFirst):
            c.transport = _HeadFirst(c.transport)
        return c.transport

    def ready(self) -> bool:
        """Whether a piece written now goes out at once."""
        c = self._cycle
        return not (
            c.flow.write_paused
            or c.disconnected
            or not c.chunked_encoding
            or not c.response_started
            or c.response_complete
        )

    def __call__(self, body: bytes) -> bool:
        if not body or not self.ready():
            return False
        self._transport().later(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class _HeadFirst:
    """One response's transport: holds the next write when told to (the head) and writes it
    with the one after, and gathers the pieces :class:`BodyNow` writes from callbacks into
    one write per connection (issue 70: a socket write per token was 23-43 % of the bridge's
    samples under load). Everything else is the connection's transport's own."""

    __slots__ = ("_held", "_size", "_transport", "_turns", "holding")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._size = 0
        self._turns = 0  # > 0: a flush of what later() gathered is scheduled
        self.holding = False

    def write(self, data: bytes) -> None:
        if self.holding:
            self.holding = False
            self._held.append(data)
            return
        if self._held:
            self._held.append(data)
            data = self._take()
        self._transport.write(data)

    def later(self, data: bytes) -> None:
        """``data`` goes out with the connection's next write, or two loop turns from now
        (the first token's wake-up of the response's task takes one): the tokens of one
        read from NATS, and the answer's end that the task writes just after them (a final
        frame that came with the last chunk), leave in one write instead of several. Past
        :data:`LATER_MAX` bytes gathered they go at once (and the transport's flow control
        sees them)."""
        self._held.append(data)
        self._size += len(data)
        if self._size >= LATER_MAX:
            self._transport.write(self._take())
        elif not self._turns:
            self._turns = 2
            asyncio.get_running_loop().call_soon(self._turn)

    def _take(self) -> bytes:
        data = b"".join(self._held)
        self._held.clear()
        self._size = 0
        return data

    def _turn(self) -> None:
        self._turns -= 1
        if not self._held:
            self._turns = 0
        elif self._turns:
            asyncio.get_running_loop().call_soon(self._turn)
        elif not self._transport.is_closing():
            self._transport.write(self._take())

    def close(self) -> None:
        if self._held:  # what was held still goes before the connection closes
            self._transport.write(self._take())
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# What :meth:`_HeadFirst.later` gathers before it writes at once: a client's socket buffer
# is larger, so flow control still pauses the writer before the kernel's buffer is full.
LATER_MAX = 64 * 1024


# Refusals of the HTTP layer itself, by error code ("idle": a connection closed that sent
# nothing within the head timeout). Counted, not logged: a hostile client would fill the log.
REFUSED = Counter(
    "tokenbus_bridge_http_refused_total",
    "Requests and connections the bridge's HTTP layer refused or closed",
    ["code"],
)


class _Refused(Exception):
    """Raised from a parser callback: parsing stops and the connection gets ``err``."""

    def __init__(self, err: E.TokenbusError) -> None:
        super().__init__(err.message)
        self.err = err


class _Config(uvicorn.Config):
    """uvicorn's configuration with :class:`_Protocol` as its HTTP protocol, and what the
    protocol's connections share: the limits and the open connections by client address."""

    def __init__(self, app: Any, limits: HTTPLimits, **kw: Any) -> None:
        super().__init__(app, http=_Protocol, **kw)
        self.limits = limits
        self.clients: dict[str, int] = {}


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with limits on request heads and on connections, and
    the errors of the HTTP layer itself in OpenAI's shape.

    httptools (llhttp) takes a head of any size and uvicorn bounds neither the time a head
    takes nor a client's connections. The extra work is a byte count per read while a head
    is arriving, a flag test per other read, and a timer per request; nothing per SSE event.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, _Config)
        self._limits = config.limits
        self._clients = config.clients
        self._peer: str | None = None  # the address this connection counts against
        self._refusal: E.TokenbusError | None = None  # the first request's answer instead
        self._in_head = True  # between requests, or in a request line and headers
        self._head_bytes = 0  # of the current head, counted per read (see data_received)
        self._heads = 0  # heads parsed on this connection
        self._begun = False  # the parser saw the current request's first byte
        self._dropping = False  # refused: whatever else arrives is ignored
        self._due: E.TokenbusError | None = None  # the refusal to send after earlier answers
        self._head_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None

    # -- connections ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        lim = self._limits
        if self.client is not None and lim.max_connections_per_client:
            peer = self._peer = self.client[0]
            n = self._clients[peer] = self._clients.get(peer, 0) + 1
            if n > lim.max_connections_per_client:
                self._refusal = E.TooManyConnections(
                    f"this client has more than {lim.max_connections_per_client} connections "
                    "open to the bridge; reuse or close some and retry"
                )
        # uvicorn's own limit_concurrency would answer 503 in plain text: counted here instead.
        if lim.max_connections and len(self.connections) > lim.max_connections:
            self._refusal = E.Overloaded(
                f"the bridge has more than {lim.max_connections} connections open; retry"
            )
        # The first request's head is due within the timeout of the connection's start
        # (a connection that sends nothing at all is closed then).
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_timers()
        if self._peer is not None:
            n = self._clients.pop(self._peer, 1) - 1
            if n > 0:
                self._clients[self._peer] = n
            self._peer = None

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        self._unset_keepalive_if_required()
        try:
            if self._in_head:
                if self._head_timer is None:
                    self._arm_head_timer()
                room = self._limits.max_header_bytes - self._head_bytes
                if len(data) > room:
                    # Parse up to the limit only: the head must end within it.
                    view = memoryview(data)
                    heads = self._heads
                    self.parser.feed_data(view[:room])
                    if self._heads == heads:
                        limit = self._limits.max_header_bytes
                        self._refuse(
                            E.HeaderFieldsTooLarge(
                                f"the request line and headers are larger than {limit} bytes"
                            )
                        )
                        return
                    # The rest is a body, or a pipelined request: its head is counted from
                    # the next read on (the part in this read is not).
                    self.parser.feed_data(view[room:])
                    return
                self._head_bytes += len(data)
            self.parser.feed_data(data)
        except HttpParserUpgrade:
            self._no_upgrade()
        except HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.err)
                return
            # llhttp's reasons are fixed strings; a callback's may hold the request's bytes.
            reason = str(exc)
            if isinstance(cause, HttpParserInvalidURLError):  # uvicorn's parse_url of the target
                reason = "Invalid URL"
            elif isinstance(exc, HttpParserCallbackError):
                reason = "the request could not be read"
            self._refuse(E.InvalidRequest(f"malformed HTTP request: {reason}"))

    # -- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        # t1, "the gateway receives": the request's first byte, not the later moment its
        # handler runs (under load the handler's task waits its turn in the event loop).
        self.scope[RECEIVED_NS] = time.time_ns()  # type: ignore[literal-required]
        self._begun = True
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._in_head = self._begun = False
        self._heads += 1
        if self._refusal is not None:
            raise _Refused(self._refusal)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            self.scope[BODY_NOW] = BodyNow(cycle)  # type: ignore[literal-required]

    def on_body(self, body: bytes) -> None:
        # uvicorn pauses reading as soon as 64 KiB of body waits for the app, and resumes on
        # the app's next receive, a loop turn later: a 4 MiB body was 64 pauses and resumes
        # of the socket. The bridge reads every body whole (read_body, bounded by
        # bridge.max_body_bytes), so it pauses only past BODY_HIGH_WATER.
        cycle = self.cycle
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return
        cycle.body += body
        if len(cycle.body) > BODY_HIGH_WATER:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0
        if self._drain_timer is not None:
            # The body of a request answered early has all come: on to the next request.
            self._drain_timer.cancel()
            self._drain_timer = None
            if self.timeout_keep_alive_task is None and not self.pipeline:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if self.transport.is_closing() or not cycle.response_complete:
            return
        if self._due is not None:
            self._answer(self._due)  # the earlier answers are out: now the refusal
        elif cycle.more_body:
            # Answered before its body all came (413, 404): the rest is read and dropped, but
            # uvicorn would wait for it as long as bytes trickle in.
            self._drain_timer = self.loop.call_later(
                self._limits.header_timeout_s, self._drain_timeout
            )

    # -- refusals -------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timeout)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._drain_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._drain_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._dropping or self.transport.is_closing():
            return
        if self._head_bytes or self._begun:
            timeout = self._limits.header_timeout_s
            self._refuse(
                E.RequestTimeout(
                    f"the request line and headers did not arrive within {timeout:g} s"
                )
            )
        else:
            # A connection that sent nothing: closed without an answer, as nginx does (an
            # unasked-for 408 on a connection a client pooled would only confuse it).
            REFUSED.labels("idle").inc()
            self._dropping = True
            self.transport.close()

    def _drain_timeout(self) -> None:
        self._drain_timer = None
        if not self.transport.is_closing() and self.cycle.more_body:
            REFUSED.labels(E.RequestTimeout.code).inc()
            self._dropping = True
            self.transport.close()

    def _no_upgrade(self) -> None:
        """A request to switch protocols (WebSocket, h2c, CONNECT): the bridge speaks none of
        them, so it answers in HTTP/1.1 and then closes, because the parser stops at the
        switch and what follows cannot be read as HTTP."""
        self._dropping = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        else:
            self.transport.close()

    def _refuse(self, err: E.TokenbusError) -> None:
        """Answer ``err`` and close, in turn: answers to earlier pipelined requests go first."""
        self._dropping = True
        self._cancel_timers()
        REFUSED.labels(err.code).inc()
        cycle = self.cycle
        if cycle is None or (cycle.response_complete and not cycle.more_body):
            self._answer(err)
        elif cycle.response_complete:
            # Reading the body of a request already answered: there is no one to tell.
            self.transport.close()
        elif self.pipeline or not cycle.more_body:
            # The fault is in a later request: the answers due go out first, then this one
            # (a queued request still reading its body ends at the body timeout).
            self._due = err
        elif not cycle.response_started:
            # The fault is in the body of the request being served: this answers it.
            cycle.disconnected = True
            cycle.message_event.set()
            self._answer(err)
        else:
            self.transport.close()

    def _answer(self, err: E.TokenbusError) -> None:
        """Write ``err`` as an OpenAI-shaped response and close the connection."""
        body = json.dumps(err.openai_body()).encode()
        head = [STATUS_LINE[E.http_status(err)]]
        for name, value in (
            *self.server_state.default_headers,
            *JSON_HEADERS,
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *([(b"retry-after", b"1")] if err.retryable else []),
        ):
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


def _openai_500(app: Route) -> Route:
    """``app`` with uvicorn's plain-text 500, for an exception that escapes it, replaced by
    an OpenAI-shaped one (one frame per request; nothing per SSE event)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            # uvicorn still logs the exception and closes the connection once this re-raises.
            with contextlib.suppress(RuntimeError):  # the answer had started: too late
                await send_error(send, E.InternalError("the gateway failed; retry"))
            raise

    return guarded


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the tokenbus service owns the signals), and
    without its ten wake-ups a second when idle."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    def exit(self) -> None:
        """Stop serving (the open requests get the graceful shutdown's time)."""
        self.should_exit = True
        self._exit.set()

    async def main_loop(self) -> None:
        """uvicorn's loop wakes every 0.1 s to refresh the Date header and look for
        ``should_exit``; this one wakes once a second, the header's resolution, or at once
        on :meth:`exit`."""
        counter = 0
        while not await self.on_tick(counter):  # a multiple of 10: the header is refreshed
            counter = (counter + 10) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), 1.0)


class HTTPServer:
    """A running uvicorn server for an ASGI app, on a socket we bind (SO_REUSEPORT-able),
    with :class:`HTTPLimits` on what a connection may send."""

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
        limits: HTTPLimits | None = None,
    ) -> None:
        self.sock = listen_socket(host, port, reuse_port=reuse_port)
        self.sock.setblocking(False)
        cfg = _Config(
            _openai_500(app),
            limits or HTTPLimits(),
            # No WebSocket endpoints: an Upgrade request is answered as plain HTTP/1.1.
            ws="none",
            lifespan="off",
            access_log=False,
            log_level="warning",
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
        self.server.exit()
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
    limits: HTTPLimits | None = None,
) -> HTTPServer:
    """Start serving ``app`` (HTTPS with ``tls_cert``/``tls_key``) under ``limits``; returns
    the server, whose ``stop()`` drains it."""
    srv = HTTPServer(
        app,
        host,
        port,
        reuse_port=reuse_port,
        shutdown_timeout=shutdown_timeout,
        tls_cert=tls_cert,
        tls_key=tls_key,
        limits=limits,
    )
    await srv.start()
    return srv


# -- the request body -----------------------------------------------------------------------
async def read_bytes(
    scope: Scope, receive: Receive, max_body: int, timeout_s: float = 30.0
) -> bytes:
    """The request body: 413 past ``max_body`` bytes (by Content-Length or as read), 408
    when it has not all arrived within ``timeout_s`` (the connection is closed); a client
    leaving meanwhile raises ``CancelledError``."""
    too_large = E.PayloadTooLarge(
        f"the request body is larger than {max_body} bytes, this server's limit "
        "(bridge.max_body_bytes); send a smaller request"
    )
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise asyncio.CancelledError
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > max_body:
                    raise too_large
                chunks.append(chunk)
                if not msg.get("more_body"):
                    break
    except TimeoutError:
        raise E.RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes of "
            f"{length or 'an unknown length'} came)",
            headers={"Connection": "close"},
        ) from None
    # One read holds the whole body when it all came before the handler asked (a large body
    # usually does): no copy of it.
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body(scope: Scope, receive: Receive, max_body: int, timeout_s: float = 30.0) -> Any:
    """The request body as JSON (:func:`read_bytes`), 400 when not JSON or beyond what
    tokenbus carries (:func:`check_json`)."""
    raw = await read_bytes(scope, receive, max_body, timeout_s)
    if len(raw) >= _ORJSON_FROM:
        # orjson parses a large body in about half the time (4 MiB: 3.9 ms against 7.3).
        # It is stricter (no NaN, no lone surrogate, 64-bit integers): what it refuses is
        # parsed again as before, so the answer and the error are the standard library's.
        # It reads an integer beyond 64 bits as a float, which the standard library keeps
        # an integer (and check_json refuses): a body holding a float that large and whole
        # is parsed again too.
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if not _holds_huge_whole_float(body):
                check_json(body)
                return body
    try:
        body = json.loads(raw)
    except RecursionError:
        raise E.InvalidJSON(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise E.InvalidJSON(f"the request body is not valid JSON: {exc}") from None
    check_json(body)
    return body


# A body of this many bytes or more is parsed with orjson first (read_body).
_ORJSON_FROM = 256 * 1024


def _holds_huge_whole_float(value: Any) -> bool:
    """Whether ``value`` holds a float that is whole and beyond 64 bits (what orjson makes of
    an integer literal too large for 64 bits)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, float):
            if abs(v) >= 2.0**63 and v.is_integer():
                return True
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


# What a request body may hold (real clients stay far inside these): nesting depth, and
# integers msgpack carries (signed or unsigned 64 bits).
MAX_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def check_json(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuse (400, naming the field) what JSON allows but tokenbus cannot carry: nesting
    deeper than :data:`MAX_DEPTH`, an integer beyond 64 bits, a string with a lone UTF-16
    surrogate (``"\\ud800"``: not Unicode text, so not UTF-8 either)."""
    if depth > MAX_DEPTH:
        raise E.InvalidJSON(
            f"the request body is nested deeper than {MAX_DEPTH} levels", param=path or None
        )
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise E.InvalidRequest(
                    f"{path or 'body'}: a string holds a lone UTF-16 surrogate, which is not text",
                    param=path or None,
                ) from None
    elif isinstance(value, bool | float) or value is None:
        return
    elif isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise E.InvalidRequest(
                f"{path or 'body'}: the integer does not fit in 64 bits", param=path or None
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json(k, path, depth + 1)
            check_json(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json(v, f"{path}.{i}" if path else str(i), depth + 1)
