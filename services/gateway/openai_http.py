"""The OpenAI-compatible HTTP surface: a raw ASGI app served by uvicorn (httptools).

The bridge and the direct server both serve exactly this code; only the :class:`Source` of
streams differs (the bus for the bridge, an engine in-process for ``tokenbus serve
openai-http``), so a benchmark of one against the other measures the bus path and nothing
else. Raw ASGI rather than a framework: on the hot path (one SSE event per token) every
layer costs CPU that a 2-core machine would otherwise give to the engine or the client;
see docs/benchmarks.md for the measurement that chose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import uvicorn

from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import marks
from bus_schemas.subjects import KIND_CHAT, KIND_COMPLETIONS
from services.gateway import validation
from services.gateway.ingress import clean_request_id
from services.kit.caller import Chunk, Usage


class StreamLike(Protocol):
    """What a source hands back for one request (:class:`services.kit.caller.Stream` is one)."""

    request_id: str
    finish_reason: str | None
    usage: Usage | None
    rate_limits: dict[str, str]

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def __anext__(self) -> Chunk: ...

    def pending(self) -> int: ...

    async def aclose(self) -> None: ...


class Source(Protocol):
    """Where generations come from."""

    def open(
        self,
        kind: str,
        req: validation.Request,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout: float,
        headers: dict[str, str],
    ) -> StreamLike: ...

    def models(self) -> list[str]: ...

    def healthy(self) -> bool: ...

    def ready(self) -> bool: ...


_END = object()

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Route = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def send_json(
    send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON response."""
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
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


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class OpenAIApp:
    """Routes and handlers of the OpenAI-compatible API over one :class:`Source` (ASGI)."""

    def __init__(
        self,
        source: Source,
        *,
        max_body_bytes: int,
        request_timeout_s: float,
        on_request: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.source = source
        self.max_body = max_body_bytes
        self.timeout = request_timeout_s
        self.on_request = on_request
        self.prefixes: list[tuple[str, Route]] = []
        self.routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/ready"): self.ready,
        }

    def add_route(self, method: str, path: str, handler: Route) -> None:
        self.routes[(method, path)] = handler

    def add_prefix(self, prefix: str, handler: Route) -> None:
        """Every method on ``prefix`` and below goes to ``handler``."""
        self.prefixes.append((prefix, handler))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        if handler is not None:
            await handler(scope, receive, send)
            return
        for prefix, h in self.prefixes:
            if path == prefix or path.startswith(prefix + "/"):
                await h(scope, receive, send)
                return
        if any(p == path for _, p in self.routes):
            await send_json(
                send,
                405,
                E.InvalidRequest(f"method {scope['method']} not allowed on {path}").openai_body(),
            )
            return
        await send_error(send, E.NotFound(f"no route for {scope['method']} {path}"))

    # -- plain endpoints --------------------------------------------------------------------
    async def list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "tokenbus"}
            for m in self.source.models()
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = self.source.healthy()
        await send_json(send, 200 if ok else 503, {"status": "ok" if ok else "unhealthy"})

    async def ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = self.source.ready()
        await send_json(
            send,
            200 if ok else 503,
            {"status": "ready" if ok else "not ready", "models": self.source.models()},
        )

    # -- generation -------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, KIND_CHAT)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, KIND_COMPLETIONS)

    async def _read_json(self, scope: Scope, receive: Receive) -> Any:
        too_large = E.PayloadTooLarge(f"the request body is larger than {self.max_body} bytes")
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise E.InvalidJSON(f"the request body is not valid JSON: {exc}") from None

    async def _generate(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        rid = clean_request_id(header(scope, b"x-request-id"))
        t_start = time.perf_counter_ns()
        t1_ns = time.time_ns()
        status = 200
        outcome = "ok"
        stream: StreamLike | None = None
        watcher: asyncio.Task[None] | None = None
        state: dict[str, Any] = {"finished": False, "t1_ns": t1_ns}
        try:
            body = await self._read_json(scope, receive)
            req = validation.parse(kind, body)
            # The body is read: from here on the only message left is the disconnect, and a
            # client that leaves cancels this handler, which cancels the generation.
            watcher = asyncio.get_running_loop().create_task(
                _watch_disconnect(receive, asyncio.current_task(), state)
            )
            stream = self.source.open(
                kind, req, body, request_id=rid, timeout=self.timeout, headers=bus_headers(scope)
            )
            if req.stream:
                await self._stream(send, kind, req, stream, rid, state)
            else:
                await self._whole(send, kind, req, stream, rid, state)
        except E.TokenbusError as exc:
            status = E.http_status(exc)
            outcome = exc.code
            state["finished"] = True
            await send_error(send, exc, rid)
        except asyncio.CancelledError:
            outcome = "client_disconnected"
        except Exception:
            status, outcome = 500, "internal_error"
            if not state.get("started"):
                state["finished"] = True
                await send_error(send, E.InternalError("the gateway failed; retry"), rid)
        finally:
            state["finished"] = True
            if watcher is not None:
                watcher.cancel()
            if stream is not None:
                await stream.aclose()
            if self.on_request is not None:
                self.on_request(
                    {
                        "request_id": rid,
                        "kind": kind,
                        "status": status,
                        "outcome": outcome,
                        "duration_ms": (time.perf_counter_ns() - t_start) / 1e6,
                        "t1_ns": t1_ns,
                        "t5_ns": state.get("t5_ns"),
                        "streamed": bool(state.get("streamed")),
                        "t6_ns": time.time_ns(),
                        "stream": stream,
                    }
                )

    async def _whole(
        self,
        send: Send,
        kind: str,
        req: validation.Request,
        stream: StreamLike,
        rid: str,
        state: dict[str, Any],
    ) -> None:
        parts = [c.text async for c in stream]
        text = "".join(parts)
        u = stream.usage or Usage(0, 0, 0)
        usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        }
        finish = stream.finish_reason or "stop"
        created = int(time.time())
        if kind == KIND_CHAT:
            out: dict[str, Any] = {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
        else:
            out = {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
            }
        state["finished"] = True
        state["t5_ns"] = time.time_ns()
        await send_json(
            send,
            200,
            out,
            [
                (b"x-request-id", rid.encode()),
                *_limit_headers(stream),
                *_latency_headers(stream, state["t1_ns"]),
            ],
        )

    async def _stream(
        self,
        send: Send,
        kind: str,
        req: validation.Request,
        stream: StreamLike,
        rid: str,
        state: dict[str, Any],
    ) -> None:
        # Wait for the first frame before sending headers, so errors that happen before
        # generation (unknown model, no replica) still get their own HTTP status.
        first: Any
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = _END
        created = int(time.time())
        model = json.dumps(req.model)
        if kind == KIND_CHAT:
            head = (
                f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{created},"model":{model},"choices":[{{"index":0,'
            )
            piece = head + '"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n'
            opening = head + (
                '"delta":{"role":"assistant","content":""},"logprobs":null,'
                '"finish_reason":null}]}\n\n'
            )
            closing = head + '"delta":{},"logprobs":null,"finish_reason":%s}]}\n\n'
            usage_line = (
                f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{created},"model":{model},"choices":[],"usage":%s}}\n\n'
            )
        else:
            head = (
                f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                f'"created":{created},"model":{model},"choices":[{{"index":0,'
            )
            piece = head + '"text":%s,"logprobs":null,"finish_reason":null}]}\n\n'
            opening = ""
            closing = head + '"text":"","logprobs":null,"finish_reason":%s}]}\n\n'
            usage_line = (
                f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                f'"created":{created},"model":{model},"choices":[],"usage":%s}}\n\n'
            )
        state["started"] = True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_SSE, (b"x-request-id", rid.encode()), *_limit_headers(stream)],
            }
        )
        buf: list[str] = [opening] if opening else []
        dumps = json.dumps
        body = "http.response.body"
        try:
            if first is not _END:
                buf.append(piece % dumps(first.text))
                await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
                state["t5_ns"] = time.time_ns()
                state["streamed"] = True
                buf.clear()
                async for c in stream:
                    buf.append(piece % dumps(c.text))
                    # The consumer (this writer) is behind: coalesce what is already here
                    # into one write instead of one syscall per token.
                    while stream.pending():
                        try:
                            c = await stream.__anext__()
                        except StopAsyncIteration:
                            break
                        buf.append(piece % dumps(c.text))
                    await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
                    buf.clear()
            buf.append(closing % dumps(stream.finish_reason or "stop"))
            if req.include_usage:
                u = stream.usage or Usage(0, 0, 0)
                buf.append(
                    usage_line
                    % dumps(
                        {
                            "prompt_tokens": u.prompt_tokens,
                            "completion_tokens": u.completion_tokens,
                            "total_tokens": u.total_tokens,
                        }
                    )
                )
        except E.TokenbusError as exc:
            # Headers are gone: the error travels as an SSE event, as OpenAI's API does.
            buf.append(f"data: {dumps(exc.openai_body())}\n\n")
        buf.append("data: [DONE]\n\n")
        state["finished"] = True
        await send({"type": body, "body": "".join(buf).encode(), "more_body": False})


def _latency_headers(stream: StreamLike, t1_ns: int) -> list[tuple[bytes, bytes]]:
    """Where the time to the first token went (like LiteLLM's overhead header): the gateway's
    share, (engine start - received) + (first token at the gateway - first token in the
    engine), and the engine's, from the stage timestamps of the final frame."""
    t = getattr(stream, "timings", None) or {}
    t2, t3 = t.get("engine_start"), t.get("first_token")
    t4 = getattr(stream, "t_first_ns", 0) or 0
    if not (t2 and t3 and t4):
        return []
    gateway = ((t2 - t1_ns) + (t4 - t3)) / 1e6
    return [
        (b"x-tokenbus-gateway-ms", f"{max(0.0, gateway):.3f}".encode()),
        (b"x-tokenbus-engine-ms", f"{(t3 - t2) / 1e6:.3f}".encode()),
    ]


def _limit_headers(stream: StreamLike) -> list[tuple[bytes, bytes]]:
    """Rate-limit headers, and which replica served (``x-tokenbus-replica``)."""
    out = [(k.encode(), v.encode()) for k, v in stream.rate_limits.items()]
    replica = getattr(stream, "replica", None)
    if replica:
        out.append((b"x-tokenbus-replica", str(replica).encode()))
    return out


async def _watch_disconnect(
    receive: Receive, task: asyncio.Task[Any] | None, state: dict[str, bool]
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    # uvicorn also reports a disconnect once the response is complete: that one is not a
    # client leaving.
    if task is not None and not state["finished"]:
        task.cancel()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the tokenbus service owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HTTPServer:
    """A running uvicorn server for an ASGI app, on a socket we bind (SO_REUSEPORT-able)."""

    def __init__(
        self, app: Any, host: str, port: int, *, reuse_port: bool, shutdown_timeout: float
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
        )
        self.server = _Server(cfg)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
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
    app: Any, host: str, port: int, *, reuse_port: bool, shutdown_timeout: float
) -> HTTPServer:
    """Start serving ``app``; returns the server, whose ``stop()`` drains it."""
    srv = HTTPServer(app, host, port, reuse_port=reuse_port, shutdown_timeout=shutdown_timeout)
    await srv.start()
    return srv
