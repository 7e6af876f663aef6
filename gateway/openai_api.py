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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import marks
from bus_schemas.messages import ChatCompletionRequest, CompletionRequest
from bus_schemas.side_outputs import LOGPROBS, REASONING, REFUSAL, TOOL_CALLS
from bus_schemas.subjects import KIND_CHAT, KIND_COMPLETIONS, KIND_EMBEDDINGS
from gateway import validation
from gateway.asgi import (
    BODY_NOW,
    JSON_HEADERS,
    RECEIVED_NS,
    BodyNow,
    Receive,
    RouteTable,
    Scope,
    Send,
    api_key,
    bus_headers,
    header,
    read_body,
    send_error,
    send_json,
)
from gateway.file_inputs import FileInputs
from gateway.openapi import document_bytes
from gateway.sse import (
    DONE,
    SSE_HEADERS,
    Progress,
    StreamLike,
    chat_logprobs,
    first_chunk,
    latency_headers,
    limit_headers,
    side_event,
    sse_error,
    sse_frames,
    usage_of,
    write_sse,
)
from gateway.validation import Choosing, client_label
from jobs.inprocess import BACKGROUND, PRINCIPAL, RERUN, TIMEOUT
from services import logging as tlog
from services import tracing
from services.caller import Assembled, Chunk, Rerun, Usage

log = tlog.get("bridge")


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
        # Files named by id in a request (gateway/file_inputs.py): the bridge gives it the
        # file store and who owns a key's files where it serves the Files API.
        self.files = FileInputs(None, max_body_bytes)
        self.key_owner: Callable[[str | None], str] = lambda key: ""

    def owner_of(
        self, call: Call, key_owner: Callable[[str | None], str] | None = None
    ) -> Callable[[], str]:
        """Who ``call`` acts for (the key a trusted caller here runs it for, else the id of
        its own key by ``key_owner``, this app's by default), asked only when needed."""
        if call.principal is not None:
            principal = call.principal
            return lambda: principal
        owner = key_owner or self.key_owner
        return lambda: owner(call.hdrs.get(H.API_KEY))

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
        adapter_of = getattr(self.source, "adapter_of", None)
        for m, target in models.items():
            entry: dict[str, Any] = {"id": m, "object": "model", "created": now}
            entry["owned_by"] = "tokenbus"
            if target:
                entry["alias_of"] = target
            # A LoRA adapter loaded at run time, as vLLM lists one: its path and base model.
            if adapter_of is not None and (held := adapter_of(m)) is not None:
                entry["parent"], entry["root"] = held
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
        if call.kind == KIND_CHAT:
            await self.files.chat(call.body, self.owner_of(call))
        req = validation.parse(call.kind, call.body)
        if call.kind == KIND_CHAT:
            call.session_from(call.body.get("prompt_cache_key"))
        if call.span is not None:
            call.span.set_attribute(tracing.MODEL, req.model)
        call.watch()
        call.whole(bool(getattr(req, "stream", False)))
        if isinstance(req, Choosing):
            parts = validation.per_choice(req, call.body)
            if len(parts) > 1 or not getattr(req, "generates", True):
                await self._choices(call, send, req, parts)
                return
        stream = call.stream = self.source.open(
            call.kind,
            req,
            call.body,
            request_id=call.bus_rid,
            timeout=call.timeout or self.timeout,
            headers=call.hdrs,
            principal=call.principal,
        )
        if call.kind == KIND_EMBEDDINGS:
            await write_embeddings(send, req, stream, call.rid, call.progress)
        elif req.stream:
            await write_sse(send, call.kind, req, stream, call.rid, call.progress, call.now)
        else:
            await write_whole(send, call.kind, req, stream, call.rid, call.progress)

    async def _choices(
        self,
        call: Call,
        send: Send,
        req: Choosing,
        parts: list[tuple[Choosing, dict[str, Any]]],
    ) -> None:
        """A request the bus takes as several (:func:`validation.per_choice`): one
        generation per prompt and choice, each answer choice ``i`` of one
        ``chat.completion`` or ``text_completion`` (as OpenAI and vLLM answer ``n`` and a
        list of prompts), usage summed (a prompt counted once for its choices); with
        ``max_tokens: 0`` each choice is its prompt (``echo``) or nothing, finished by
        ``length``. Each choice is a request of its own on the bus: limits and budgets count
        it (docs/openai-api.md)."""
        streams: list[StreamLike] = []
        for i, (one, body) in enumerate(parts):
            rid = call.bus_rid if len(parts) == 1 else f"{call.bus_rid}-{i}"
            stream = self.source.open(
                call.kind,
                one,
                body,
                request_id=rid,
                timeout=call.timeout or self.timeout,
                headers=call.hdrs,
                principal=call.principal,
            )
            # The first is the request's in the metrics and the trace; each is closed.
            if call.stream is None:
                call.stream = stream
            else:
                call.more.append(stream)
            if isinstance(req, CompletionRequest) and not req.generates:
                assert isinstance(one, CompletionRequest)
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
        # The request's id on the bus is ours, unique per request (issue 64: limits, holds
        # and charges are keyed by it); the client's X-Request-Id is a label, echoed back.
        label = client_label(header(scope, b"x-request-id"))
        bus_rid = marks.new_request_id()
        rid = label or bus_rid
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
        if label:
            hdrs[H.CLIENT_REQUEST_ID] = label
        call = Call(kind, rid, hdrs, progress, span, receive, scope.get(BODY_NOW), bus_rid)
        call.principal = scope.get(PRINCIPAL)
        call.background = scope.get(BACKGROUND)
        call.rerun = scope.get(RERUN)
        call.timeout = float(scope.get(TIMEOUT) or 0)
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
                self.on_request(
                    _record(bus_rid, kind, status, outcome, t_start, progress, stream, label)
                )
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
    bus_rid: str  # the request's id on the bus (``rid`` is what the client is shown)
    body: Any = None
    stream: StreamLike | None = None
    more: list[StreamLike] = field(default_factory=list)  # a request's other streams
    watcher: asyncio.Task[None] | None = None
    # The key a trusted caller in this process runs the request for (scope[PRINCIPAL]).
    principal: str | None = None
    # The background response this request runs (scope[BACKGROUND]), and which run of it
    # this is (scope[RERUN]).
    background: str | None = None
    rerun: Rerun | None = None
    # Its own time limit, where a trusted caller in this process sets one (scope[TIMEOUT]:
    # a background response's, a batch line's); 0: the bridge's request timeout.
    timeout: float = 0.0

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
    label: str | None = None,
) -> dict[str, Any]:
    """What ``on_request`` gets about one finished generation request (the bridge's metrics,
    log line and telemetry record are made from it)."""
    return {
        "request_id": rid,
        "client_request_id": label,
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
    usage = usage_of(stream)
    created = int(time.time())
    if kind == KIND_CHAT:
        return {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [chat_choice(0, out, stream)],
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


def chat_choice(index: int, out: Assembled, stream: StreamLike) -> dict[str, Any]:
    """Choice ``index`` of a whole ``chat.completion``."""
    text, calls = out.text, out.tool_calls
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if (calls or out.refusal) and not text else text,
        REFUSAL.chat: out.refusal,
    }
    if calls:
        message[TOOL_CALLS.chat] = calls
    if out.reasoning is not None:
        message[REASONING.chat] = out.reasoning
    return {
        "index": index,
        "message": message,
        LOGPROBS.choice: chat_logprobs(out.logprobs),
        "finish_reason": stream.finish_reason or "stop",
    }


def _tier(stream: StreamLike) -> dict[str, str]:
    """``service_tier``: the class that served the answer (engine_worker/flow.py); chat
    only (OpenAI's text_completion has none)."""
    tier = getattr(stream, "service_tier", None)
    return {"service_tier": tier} if tier else {}


def text_choice(index: int, out: Assembled, stream: StreamLike) -> dict[str, Any]:
    """Choice ``index`` of a whole ``text_completion``."""
    finish = stream.finish_reason or "stop"
    return {
        "index": index,
        "text": out.text,
        LOGPROBS.choice: out.logprobs,
        "finish_reason": finish,
    }


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


def _usage_total(streams: list[StreamLike], n: int = 1) -> dict[str, Any]:
    """The usage of several streams added up (the counts inside the details too); of
    each prompt's ``n`` choices, the prompt counted once (as OpenAI counts ``n``)."""
    total: dict[str, Any] = {}
    for i, s in enumerate(streams):
        u = usage_of(s)
        if i % n:  # another choice of the same prompt: its answer only
            answer = u.get("completion_tokens", 0)
            details = u.get("completion_tokens_details")
            u = {"completion_tokens": answer, "total_tokens": answer}
            if isinstance(details, dict):
                u["completion_tokens_details"] = details
        _add_counts(total, u)
    return total


def kind_of(req: Choosing) -> str:
    """The request kind of a chat or completions request."""
    return KIND_CHAT if isinstance(req, ChatCompletionRequest) else KIND_COMPLETIONS


def _add_counts(into: dict[str, Any], more: dict[str, Any]) -> None:
    for k, v in more.items():
        if isinstance(v, dict):
            _add_counts(into.setdefault(k, {}), v)
        elif isinstance(v, int) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v


async def write_choices(
    send: Send, req: Choosing, streams: list[StreamLike], rid: str, progress: Progress
) -> None:
    """One ``chat.completion`` or ``text_completion`` whose choice ``i`` is stream ``i``'s
    whole answer."""
    kind = kind_of(req)
    outs: list[Assembled] = await _all([_assemble(s) for s in streams])
    body = whole_answer(kind, rid, req.model, outs[0], streams[0])
    choice = chat_choice if kind == KIND_CHAT else text_choice
    body["choices"] = [
        choice(i, out, s) for i, (out, s) in enumerate(zip(outs, streams, strict=True))
    ]
    body["usage"] = _usage_total(streams, req.choices)
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
    send: Send, req: Choosing, streams: list[StreamLike], rid: str, progress: Progress
) -> None:
    """Several streams as one event stream, each event the choice of its stream's index,
    as they come (a chat choice opens with its role); each choice's closing event when its
    stream ends, then the usage of all (when asked for) and ``[DONE]``. Headers go once
    every stream has its first chunk, so a refusal of any is the request's HTTP status."""
    firsts: list[Chunk | None] = await _all([first_chunk(s) for s in streams])
    created = int(time.time())
    kind = kind_of(req)
    chat = kind == KIND_CHAT
    tier = getattr(streams[0], "service_tier", None)
    frames = [sse_frames(kind, rid, req.model, created, i, tier) for i in range(len(streams))]
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
    buf: list[str] = [f.opening for f in frames if f.opening]
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
                buf.append(side_event(frames[i], chat, c))
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
            buf.append(frames[0].usage % json.dumps(_usage_total(streams, req.choices)))
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
