"""Streamed answers over HTTP: what a stream is to a handler (:class:`StreamLike`), the
headers every answer carries, and server-sent events: the OpenAI writer (:func:`write_sse`,
one ``%`` template a token) and the pump the other dialects write their events with
(:func:`pump`).

Every API's handler (``openai_api``, ``messages``, ``responses``) writes its stream with
these; only the events differ.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from bus_schemas import errors as E
from bus_schemas.side_outputs import CHAT_DELTA
from bus_schemas.subjects import KIND_CHAT
from gateway import validation
from gateway.asgi import BodyNow, Headers, Send
from services.caller import Chunk, Usage


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


def chat_logprobs(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat choice's logprobs as OpenAI writes them: ``content`` and ``refusal`` both
    present (null where the engine sent none, as vLLM does for ``refusal``)."""
    if lp is None or ("content" in lp and "refusal" in lp):
        return lp
    return {"content": None, "refusal": None, **lp}


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
    await start_sse(send, rid, stream)
    buf: list[str] = [frames.opening] if frames.opening else []
    try:
        if first is not None:
            dumps, piece = json.dumps, frames.piece

            def events(c: Chunk, buf: list[str]) -> None:
                buf.append(side_event(frames, chat, c) if c.has_side else piece % dumps(c.text))

            sink = None if now is None else _piece_sink(now, piece)
            await pump(send, stream, first, events, buf, progress, sink)
        buf.append(frames.closing % json.dumps(stream.finish_reason or "stop"))
        if req.include_usage:
            buf.append(frames.usage % json.dumps(usage_of(stream)))
    except E.TokenbusError as exc:
        # Headers are gone: the error travels as an SSE event, as OpenAI's API does.
        buf.append(sse_error(exc))
        progress.error = exc.code
    buf.append(DONE)
    progress.finished = True
    await send({"type": "http.response.body", "body": "".join(buf).encode(), "more_body": False})


def _piece_sink(now: BodyNow, piece: str) -> Callable[[str], bool]:
    """:func:`pump`'s ``sink`` of an OpenAI stream: a token's event written at once."""
    dumps = json.dumps
    return lambda text: now((piece % dumps(text)).encode())


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
        for s in CHAT_DELTA:
            value = getattr(c, s.name)
            if value is not None:
                delta[s.chat] = value
        choice["delta"] = delta
    else:
        choice["text"] = c.text
    choice["logprobs"] = chat_logprobs(c.logprobs) if chat else c.logprobs
    choice["finish_reason"] = None
    return f"{frames.prefix}{json.dumps(choice)}]}}\n\n"


async def start_sse(
    send: Send, rid: str, stream: StreamLike | None = None, more: Headers | None = None
) -> None:
    """The head of an event stream: its headers, the request id, ``more``, the stream's
    rate-limit headers."""
    headers = [*SSE_HEADERS, (b"x-request-id", rid.encode()), *(more or [])]
    if stream is not None:
        headers.extend(limit_headers(stream))
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def pump(
    send: Send,
    stream: StreamLike,
    first: Chunk,
    events: Callable[[Chunk, list[str]], None],
    buf: list[str],
    progress: Progress,
    sink: Callable[[str], bool] | None = None,
) -> None:
    """A stream's chunks as server-sent events: ``first``'s at once (after what ``buf``
    holds), the rest as they come, those already here in one write. ``events`` appends a
    chunk's event text to ``buf``; with ``sink``, plain text the stream delivers while this
    task waits goes out through it (``push_to``), without a turn of this task per token.
    Leaves ``buf`` holding what is not sent yet (nothing, unless the stream failed)."""
    body = "http.response.body"
    events(first, buf)
    await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
    progress.t5_ns = time.time_ns()
    progress.streamed = True
    buf.clear()
    if sink is not None:
        stream.push_to(sink)
    try:
        async for c in stream:
            # The sink writes past ``buf``: only while ``buf`` is empty. A chunk pending may
            # not be text (an accept, a keepalive, the frame that moves the stream to another
            # replica), and the read below then waits for the next attempt's text, which the
            # sink would have written ahead of this chunk (a CI run's answer had a word out
            # of place after a node partition).
            if sink is not None:
                stream.push_to(None)
            events(c, buf)
            # The consumer (this writer) is behind: coalesce what is already here into one
            # write instead of one syscall per token.
            while stream.pending():
                try:
                    c = await stream.__anext__()
                except StopAsyncIteration:
                    return  # the end came too: ``buf`` goes with the closing events
                events(c, buf)
            await send({"type": body, "body": "".join(buf).encode(), "more_body": True})
            buf.clear()
            if sink is not None:
                stream.push_to(sink)
    finally:
        if sink is not None:
            stream.push_to(None)


# -- named events (the Responses and Messages dialects) ---------------------------------------
def named(ev: dict[str, Any]) -> str:
    """One named event (``event: <type>``) as server-sent event text."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


class EventBuilder(Protocol):
    """A dialect's builder of streamed events (:class:`dialects.responses.ResponseBuilder`,
    :class:`dialects.anthropic.MessageBuilder`)."""

    def text_sse(self, text: str) -> str | None:
        """A plain text delta's events as SSE text; None where it needs :meth:`add`."""

    def add(self, c: Chunk) -> list[dict[str, Any]]:
        """A chunk's events."""


def builder_events(b: EventBuilder) -> Callable[[Chunk, list[str]], None]:
    """:func:`pump`'s ``events`` for a dialect's builder: a plain text delta through its
    fast path (:meth:`EventBuilder.text_sse`), anything else as the events it makes."""

    def events(c: Chunk, buf: list[str]) -> None:
        if c.text and not c.has_side:
            text = b.text_sse(c.text)
            if text is not None:
                buf.append(text)
                return
        buf.extend(named(ev) for ev in b.add(c))

    return events


def builder_sink(b: EventBuilder, now: BodyNow) -> Callable[[str], bool]:
    """:func:`pump`'s ``sink`` for a dialect's builder: a plain text delta's events written
    at once, as :func:`builder_events` would write them; False, with the builder untouched,
    when they cannot go out now."""

    def sink(text: str) -> bool:
        if not text:
            return True  # no event, as in builder_events
        if not now.ready():
            return False
        out = b.text_sse(text)
        if out is None:
            out = "".join(named(ev) for ev in b.add(Chunk(text, 1, 0)))
        return now(out.encode())

    return sink


# -- response headers and usage -------------------------------------------------------------
def usage_of(stream: StreamLike) -> dict[str, Any]:
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
