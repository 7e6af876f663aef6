"""The OpenAI-compatible API: the handlers the route table of :mod:`gateway.asgi`
serves.

:class:`OpenAIApp` is that route table with ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health`` and ``/ready`` mounted. A generation goes: read and validate the
body (:func:`read_body`, :mod:`gateway.validation`), open a stream from the
:class:`Source`, then write it either whole (:func:`write_whole`) or as server-sent events
(:func:`write_sse`), while :func:`watch_disconnect` cancels it when the client leaves.

The bridge and the direct server both serve exactly this code; only the :class:`Source` of
streams differs (the bus for the bridge, an engine in-process for ``tokenbus serve
openai-http``), so a benchmark of one against the other measures the bus path and nothing
else.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CompletionRequest
from bus_schemas.subjects import KIND_CHAT, KIND_COMPLETIONS, KIND_EMBEDDINGS
from gateway import validation
from gateway.asgi import (
    BODY_NOW,
    JSON_HEADERS,
    RECEIVED_NS,
    BodyNow,
    Headers,
    Message,
    Receive,
    RouteTable,
    Scope,
    Send,
    api_key,
    bus_headers,
    header,
    send_error,
    send_json,
)
from gateway.openapi import document_bytes
from gateway.validation import clean_request_id
from services import logging as tlog
from services import tracing
from services.caller import Assembled, Chunk, Usage

log = tlog.get("bridge")


class StreamLike(Protocol):
    """What a source hands back for one request (:class:`services.caller.Stream` is one)."""

    request_id: str
    finish_reason: str | None
    # The stop string that ended the answer (finish ``stop``), when the engine says.
    stop_sequence: str | None
    usage: Usage | None
    rate_limits: dict[str, str]
    # The class that serves it (``service_tier``), from the replica's accept frame.
    service_tier: str | None

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def __anext__(self) -> Chunk: ...

    def pending(self) -> int: ...

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        """Hand plain text chunks to ``sink`` as they arrive while the consumer waits (see
        :meth:`services.caller.Stream.push_to`); a stream may also never call it."""

    async def aclose(self) -> None: ...


# An ASGI scope key only this process sets, never the HTTP server: the id of the API key a
# request is run for by a trusted caller here (a batch line: gateway/batches.py). Such a
# request carries no key; auth checks the key by id (auth.service.authenticate).
PRINCIPAL = "tokenbus.principal"
# Another such key: the id of the background response this request runs (its runner sets it:
# the response keeps that id, and is written over its queued record).
BACKGROUND = "tokenbus.background"


class InProcess:
    """One request to this process's own app, as a trusted caller here makes it (a batch
    line, a background response): a POST of ``body`` to ``path`` for the key ``principal``
    (None: an open deployment), with more scope keys in ``extra``. :meth:`run` sends it;
    ``status`` and ``chunks`` are the answer, and ``on_body`` (when given) gets each piece
    of a 200 answer's body as it comes instead of ``chunks``."""

    def __init__(
        self,
        path: str,
        body: dict[str, Any],
        principal: str | None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        extra: dict[str, Any] | None = None,
        on_body: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), *headers],
            "client": None,
            "server": None,
            **(extra or {}),
        }
        if principal:
            self.scope[PRINCIPAL] = principal
        self.body = json.dumps(body).encode()
        self.on_body = on_body
        self.sent = False
        self.status = 0
        self.chunks: list[bytes] = []

    async def run(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        async def receive() -> Message:
            if not self.sent:
                self.sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            return await never  # the caller never goes away

        async def send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                chunk = bytes(msg.get("body", b""))
                if self.on_body is not None and self.status == 200:
                    await self.on_body(chunk)
                else:
                    self.chunks.append(chunk)

        try:
            await app(self.scope, receive, send)
        finally:
            never.cancel()

    @property
    def answer(self) -> bytes:
        return b"".join(self.chunks)


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
        principal: str | None = None,
    ) -> StreamLike: ...

    def models(self) -> list[str]: ...

    def models_for(self, api_key: str | None) -> list[str]:
        """The models served now that ``api_key`` may use (raises 401 where keys are
        checked and it is not a valid one)."""
        ...

    def context_length(self, model: str) -> int:
        """``model``'s context length in tokens, as its engines announce it (0: not known)."""
        ...

    def healthy(self) -> bool: ...

    def ready(self) -> bool: ...


@dataclass(slots=True)
class Progress:
    """How far one generation request has got; shared with its disconnect watcher."""

    t1_ns: int  # when the request arrived (wall clock, comparable with the engine's marks)
    started: bool = False  # the SSE response headers are sent
    finished: bool = False  # the last byte is handed to the server (or the request failed)
    streamed: bool = False  # the first token went out as an SSE event
    t5_ns: int | None = None  # when the first token (or the whole answer) went out
    # The error that ended a stream after its headers were sent (an SSE error event): the
    # request's outcome, though its status stays 200.
    error: str | None = None


SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
DONE = "data: [DONE]\n\n"


class OpenAIApp(RouteTable):
    """The OpenAI-compatible API over one :class:`Source`: a route table with its handlers
    mounted; more routes (metrics, admin) may be added to it."""

    def __init__(
        self,
        source: Source,
        *,
        max_body_bytes: int,
        request_timeout_s: float,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        body_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(
            {
                ("POST", "/v1/chat/completions"): self.chat,
                ("POST", "/v1/completions"): self.completions,
                ("POST", "/v1/embeddings"): self.embeddings,
                ("GET", "/v1/models"): self.list_models,
                ("GET", "/health"): self.health,
                ("GET", "/ready"): self.ready,
                ("GET", "/openapi.json"): self.openapi,
            }
        )
        self.source = source
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout_s
        self.timeout = request_timeout_s
        self.on_request = on_request

    # -- plain endpoints --------------------------------------------------------------------
    async def list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models``: the models the source serves now, and the aliases of them
        (``alias_of`` naming the served model) where the source has some."""
        now = int(time.time())
        key = api_key(scope).get(H.API_KEY)
        listing = getattr(self.source, "listing", None)
        try:
            models = listing(key) if listing else dict.fromkeys(self.source.models_for(key))
        except E.TokenbusError as exc:
            await send_error(send, exc)
            return
        data: list[dict[str, Any]] = []
        for m, target in models.items():
            entry: dict[str, Any] = {"id": m, "object": "model", "created": now}
            entry["owned_by"] = "tokenbus"
            if target:
                entry["alias_of"] = target
            # As vLLM reports it: clients size prompts and max_tokens from it.
            if n := self.source.context_length(target or m):
                entry["max_model_len"] = n
            data.append(entry)
        await send_json(send, 200, {"object": "list", "data": data})

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /health``: 200 while the source is healthy, else 503."""
        ok = self.source.healthy()
        await send_json(send, 200 if ok else 503, {"status": "ok" if ok else "unhealthy"})

    async def ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /ready``: 200 while the source can serve, else 503; with its models."""
        ok = self.source.ready()
        await send_json(
            send,
            200 if ok else 503,
            {"status": "ready" if ok else "not ready", "models": self.source.models()},
        )

    async def openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /openapi.json``: the API's OpenAPI document (:mod:`gateway.openapi`)."""
        body = document_bytes()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    # -- generation -------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/chat/completions``."""
        await self.generate(scope, receive, send, KIND_CHAT)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/completions``."""
        await self.generate(scope, receive, send, KIND_COMPLETIONS)

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``."""
        await self.generate(scope, receive, send, KIND_EMBEDDINGS)

    async def generate(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """One chat, completions or embeddings request (:meth:`handle`)."""
        await self.handle(scope, receive, send, kind, self._generation)

    async def _generation(self, call: Call, send: Send) -> None:
        req = validation.parse(call.kind, call.body)
        if call.kind == KIND_CHAT:
            call.session_from(call.body.get("prompt_cache_key"))
        if call.span is not None:
            call.span.set_attribute(tracing.MODEL, req.model)
        call.watch()
        call.whole(bool(getattr(req, "stream", False)))
        if isinstance(req, CompletionRequest):
            parts = validation.per_prompt(req, call.body)
            if len(parts) > 1 or not req.generates:
                await self._completions(call, send, req, parts)
                return
        stream = call.stream = self.source.open(
            call.kind,
            req,
            call.body,
            request_id=call.rid,
            timeout=self.timeout,
            headers=call.hdrs,
            principal=call.principal,
        )
        if call.kind == KIND_EMBEDDINGS:
            await write_embeddings(send, req, stream, call.rid, call.progress)
        elif req.stream:
            await write_sse(send, call.kind, req, stream, call.rid, call.progress, call.now)
        else:
            await write_whole(send, call.kind, req, stream, call.rid, call.progress)

    async def _completions(
        self,
        call: Call,
        send: Send,
        req: CompletionRequest,
        parts: list[tuple[CompletionRequest, dict[str, Any]]],
    ) -> None:
        """A completions request the bus takes as several (:func:`validation.per_prompt`):
        one generation per prompt, each answer choice ``i`` of one ``text_completion`` (as
        OpenAI and vLLM answer a list of prompts), usage summed; with ``max_tokens: 0``
        each choice is its prompt (``echo``) or nothing, finished by ``length``."""
        streams: list[StreamLike] = []
        for i, (one, body) in enumerate(parts):
            rid = call.rid if len(parts) == 1 else f"{call.rid}-{i}"
            stream = self.source.open(
                KIND_COMPLETIONS,
                one,
                body,
                request_id=rid,
                timeout=self.timeout,
                headers=call.hdrs,
                principal=call.principal,
            )
            # The first is the request's in the metrics and the trace; each is closed.
            if call.stream is None:
                call.stream = stream
            else:
                call.more.append(stream)
            if not req.generates:
                stream = PromptOnly(stream, one.prompt_text if req.echo else "")
            streams.append(stream)
        if req.stream:
            await write_sse_choices(send, req, streams, call.rid, call.progress)
        else:
            await write_choices(send, req, streams, call.rid, call.progress)

    async def handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        kind: str,
        serve: Callable[[Call, Send], Awaitable[None]],
    ) -> None:
        """One API request from body to last byte: ``serve`` validates ``call.body``, opens
        ``call.stream`` and writes the answer; here its failures become OpenAI errors, a
        client that leaves cancels it, its outcome goes to ``on_request`` and, traced, it is
        the server span every later hop descends from."""
        rid = clean_request_id(header(scope, b"x-request-id"))
        progress = Progress(scope.get(RECEIVED_NS) or time.time_ns())
        # The duration counts from the first byte (t1), on the monotonic clock from here on.
        t_start = time.perf_counter_ns() - max(0, time.time_ns() - progress.t1_ns)
        status = 200
        outcome = "ok"
        hdrs = bus_headers(scope)
        # Traced, the request is a server span (the child of the client's traceparent) and
        # the parent of every hop after it; current in this task, so logs carry its ids.
        span = _http_span(scope, kind, rid, hdrs) if tracing.on() else None
        token = tracing.activate(span)
        call = Call(kind, rid, hdrs, progress, span, receive, scope.get(BODY_NOW))
        call.principal = scope.get(PRINCIPAL)
        call.background = scope.get(BACKGROUND)
        try:
            call.body = await read_body(scope, receive, self.max_body, self.body_timeout)
            await serve(call, send)
        except E.TokenbusError as exc:
            status = E.http_status(exc)
            outcome = exc.code
            progress.finished = True
            await send_error(send, exc, rid)
        except asyncio.CancelledError:
            outcome = "client_disconnected"
        except Exception:
            status, outcome = 500, "internal_error"
            # A real server fault: logged at error with the exception, for the operator
            # (the client gets a generic 500 that names nothing internal).
            log.exception("internal_error", request_id=rid, kind=kind)
            # Once the SSE headers are out there is no status left to send.
            if not progress.started:
                progress.finished = True
                await send_error(send, E.InternalError("the gateway failed; retry"), rid)
        finally:
            progress.finished = True
            if progress.error is not None and outcome == "ok":
                outcome = progress.error  # ended by an SSE error event after a 200
            stream = call.stream
            if call.watcher is not None:
                call.watcher.cancel()
            for other in call.more:
                await other.aclose()
            if stream is not None:
                await stream.aclose()
            if self.on_request is not None:
                self.on_request(_record(rid, kind, status, outcome, t_start, progress, stream))
            if span is not None:
                _end_http_span(span, status, outcome, stream)
                tracing.deactivate(token)


@dataclass(eq=False)
class Call:
    """One API request in :meth:`OpenAIApp.handle`: what its ``serve`` reads and sets."""

    kind: str
    rid: str
    hdrs: dict[str, str]
    progress: Progress
    span: Any
    receive: Receive
    now: BodyNow | None  # writes body pieces without ``send`` (the bridge's own server)
    body: Any = None
    stream: StreamLike | None = None
    more: list[StreamLike] = field(default_factory=list)  # a request's other streams
    watcher: asyncio.Task[None] | None = None
    # The key a trusted caller in this process runs the request for (scope[PRINCIPAL]).
    principal: str | None = None
    # The background response this request runs (scope[BACKGROUND]).
    background: str | None = None

    def watch(self) -> None:
        """The body is read: from here on the only message left is the disconnect, and a
        client that leaves cancels the handler, which cancels the generation."""
        self.watcher = watch_disconnect(self.receive, self.progress)

    def whole(self, streamed: bool) -> None:
        """A generation no client sees streamed (not ``stream``, not a background response,
        whose events are kept as they come): its replica may send the text in one piece."""
        if not streamed and self.background is None:
            self.hdrs[H.WHOLE] = "1"

    def session_from(self, key: Any) -> None:
        """A session key from the body (``prompt_cache_key``, Messages'
        ``metadata.user_id``) keys session routing where ``X-Session-Id`` does not."""
        if isinstance(key, str) and key and not self.hdrs.get(H.SESSION):
            self.hdrs[H.SESSION] = key[:256]


def _http_span(scope: Scope, kind: str, rid: str, hdrs: dict[str, str]) -> Any:
    """The server span of one generation request; its traceparent goes into ``hdrs``."""
    path = str(scope.get("path", ""))
    method = str(scope.get("method", "POST"))
    span = tracing.start(
        f"{method} {path}",
        hdrs,
        kind=tracing.SERVER,
        attributes={
            "http.request.method": method,
            "http.route": path,
            "url.path": path,
            "url.scheme": scope.get("scheme"),
            "user_agent.original": header(scope, b"user-agent"),
            tracing.OPERATION: tracing.operation(kind),
            tracing.REQUEST_ID: rid,
        },
    )
    tracing.inject(span, hdrs)
    return span


def _end_http_span(span: Any, status: int, outcome: str, stream: StreamLike | None) -> None:
    """Status, outcome and what the stream learnt (replica, key id, tokens), then end.
    A server span fails on a 5xx only (OpenTelemetry's HTTP conventions); a refusal (4xx)
    keeps its code in ``error.type`` and ``tokenbus.outcome``, and the refusing stage's own
    span carries the error."""
    attrs: dict[str, Any] = {"http.response.status_code": status, tracing.OUTCOME: outcome}
    if stream is not None:
        meta = getattr(stream, "meta", None) or {}
        attrs[tracing.REPLICA] = getattr(stream, "replica", None)
        attrs[tracing.KEY_ID] = meta.get("principal")
        attrs[tracing.MIGRATIONS] = getattr(stream, "migrations", 0) or None
        if stream.finish_reason:
            attrs[tracing.FINISH_REASONS] = [stream.finish_reason]
        if stream.usage is not None:
            attrs[tracing.INPUT_TOKENS] = stream.usage.prompt_tokens
            attrs[tracing.OUTPUT_TOKENS] = stream.usage.completion_tokens
    tracing.set_attributes(span, attrs)
    if status >= 500:
        tracing.fail(span, outcome)
    elif outcome != "ok":
        span.set_attribute(tracing.ERROR_TYPE, outcome)
    tracing.end(span)


def _record(
    rid: str,
    kind: str,
    status: int,
    outcome: str,
    t_start: int,
    progress: Progress,
    stream: StreamLike | None,
) -> dict[str, Any]:
    """What ``on_request`` gets about one finished generation request (the bridge's metrics,
    log line and telemetry record are made from it)."""
    return {
        "request_id": rid,
        "kind": kind,
        "status": status,
        "outcome": outcome,
        "duration_ms": (time.perf_counter_ns() - t_start) / 1e6,
        "t1_ns": progress.t1_ns,
        "t5_ns": progress.t5_ns,
        "streamed": progress.streamed,
        "t6_ns": time.time_ns(),
        "stream": stream,
    }


# -- the request body -----------------------------------------------------------------------
async def read_bytes(
    scope: Scope, receive: Receive, max_body: int, timeout_s: float = 30.0
) -> bytes:
    """The request body: 413 past ``max_body`` bytes (by Content-Length or as read), 408
    when it has not all arrived within ``timeout_s`` (the connection is closed); a client
    leaving meanwhile raises ``CancelledError``."""
    too_large = E.PayloadTooLarge(f"the request body is larger than {max_body} bytes")
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
    return b"".join(chunks)


async def read_body(scope: Scope, receive: Receive, max_body: int, timeout_s: float = 30.0) -> Any:
    """The request body as JSON (:func:`read_bytes`), 400 when not JSON or beyond what
    tokenbus carries (:func:`check_json`)."""
    raw = await read_bytes(scope, receive, max_body, timeout_s)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise E.InvalidJSON(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise E.InvalidJSON(f"the request body is not valid JSON: {exc}") from None
    check_json(body)
    return body


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


# -- disconnects ----------------------------------------------------------------------------
def watch_disconnect(receive: Receive, progress: Progress) -> asyncio.Task[None]:
    """A task that cancels the calling task (the handler, and so the generation) when the
    client disconnects before ``progress.finished``; cancel it when the request is done."""
    return asyncio.get_running_loop().create_task(
        _cancel_on_disconnect(receive, asyncio.current_task(), progress)
    )


async def _cancel_on_disconnect(
    receive: Receive, task: asyncio.Task[Any] | None, progress: Progress
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    # uvicorn also reports a disconnect once the response is complete: that one is not a
    # client leaving.
    if task is not None and not progress.finished:
        task.cancel()


# -- the whole answer -----------------------------------------------------------------------
async def write_whole(
    send: Send,
    kind: str,
    req: validation.Request,
    stream: StreamLike,
    rid: str,
    progress: Progress,
) -> None:
    """The answer as one JSON response, once the stream has ended."""
    out = whole_answer(kind, rid, req.model, await _assemble(stream), stream)
    progress.finished = True
    progress.t5_ns = time.time_ns()
    await _send_whole(send, out, rid, stream, progress)


async def _assemble(stream: StreamLike) -> Assembled:
    out = Assembled()
    async for c in stream:
        out.add(c)
    return out


async def _send_whole(
    send: Send, out: dict[str, Any], rid: str, stream: StreamLike, progress: Progress
) -> None:
    await send_json(
        send,
        200,
        out,
        [
            (b"x-request-id", rid.encode()),
            *limit_headers(stream),
            *latency_headers(stream, progress.t1_ns),
        ],
    )


def whole_answer(
    kind: str, rid: str, model: str, out: Assembled, stream: StreamLike
) -> dict[str, Any]:
    """The JSON body of a whole answer: a ``chat.completion`` or a ``text_completion``."""
    usage = _usage(stream)
    finish = stream.finish_reason or "stop"
    created = int(time.time())
    text = out.text
    if kind == KIND_CHAT:
        calls = out.tool_calls
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if (calls or out.refusal) and not text else text,
            "refusal": out.refusal,
        }
        if calls:
            message["tool_calls"] = calls
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        return {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(out.logprobs),
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
            **_tier(stream),
        }
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [text_choice(0, out, stream)],
        "usage": usage,
    }


def _tier(stream: StreamLike) -> dict[str, str]:
    """``service_tier``: the class that served the answer (engine_worker/flow.py); chat
    only (OpenAI's text_completion has none)."""
    tier = getattr(stream, "service_tier", None)
    return {"service_tier": tier} if tier else {}


def chat_logprobs(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat choice's logprobs as OpenAI writes them: ``content`` and ``refusal`` both
    present (null where the engine sent none, as vLLM does for ``refusal``)."""
    if lp is None or ("content" in lp and "refusal" in lp):
        return lp
    return {"content": None, "refusal": None, **lp}


def text_choice(index: int, out: Assembled, stream: StreamLike) -> dict[str, Any]:
    """Choice ``index`` of a whole ``text_completion``."""
    finish = stream.finish_reason or "stop"
    return {"index": index, "text": out.text, "logprobs": out.logprobs, "finish_reason": finish}


# -- several prompts, or none of the output -------------------------------------------------
class PromptOnly:
    """A completion of ``max_tokens: 0``: the engine, asked for one token (it makes at
    least one), is read to its end and its output dropped; what is left is ``text`` (the
    prompt, with ``echo``; else nothing), finished by ``length`` with no completion tokens,
    as OpenAI answers it. Everything else is the engine's stream's."""

    def __init__(self, stream: StreamLike, text: str) -> None:
        self.stream = stream
        self.text = text
        self.request_id = stream.request_id
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self._ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)  # replica, timings, ... for the response headers

    @property
    def rate_limits(self) -> dict[str, str]:
        """The engine's stream's (they come with its first frame)."""
        return self.stream.rate_limits

    @rate_limits.setter
    def rate_limits(self, value: dict[str, str]) -> None:
        self.stream.rate_limits = value

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        async for _ in self.stream:
            pass
        self._ended = True
        self.finish_reason = "length"
        u = self.stream.usage
        if u is not None:
            self.usage = Usage(u.prompt_tokens, 0, u.prompt_tokens, u.prompt_tokens_details)
        if not self.text:
            raise StopAsyncIteration
        return Chunk(self.text, 0, 0)

    def pending(self) -> int:
        return 0

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        return None

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _all(aws: list[Awaitable[Any]]) -> list[Any]:
    """Each result of ``aws``, run at once; the first failure is raised and the others are
    cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def _usage_total(streams: list[StreamLike]) -> dict[str, Any]:
    """The usage of several streams added up (the counts inside the details too)."""
    total: dict[str, Any] = {}
    for s in streams:
        _add_counts(total, _usage(s))
    return total


def _add_counts(into: dict[str, Any], more: dict[str, Any]) -> None:
    for k, v in more.items():
        if isinstance(v, dict):
            _add_counts(into.setdefault(k, {}), v)
        elif isinstance(v, int) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v


async def write_choices(
    send: Send, req: CompletionRequest, streams: list[StreamLike], rid: str, progress: Progress
) -> None:
    """One ``text_completion`` whose choice ``i`` is stream ``i``'s whole answer."""
    outs: list[Assembled] = await _all([_assemble(s) for s in streams])
    body = whole_answer(KIND_COMPLETIONS, rid, req.model, outs[0], streams[0])
    body["choices"] = [
        text_choice(i, out, s) for i, (out, s) in enumerate(zip(outs, streams, strict=True))
    ]
    body["usage"] = _usage_total(streams)
    progress.finished = True
    progress.t5_ns = time.time_ns()
    await _send_whole(send, body, rid, streams[0], progress)


async def _pump(
    i: int, stream: StreamLike, first: Chunk | None, queue: asyncio.Queue[tuple[int, Any]]
) -> None:
    """Stream ``i``'s chunks into ``queue``, then None (or the exception it failed with)."""
    try:
        if first is not None:
            queue.put_nowait((i, first))
            async for c in stream:
                queue.put_nowait((i, c))
        queue.put_nowait((i, None))
    except Exception as exc:  # the writer raises it: the whole answer fails with it
        queue.put_nowait((i, exc))


async def write_sse_choices(
    send: Send, req: CompletionRequest, streams: list[StreamLike], rid: str, progress: Progress
) -> None:
    """Several streams as one event stream, each event the choice of its stream's index,
    as they come; each choice's closing event when its stream ends, then the usage of all
    (when asked for) and ``[DONE]``. Headers go once every stream has its first chunk, so a
    refusal of any is the request's HTTP status."""
    firsts: list[Chunk | None] = await _all([first_chunk(s) for s in streams])
    created = int(time.time())
    frames = [sse_frames(KIND_COMPLETIONS, rid, req.model, created, i) for i in range(len(streams))]
    progress.started = True
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*SSE_HEADERS, (b"x-request-id", rid.encode()), *limit_headers(streams[0])],
        }
    )
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    pumps = [
        asyncio.ensure_future(_pump(i, s, first, queue))
        for i, (s, first) in enumerate(zip(streams, firsts, strict=True))
    ]
    buf: list[str] = []
    try:
        left = len(streams)
        while left:
            i, c = await queue.get()
            if isinstance(c, BaseException):
                raise c
            if c is None:
                left -= 1
                buf.append(frames[i].closing % json.dumps(streams[i].finish_reason or "stop"))
            elif c.has_side:
                buf.append(side_event(frames[i], False, c))
            else:
                buf.append(frames[i].piece % json.dumps(c.text))
            if queue.empty():  # what is here goes in one write
                await send(
                    {"type": "http.response.body", "body": "".join(buf).encode(), "more_body": True}
                )
                buf.clear()
                if not progress.streamed:
                    progress.t5_ns = time.time_ns()
                    progress.streamed = True
        if req.include_usage:
            buf.append(frames[0].usage % json.dumps(_usage_total(streams)))
    except E.TokenbusError as exc:
        buf.append(sse_error(exc))  # the headers are gone: an error event, as for one stream
        progress.error = exc.code
    finally:
        for p in pumps:
            p.cancel()
    buf.append(DONE)
    progress.finished = True
    await send({"type": "http.response.body", "body": "".join(buf).encode(), "more_body": False})


# -- embeddings -----------------------------------------------------------------------------
async def write_embeddings(
    send: Send, req: validation.Request, stream: StreamLike, rid: str, progress: Progress
) -> None:
    """An embeddings answer (OpenAI's ``list`` of ``embedding`` objects), vectors as floats
    or, with ``encoding_format: base64``, as base64 of little-endian float32."""
    out = await _assemble(stream)
    b64 = getattr(req, "encoding_format", None) == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": _b64(vec) if b64 else vec}
        for i, vec in enumerate(out.embeddings)
    ]
    u = stream.usage or Usage(0, 0, 0)
    body = {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens},
    }
    progress.finished = True
    progress.t5_ns = time.time_ns()
    await _send_whole(send, body, rid, stream, progress)


def _b64(vec: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


# -- server-sent events ---------------------------------------------------------------------
class SSEFrames(NamedTuple):
    """The SSE events of one streamed answer as ``%`` templates: all but the token text, the
    finish reason and the usage is fixed per request, so a token costs one ``%`` and one
    ``json.dumps`` of its text."""

    opening: str  # chat's first event (the assistant role); "" for completions
    prefix: str  # an event up to its choices list, for chunks with more than text
    piece: str  # one token: % its text as JSON
    closing: str  # the last event: % the finish reason as JSON
    usage: str  # the usage event (``stream_options.include_usage``): % the usage as JSON
    choice: int = 0  # the choice's index in each event


def sse_frames(
    kind: str, rid: str, model: str, created: int, index: int = 0, tier: str | None = None
) -> SSEFrames:
    """The SSE templates of a ``chat.completion.chunk`` or ``text_completion`` stream (of
    choice ``index``); ``tier``: the ``service_tier`` that serves it."""
    model_json = json.dumps(model)
    if tier and kind == KIND_CHAT:  # OpenAI's text_completion has no service_tier
        model_json += f',"service_tier":{json.dumps(tier)}'
    if kind == KIND_CHAT:
        head = (
            f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{model_json},"choices":[{{"index":{index},'
        )
        return SSEFrames(
            prefix=head.rpartition("{")[0],
            opening=head
            + (
                '"delta":{"role":"assistant","content":""},"logprobs":null,'
                '"finish_reason":null}]}\n\n'
            ),
            piece=head + '"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n',
            closing=head + '"delta":{},"logprobs":null,"finish_reason":%s}]}\n\n',
            usage=(
                f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{created},"model":{model_json},"choices":[],"usage":%s}}\n\n'
            ),
            choice=index,
        )
    head = (
        f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
        f'"created":{created},"model":{model_json},"choices":[{{"index":{index},'
    )
    return SSEFrames(
        opening="",
        prefix=head.rpartition("{")[0],
        piece=head + '"text":%s,"logprobs":null,"finish_reason":null}]}\n\n',
        closing=head + '"text":"","logprobs":null,"finish_reason":%s}]}\n\n',
        usage=(
            f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
            f'"created":{created},"model":{model_json},"choices":[],"usage":%s}}\n\n'
        ),
        choice=index,
    )


async def write_sse(
    send: Send,
    kind: str,
    req: validation.Request,
    stream: StreamLike,
    rid: str,
    progress: Progress,
    now: BodyNow | None = None,
) -> None:
    """The answer as server-sent events: headers once the first token (or the end) is
    here, the tokens, the closing event, the usage event when asked for, then ``[DONE]``.
    With ``now``, plain tokens after the first are written from the stream's own delivery
    (``push_to``), without a turn of this task per token."""
    # Wait for the first frame before sending headers, so errors that happen before
    # generation (unknown model, no replica) still get their own HTTP status.
    first = await first_chunk(stream)
    frames = sse_frames(
        kind, rid, req.model, int(time.time()), tier=getattr(stream, "service_tier", None)
    )
    chat = kind == KIND_CHAT
    progress.started = True
    if now is not None:
        now.hold_head()  # the head goes out with the first token, in one write
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*SSE_HEADERS, (b"x-request-id", rid.encode()), *limit_headers(stream)],
        }
    )
    buf: list[str] = [frames.opening] if frames.opening else []
    try:
        if first is not None:
            await _send_tokens(send, stream, first, frames, chat, buf, progress, now)
        buf.append(frames.closing % json.dumps(stream.finish_reason or "stop"))
        if req.include_usage:
            buf.append(frames.usage % json.dumps(_usage(stream)))
    except E.TokenbusError as exc:
        # Headers are gone: the error travels as an SSE event, as OpenAI's API does.
        buf.append(sse_error(exc))
        progress.error = exc.code
    buf.append(DONE)
    progress.finished = True
    await send({"type": "http.response.body", "body": "".join(buf).encode(), "more_body": False})


def sse_error(exc: E.TokenbusError) -> str:
    """An error as an SSE event: OpenAI's error body, after which only ``[DONE]`` follows."""
    return f"data: {json.dumps(exc.openai_body())}\n\n"


async def first_chunk(stream: StreamLike) -> Chunk | None:
    """The stream's first chunk, None when it ended without one."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def side_event(frames: SSEFrames, chat: bool, c: Chunk) -> str:
    """The SSE event of a chunk with more than text: tool-call deltas, logprobs, refusal,
    reasoning content."""
    choice: dict[str, Any] = {"index": frames.choice}
    if chat:
        delta: dict[str, Any] = {}
        if c.text:
            delta["content"] = c.text
        if c.reasoning is not None:
            delta["reasoning_content"] = c.reasoning
        if c.refusal is not None:
            delta["refusal"] = c.refusal
        if c.tool_calls is not None:
            delta["tool_calls"] = c.tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = c.text
    choice["logprobs"] = chat_logprobs(c.logprobs) if chat else c.logprobs
    choice["finish_reason"] = None
    return f"{frames.prefix}{json.dumps(choice)}]}}\n\n"


async def _send_tokens(
    send: Send,
    stream: StreamLike,
    first: Chunk,
    frames: SSEFrames,
    chat: bool,
    buf: list[str],
    progress: Progress,
    now: BodyNow | None,
) -> None:
    """Every token as an SSE event: the first at once (after what ``buf`` holds), the rest
    as they come. Leaves ``buf`` holding what is not sent yet (nothing, unless the stream
    failed mid-way)."""
    dumps = json.dumps
    body = "http.response.body"
    piece = frames.piece
    buf.append(side_event(frames, chat, first) if first.has_side else piece % dumps(first.text))
    await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
    progress.t5_ns = time.time_ns()
    progress.streamed = True
    buf.clear()
    if now is None:
        await _send_rest(send, stream, frames, chat, buf)
        return

    def sink(text: str) -> bool:
        return now((piece % dumps(text)).encode())

    stream.push_to(sink)
    try:
        await _send_rest(send, stream, frames, chat, buf)
    finally:
        stream.push_to(None)


async def _send_rest(
    send: Send, stream: StreamLike, frames: SSEFrames, chat: bool, buf: list[str]
) -> None:
    """The tokens after the first, each as it comes, those already here in one write."""
    dumps = json.dumps
    body = "http.response.body"
    piece = frames.piece
    async for c in stream:
        buf.append(side_event(frames, chat, c) if c.has_side else piece % dumps(c.text))
        # The consumer (this writer) is behind: coalesce what is already here into one
        # write instead of one syscall per token.
        while stream.pending():
            try:
                c = await stream.__anext__()
            except StopAsyncIteration:
                break
            buf.append(side_event(frames, chat, c) if c.has_side else piece % dumps(c.text))
        await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
        buf.clear()


# -- response headers and usage -------------------------------------------------------------
def _usage(stream: StreamLike) -> dict[str, Any]:
    """The stream's token counts as OpenAI's ``usage`` object (zeros when unknown)."""
    return (stream.usage or Usage(0, 0, 0)).to_dict()


def latency_headers(stream: StreamLike, t1_ns: int) -> Headers:
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


def limit_headers(stream: StreamLike) -> Headers:
    """Rate-limit headers, and which replica served (``x-tokenbus-replica``)."""
    out = [(k.encode(), v.encode()) for k, v in stream.rate_limits.items()]
    replica = getattr(stream, "replica", None)
    if replica:
        out.append((b"x-tokenbus-replica", str(replica).encode()))
    return out
