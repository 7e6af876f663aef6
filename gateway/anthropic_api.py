"""Anthropic's Messages API over HTTP: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``, so that Claude Code and the ``anthropic`` SDK talk to
tokenbus.

A request is translated onto the chat path (:mod:`dialects.anthropic`) and opened on the
app's :class:`~gateway.openai_api.Source` exactly as a chat completion is, through the same
scaffold (:meth:`OpenAIApp.handle`), so keys, limits, the content filter, routing,
migration, telemetry and traces are the chat path's. What differs is the key's header
(``x-api-key`` as well as ``Authorization: Bearer``), the error shape (Anthropic's, with the
same statuses) and what goes back: a ``message``, or Anthropic's streaming events
(docs/anthropic.md).
"""

from __future__ import annotations

import json
import time
from typing import Any

from bus_schemas import errors as E
from bus_schemas.subjects import KIND_CHAT
from dialects import anthropic as M
from gateway import validation
from gateway.asgi import Headers, Message, Receive, Scope, Send, header, send_json
from gateway.openai_api import Call, OpenAIApp
from gateway.sse import (
    StreamLike,
    builder_events,
    builder_sink,
    first_chunk,
    latency_headers,
    limit_headers,
    named,
    pump,
    start_sse,
)
from services import tracing

PREFIX = "/v1/messages"
COUNT = PREFIX + "/count_tokens"
KIND = "messages"  # the kind in the bridge's metrics and request log
KIND_COUNT = "messages.count_tokens"


def with_api_key(scope: Scope) -> Scope:
    """The request with Anthropic's ``x-api-key`` read as the key (``Authorization: Bearer``,
    what Claude Code sends with ANTHROPIC_AUTH_TOKEN, works as on every endpoint)."""
    key = header(scope, b"x-api-key")
    if not key:
        return scope
    kept = [(k, v) for k, v in scope.get("headers") or () if k != b"authorization"]
    return {**scope, "headers": [*kept, (b"authorization", b"Bearer " + key.encode("latin-1"))]}


def anthropic_errors(send: Send) -> Send:
    """``send`` with every error response (an OpenAI-shaped JSON body, 4xx or 5xx) rewritten
    in Anthropic's shape, the status kept."""
    held: list[Message] = []

    async def out(msg: Message) -> None:
        if msg["type"] == "http.response.start" and msg["status"] >= 400:
            held.append(msg)
            return
        if held and msg["type"] == "http.response.body":
            start = held.pop()
            status = int(start["status"])
            try:
                err = json.loads(msg.get("body") or b"{}").get("error") or {}
            except ValueError:
                err = {}
            rid = next((v.decode() for k, v in start["headers"] if k == b"x-request-id"), None)
            body = json.dumps(M.error_body(status, str(err.get("message", "error")), rid)).encode()
            hdrs: Headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            hdrs.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": hdrs})
            await send({"type": "http.response.body", "body": body})
            return
        await send(msg)

    return out


class MessagesAPI:
    """The Messages API's handlers on an :class:`OpenAIApp` (``mount`` adds its routes)."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app

    def mount(self) -> None:
        """``/v1/messages`` and everything below it."""
        self.app.add_prefix(PREFIX, self.route)

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/messages``, ``POST /v1/messages/count_tokens``; anything else below
        ``/v1/messages`` (message batches) is 404, another method 405, in Anthropic's shape."""
        scope = with_api_key(scope)
        send = anthropic_errors(send)
        path, method = scope["path"].rstrip("/"), scope["method"]
        if path in (PREFIX, COUNT) and method == "POST":
            kind, serve = (KIND, self._create) if path == PREFIX else (KIND_COUNT, self._count)
            await self.app.handle(scope, receive, send, kind, serve)
        elif path in (PREFIX, COUNT):
            await send_json(send, 405, M.error_body(405, f"method {method} not allowed on {path}"))
        else:
            why = "message batches are not served by tokenbus" if "/batches" in path else "no route"
            await send_json(send, 404, M.error_body(404, f"{why}: {method} {path}"))

    def _open(self, call: Call, chat_body: dict[str, Any], streamed: bool) -> StreamLike:
        chat = validation.parse(KIND_CHAT, chat_body)
        if call.span is not None:
            call.span.set_attribute(tracing.MODEL, chat.model)
        call.watch()
        call.whole(streamed)
        stream = call.stream = self.app.source.open(
            KIND_CHAT,
            chat,
            chat_body,
            request_id=call.rid,
            timeout=call.timeout or self.app.timeout,
            headers=call.hdrs,
            principal=call.principal,
        )
        return stream

    async def _create(self, call: Call, send: Send) -> None:
        await self.app.files.messages(call.body, self.app.owner_of(call))
        req = M.parse(call.body)
        meta = call.body.get("metadata") if isinstance(call.body, dict) else None
        if isinstance(meta, dict):
            call.session_from(meta.get("user_id"))  # Claude Code: its user and session
        stream = self._open(call, M.translate(req, call.body), bool(req.stream))
        b = M.MessageBuilder(req.model, events=bool(req.stream), stop_sequences=req.stop_sequences)
        if req.stream:
            await self._write_sse(send, b, stream, call)
            return
        async for c in stream:
            b.add(c)
        msg, _ = b.finish(
            stream.finish_reason, stream.usage, stream.stop_sequence, stream.service_tier
        )
        await self._send_whole(send, msg, stream, call)

    async def _count(self, call: Call, send: Send) -> None:
        await self.app.files.messages(call.body, self.app.owner_of(call))
        req = M.parse(call.body, count=True)
        stream = self._open(call, M.count_request(M.translate(req, call.body)), False)
        async for _ in stream:
            pass
        await self._send_whole(
            send, {"input_tokens": stream.usage.prompt_tokens if stream.usage else 0}, stream, call
        )

    async def _send_whole(
        self, send: Send, obj: dict[str, Any], stream: StreamLike, call: Call
    ) -> None:
        progress = call.progress
        progress.finished = True
        progress.t5_ns = time.time_ns()
        rid = call.rid.encode()
        await send_json(
            send,
            200,
            obj,
            [
                (b"x-request-id", rid),
                (b"request-id", rid),
                *limit_headers(stream),
                *latency_headers(stream, progress.t1_ns),
            ],
        )

    async def _write_sse(
        self, send: Send, b: M.MessageBuilder, stream: StreamLike, call: Call
    ) -> None:
        # The first frame before the headers, so that errors before generation (unknown
        # model, no replica, a refused key) still get their own HTTP status.
        first = await first_chunk(stream)
        progress, rid = call.progress, call.rid.encode()
        progress.started = True
        await start_sse(send, call.rid, stream, [(b"request-id", rid)])
        buf = [named(ev) for ev in b.opening()]
        body = "http.response.body"
        try:
            if first is not None:
                sink = None if call.now is None else builder_sink(b, call.now)
                await pump(send, stream, first, builder_events(b), buf, progress, sink)
            _, events = b.finish(
                stream.finish_reason, stream.usage, stream.stop_sequence, stream.service_tier
            )
            buf.extend(named(ev) for ev in events)
        except E.TokenbusError as exc:
            # The headers are gone: the failure is an `error` event, which ends the stream.
            buf.extend(named(ev) for ev in b.fail(exc))
            progress.error = exc.code
        progress.finished = True
        await send({"type": body, "body": "".join(buf).encode(), "more_body": False})
