"""The OpenAI-compatible HTTP surface (aiohttp), shared by the bridge and the direct server.

Both serve exactly this code; only the :class:`Source` of streams differs (the bus for the
bridge, an engine in-process for ``tokenbus serve openai-http``), so a benchmark of one
against the other measures the bus path and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from aiohttp import web

from bus_schemas import errors as E
from bus_schemas.client import Chunk, Usage
from bus_schemas.subjects import KIND_CHAT, KIND_COMPLETIONS
from services import validation


class StreamLike(Protocol):
    """What a source hands back for one request (:class:`bus_schemas.client.Stream` is one)."""

    request_id: str
    finish_reason: str | None
    usage: Usage | None

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def __anext__(self) -> Chunk: ...

    def pending(self) -> int: ...

    async def aclose(self) -> None: ...


class Source(Protocol):
    """Where generations come from."""

    def open(self, kind: str, req: validation.Request, body: dict[str, Any], *,
             request_id: str, timeout: float, headers: dict[str, str]) -> StreamLike: ...

    def models(self) -> list[str]: ...

    def healthy(self) -> bool: ...

    def ready(self) -> bool: ...


_END = object()


def error_response(err: E.TokenbusError, request_id: str | None = None) -> web.Response:
    """An OpenAI-shaped error with the right status (and Retry-After when retrying helps)."""
    hdrs: dict[str, str] = {}
    if err.retryable:
        hdrs["Retry-After"] = "1"
    if request_id:
        hdrs["x-request-id"] = request_id
    return web.json_response(err.openai_body(), status=E.http_status(err), headers=hdrs)


class OpenAIApp:
    """Routes and handlers of the OpenAI-compatible API over one :class:`Source`."""

    def __init__(self, source: Source, *, max_body_bytes: int, request_timeout_s: float,
                 on_request: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.source = source
        self.max_body = max_body_bytes
        self.timeout = request_timeout_s
        self.on_request = on_request
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/ready", self.ready)
        self.app.middlewares.append(self._errors)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 404:
                err: E.TokenbusError = E.NotFound(f"no route for {request.method} {request.path}")
            elif exc.status == 405:
                err = E.InvalidRequest(f"method {request.method} not allowed on {request.path}")
                return web.json_response(err.openai_body(), status=405)
            elif exc.status == 413:
                err = E.PayloadTooLarge(f"the request body is larger than {self.max_body} bytes")
            else:
                raise
            return error_response(err)

    # -- plain endpoints --------------------------------------------------------------------
    async def list_models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "tokenbus"}
                for m in self.source.models()]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.source.healthy()
        return web.json_response({"status": "ok" if ok else "unhealthy"}, status=200 if ok else 503)

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.source.ready()
        return web.json_response(
            {"status": "ready" if ok else "not ready", "models": self.source.models()},
            status=200 if ok else 503,
        )

    # -- generation -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, KIND_CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, KIND_COMPLETIONS)

    async def _read_json(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.max_body:
            raise E.PayloadTooLarge(f"the request body is larger than {self.max_body} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise E.PayloadTooLarge(f"the request body is larger than {self.max_body} bytes") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise E.InvalidJSON(f"the request body is not valid JSON: {exc}") from None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        t_start = time.perf_counter_ns()
        status = 200
        outcome = "ok"
        stream: StreamLike | None = None
        try:
            body = await self._read_json(request)
            req = validation.parse(kind, body)
            stream = self.source.open(kind, req, body, request_id=rid, timeout=self.timeout,
                                      headers={})
            if req.stream:
                return await self._stream(request, kind, req, stream, rid)
            return await self._whole(kind, req, stream, rid)
        except E.TokenbusError as exc:
            status = E.http_status(exc)
            outcome = exc.code
            return error_response(exc, rid)
        except asyncio.CancelledError:
            outcome = "client_disconnected"
            raise
        finally:
            if stream is not None:
                await stream.aclose()
            if self.on_request is not None:
                self.on_request({"request_id": rid, "kind": kind, "status": status,
                                 "outcome": outcome,
                                 "duration_ms": (time.perf_counter_ns() - t_start) / 1e6})

    async def _whole(self, kind: str, req: validation.Request, stream: StreamLike,
                     rid: str) -> web.Response:
        parts = [c.text async for c in stream]
        text = "".join(parts)
        u = stream.usage or Usage(0, 0, 0)
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                 "total_tokens": u.total_tokens}
        finish = stream.finish_reason or "stop"
        created = int(time.time())
        if kind == KIND_CHAT:
            out: dict[str, Any] = {
                "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": usage,
            }
        else:
            out = {
                "id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": req.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
            }
        return web.json_response(out, headers={"x-request-id": rid})

    async def _stream(self, request: web.Request, kind: str, req: validation.Request,
                      stream: StreamLike, rid: str) -> web.StreamResponse:
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
            head = (f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                    f'"created":{created},"model":{model},"choices":[{{"index":0,')
            piece = head + '"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n'
            opening = head + ('"delta":{"role":"assistant","content":""},"logprobs":null,'
                              '"finish_reason":null}]}\n\n')
            closing = head + '"delta":{},"logprobs":null,"finish_reason":%s}]}\n\n'
            usage_line = (f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                          f'"created":{created},"model":{model},"choices":[],"usage":%s}}\n\n')
        else:
            head = (f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                    f'"created":{created},"model":{model},"choices":[{{"index":0,')
            piece = head + '"text":%s,"logprobs":null,"finish_reason":null}]}\n\n'
            opening = ""
            closing = head + '"text":"","logprobs":null,"finish_reason":%s}]}\n\n'
            usage_line = (f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                          f'"created":{created},"model":{model},"choices":[],"usage":%s}}\n\n')
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "x-request-id": rid,
        })
        await resp.prepare(request)
        buf: list[str] = [opening] if opening else []
        dumps = json.dumps
        try:
            if first is not _END:
                buf.append(piece % dumps(first.text))
                await resp.write("".join(buf).encode())
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
                    await resp.write("".join(buf).encode())
                    buf.clear()
            buf.append(closing % dumps(stream.finish_reason or "stop"))
            if req.include_usage:
                u = stream.usage or Usage(0, 0, 0)
                buf.append(usage_line % dumps({"prompt_tokens": u.prompt_tokens,
                                               "completion_tokens": u.completion_tokens,
                                               "total_tokens": u.total_tokens}))
            buf.append("data: [DONE]\n\n")
            await resp.write("".join(buf).encode())
        except E.TokenbusError as exc:
            # Headers are gone: the error travels as an SSE event, as OpenAI's API does.
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(("".join(buf) + f"data: {dumps(exc.openai_body())}\n\n"
                                  "data: [DONE]\n\n").encode())
        except (ConnectionError, RuntimeError):
            pass  # the client went away; the caller's finally cancels the generation
        return resp


async def serve(app: web.Application, host: str, port: int, *, reuse_port: bool,
                shutdown_timeout: float) -> web.AppRunner:
    """Start ``app`` (handlers are cancelled when their client disconnects)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=4096)
    await site.start()
    return runner
