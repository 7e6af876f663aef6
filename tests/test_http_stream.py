"""The ``openai`` backend's push-style HTTP client against raw servers: every framing an
upstream may use, connection reuse, and every malformed answer ends as a typed error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.http_stream import Response, SSEParser, UpstreamClosed, UpstreamHTTP
from engine_worker.backends.openai_upstream import OpenAIUpstreamBackend
from services.config import OpenAIUpstreamSettings, WorkerSettings
from tests.support.waits import wait_for

pytestmark = pytest.mark.unit

Answer = Callable[[bytes], bytes]  # the request's bytes -> what the server writes back


def _event(text: str | None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


SSE = _event("Hi") + _event(" there") + _event(None, "stop") + b"data: [DONE]\n\n"


def _chunked(body: bytes, size: int = 5) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class RawServer:
    """Answers each request on a connection with ``answer(request)``; counts connections."""

    def __init__(self, answer: Answer, *, close_after: bool = False, split: int = 0) -> None:
        self.answer = answer
        self.close_after = close_after
        self.split = split  # write in pieces this small (0: at once)
        self.connections = 0
        self.open: set[asyncio.StreamWriter] = set()  # connections not yet shut
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open.add(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await r.readexactly(length)
                self.requests.append(request)
                out = self.answer(request)
                if self.split:
                    for i in range(0, len(out), self.split):
                        w.write(out[i : i + self.split])
                        await w.drain()
                        await asyncio.sleep(0)
                else:
                    w.write(out)
                await w.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()
            with contextlib.suppress(Exception):  # a peer that stopped reading: bounded
                await asyncio.wait_for(w.wait_closed(), 5)
            self.open.discard(w)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    servers: list[RawServer] = []
    backends: list[OpenAIUpstreamBackend] = []

    async def make(
        answer: Answer | None = None, *, srv: RawServer | None = None, **kw: Any
    ) -> tuple[Any, OpenAIUpstreamBackend]:
        if srv is None:
            assert answer is not None
            srv = RawServer(answer, **kw)
        url = await srv.start()
        cfg = WorkerSettings(
            backend="openai",
            model="m",
            max_model_len=4096,
            # No capability probe (tests/test_upstream_caps.py has them): its requests would
            # go on connections of their own, and these answers are streams whatever asked.
            openai=OpenAIUpstreamSettings(
                upstream_url=url, api_key="sk-up", timeout_s=5, probe=False
            ),
        )
        b = OpenAIUpstreamBackend(cfg)
        await b.start()
        # The backend's start asks the upstream's /models on a connection of its own (the
        # model check): the counts below are of the streamed completions' connections.
        srv.connections = 0
        srv.requests.clear()
        servers.append(srv)
        backends.append(b)
        return srv, b

    yield make
    for b in backends:
        await b.stop()
    for s in servers:
        await s.stop()


def chat(**kw: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", kind="chat", model="m", max_tokens=8, messages=[{"role": "user"}], **kw
    )


async def pushed(b: OpenAIUpstreamBackend, req: GenerationRequest | None = None) -> list[Delta]:
    out: list[Delta] = []
    await b.generate(req or chat()).push(out.append)
    return out


ERROR_400 = json.dumps({"error": {"message": "no such model", "param": "model"}}).encode()


def _answer(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d Bad\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)


def ok(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%s\r\n%s" % (
        b"".join(h + b"\r\n" for h in headers),
        body,
    )


@pytest.mark.parametrize(
    "answer",
    [
        lambda _: ok(_chunked(SSE), b"Transfer-Encoding: chunked"),
        lambda _: ok(SSE, b"Content-Length: %d" % len(SSE)),
        # An interim answer first, and chunks of one byte each.
        lambda _: (
            b"HTTP/1.1 100 Continue\r\n\r\n" + ok(_chunked(SSE, 1), b"Transfer-Encoding: chunked")
        ),
    ],
    ids=["chunked", "content-length", "interim-and-1-byte-chunks"],
)
@pytest.mark.parametrize("split", [0, 3])
async def test_framings_stream_the_same_deltas_and_reuse_one_connection(
    serve: Callable[..., Any], answer: Answer, split: int
) -> None:
    srv, b = await serve(answer, split=split)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for _ in range(3):
        deltas = await pushed(b, chat(trace_headers={"traceparent": tp}))
        assert [(d.text, d.finish_reason) for d in deltas] == [
            ("Hi", None),
            (" there", None),
            ("", "stop"),
        ]
        assert deltas[-1].completion_tokens == 2
    assert srv.connections == 1  # kept alive and reused
    request = srv.requests[0]
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sk-up\r\n" in request
    assert b"\r\nUser-Agent: tokenbus-worker\r\n" in request
    assert f"\r\ntraceparent: {tp}\r\n".encode() in request  # the upstream continues the trace
    sent = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert sent["stream"] is True and sent["max_tokens"] == 8
    assert b.stats()["running"] == 0


async def test_a_body_read_to_close_and_a_closing_upstream(serve: Callable[..., Any]) -> None:
    # No length, no chunks: the body ends when the upstream closes (HTTP/1.0 style), and a
    # connection the upstream closes is never reused.
    srv, b = await serve(lambda _: ok(SSE, b"Connection: close"), close_after=True)
    for _ in range(2):
        deltas = await pushed(b)
        assert deltas[-1].finish_reason == "stop" and deltas[0].text == "Hi"
    assert srv.connections == 2


async def test_events_with_python_style_nan_and_infinity_still_parse(
    serve: Callable[..., Any],
) -> None:
    # Events are parsed with orjson, which takes strict JSON only; an upstream written in
    # Python may send a logprob as -Infinity or a score as NaN, which its encoder allows.
    # Those events are read by the standard library's parser instead, not refused.
    odd = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null,'
        b' "logprobs": {"content": [{"token": "Hi", "logprob": -Infinity}]}}], "x": NaN}\n\n'
    )
    body = odd + _event(None, "stop") + b"data: [DONE]\n\n"
    _, b = await serve(lambda _: ok(body, b"Content-Length: %d" % len(body)))
    deltas = await pushed(b)
    assert [(d.text, d.finish_reason) for d in deltas] == [("Hi", None), ("", "stop")]


async def test_a_kept_connection_the_upstream_closed_is_retried_on_a_new_one(
    serve: Callable[..., Any],
) -> None:
    srv, b = await serve(lambda _: ok(SSE, b"Content-Length: %d" % len(SSE)), close_after=True)
    # The upstream said nothing of closing; it closes after each answer anyway.
    assert (await pushed(b))[-1].finish_reason == "stop"
    # The upstream has shut the connection (its socket closed) before the next request.
    await wait_for(lambda: not srv.open, timeout=10, what="the upstream kept its connection")
    assert (await pushed(b))[-1].finish_reason == "stop"
    assert srv.connections == 2


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (lambda _: b"SSH-2.0-OpenSSH\r\n\r\n", E.EngineError, "not an HTTP/1.x answer"),
        (lambda _: b"HTTP/1.1 abc OK\r\n\r\n", E.EngineError, "a bad status line"),
        (
            lambda _: ok(b"zz\r\nxx\r\n", b"Transfer-Encoding: chunked"),
            E.EngineError,
            "malformed chunk",
        ),
        (
            lambda _: ok(b"data: {not json}\n\n", b"Content-Length: 18"),
            E.EngineError,
            "malformed event",
        ),
        (lambda _: ok(b"data: [1]\n\n", b"Content-Length: 11"), E.EngineError, "not an object"),
        (lambda _: ok(b"", b"Content-Length: -4"), E.EngineError, "bad Content-Length"),
        (lambda _: ok(_event("a"), b"Content-Length: 500"), E.EngineError, "closed"),
        (lambda _: _answer(400, ERROR_400), E.InvalidRequest, "no such model"),
        (
            lambda _: b"HTTP/1.1 503 Unavailable\r\nContent-Length: 4\r\n\r\nbusy",
            E.EngineError,
            "503: busy",
        ),
        (lambda _: ok(SSE[:20], b"Connection: close"), E.EngineError, "malformed event"),
    ],
    ids=[
        "not-http",
        "bad-status",
        "bad-chunk-size",
        "event-not-json",
        "event-not-object",
        "negative-length",
        "cut-short",
        "400-json",
        "503-text",
        "closed-mid-event",
    ],
)
async def test_malformed_answers_end_as_typed_errors(
    serve: Callable[..., Any], answer: Answer, error: type[E.TokenbusError], match: str
) -> None:
    srv, b = await serve(answer, close_after=True)
    with pytest.raises(error, match=match):
        await pushed(b)
    assert b.stats()["running"] == 0
    # The backend serves the next request on a new connection.
    srv.answer = lambda _: ok(SSE, b"Content-Length: %d" % len(SSE))
    assert (await pushed(b))[-1].finish_reason == "stop"


async def test_a_silent_upstream_times_out(serve: Callable[..., Any]) -> None:
    _srv, b = await serve(lambda _: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    b.timeout = 0.3
    with pytest.raises(E.EngineError, match="TimeoutError"):
        await pushed(b)
    assert b.stats()["running"] == 0


async def test_a_sink_that_stops_aborts_the_upstream(serve: Callable[..., Any]) -> None:
    # The worker's sink answers True when the output is blocked: the answer is cut there.
    srv, b = await serve(lambda _: ok(_chunked(SSE), b"Transfer-Encoding: chunked"), split=7)
    got: list[Delta] = []

    def sink(d: Delta) -> bool:
        got.append(d)
        return True

    await b.generate(chat()).push(sink)
    assert [d.text for d in got] == ["Hi"]
    assert (await pushed(b))[-1].finish_reason == "stop"
    assert srv.connections == 2  # the cut connection was not reused


async def test_unreachable_and_closed() -> None:
    http = UpstreamHTTP("http://127.0.0.1:9/v1", {})
    with pytest.raises(OSError):
        await http.post("/x", b"{}", {}, Response())
    with pytest.raises(ValueError, match="not an http"):
        UpstreamHTTP("ftp://host/v1", {})
    assert issubclass(UpstreamClosed, ConnectionError)


def test_sse_parser_splits_events_anywhere() -> None:
    got: list[bytes] = []
    p = SSEParser(got.append)
    raw = b": comment\r\n\r\ndata: a\r\ndata:b\r\nevent: x\r\n\r\ndata: [DONE]\n\ndata: tail"
    for i in range(len(raw)):
        p.feed(raw[i : i + 1])
    p.close()
    assert got == [b"a\nb", b"[DONE]", b"tail"]


class GatedServer(RawServer):
    """Answers each streamed request with its first event at once and the rest, with the
    answer's end, in one write once the test opens ``go`` (a new gate per request)."""

    def __init__(self) -> None:
        super().__init__(lambda _: b"")
        self.gates: list[asyncio.Event] = []
        self.written = 0  # answers written whole

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        first, rest = _event("a"), _event("b") + _event("c") + _event(None, "stop")
        rest += b"data: [DONE]\n\n"
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await r.readexactly(length)
                gate = asyncio.Event()
                self.gates.append(gate)
                w.write(ok(first, b"Content-Length: %d" % (len(first) + len(rest))))
                await w.drain()
                await gate.wait()
                w.write(rest)
                await w.drain()
                self.written += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


def _reading(c: Any) -> bool:
    """Whether the connection the completion ``c`` is relayed on reads."""
    return bool(c._answer.conn.transport.is_reading())


def _paused_at_first(c: Any, srv: GatedServer, got: list[Delta]) -> Callable[[Delta], bool]:
    """A sink for the completion ``c`` that keeps its deltas in ``got`` and, at the first,
    pauses ``c``'s reading and opens the gate: the rest is written while it reads nothing."""

    def sink(d: Delta) -> bool:
        got.append(d)
        if len(got) == 1:
            c.pause_reading()
            srv.gates[-1].set()
        return False

    return sink


async def test_a_paused_answer_reads_again_where_it_stopped(serve: Callable[..., Any]) -> None:
    """The worker's coalescing hold pauses a stream's reading: the upstream's tokens wait in
    the socket and arrive, whole and in order, once reading resumes."""
    srv, b = await serve(srv=GatedServer())
    c = b.generate(chat())
    got: list[Delta] = []
    task = asyncio.ensure_future(c.push(_paused_at_first(c, srv, got)))
    await wait_for(lambda: srv.written == 1, what="the rest written")
    # A byte on another socket, written after the rest: once the loop has read it, it
    # has polled the upstream's socket too, and read it, had it not been paused.
    probe_in, probe_out = socket.socketpair()
    probed = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(probe_in.fileno(), probed.set)
    try:
        probe_out.send(b"x")
        await asyncio.wait_for(probed.wait(), 5)
    finally:
        loop.remove_reader(probe_in.fileno())
        probe_in.close()
        probe_out.close()
    assert [d.text for d in got] == ["a"] and not _reading(c)
    c.resume_reading()
    await asyncio.wait_for(task, 5)
    assert [(d.text, d.finish_reason) for d in got] == [
        ("a", None),
        ("b", None),
        ("c", None),
        ("", "stop"),
    ]


async def test_an_answer_that_ended_while_paused_leaves_its_connection_reading(
    serve: Callable[..., Any],
) -> None:
    """A pause asked in the read that also holds the answer's end: the connection goes back
    to the pool reading, and the next request on it is answered (it hung, never read). A
    resume asked for the finished answer later does nothing to the next answer's pause."""
    srv, b = await serve(srv=GatedServer())
    first = b.generate(chat())
    firsts: list[Delta] = []

    def pause_on_b(d: Delta) -> bool:
        firsts.append(d)
        if len(firsts) == 1:
            srv.gates[-1].set()
        if d.text == "b":  # the read that brings "b" brings the end too
            first.pause_reading()
        return False

    await asyncio.wait_for(first.push(pause_on_b), 5)
    assert firsts[-1].finish_reason == "stop"

    second = b.generate(chat())
    seconds: list[Delta] = []

    task = asyncio.ensure_future(second.push(_paused_at_first(second, srv, seconds)))
    await wait_for(lambda: len(seconds) == 1 and srv.gates[-1].is_set(), what="a pause")
    assert srv.connections == 1  # the same connection, reused
    first.resume_reading()  # the finished answer's: not this one's to resume
    assert not _reading(second)
    second.resume_reading()
    await asyncio.wait_for(task, 5)
    assert "".join(d.text for d in seconds) == "abc" and seconds[-1].finish_reason == "stop"
