"""The bridge's HTTP framing limits, over raw sockets against real processes: the head's size
and time, connections per client, and hostile raw HTTP (hypothesis) that never gets a 5xx,
never holds a connection open, and leaves the bridge serving.

``TOKENBUS_FUZZ_EXAMPLES`` sets how many raw requests the fuzzing test sends (100 by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.asgi import (
    BODY_NOW,
    LATER_MAX,
    HTTPServer,
    Receive,
    Route,
    RouteTable,
    Scope,
    Send,
    _HeadFirst,
)
from tests.support.busdata import new_model
from tests.support.fuzzstack import assert_chat_served
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, ProcStack, start_stack

EXAMPLES = int(os.environ.get("TOKENBUS_FUZZ_EXAMPLES") or 100)
MAX_HEAD = 8192
PER_CLIENT = 8
# Every wait the bridge has here is 1 s (head, body, the rest of a body answered early); a
# connection still open well past that is a hang.
HANG_S = 8.0

Response = tuple[int, dict[bytes, bytes], bytes]


@pytest.fixture(scope="module")
async def limits_stack(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ProcStack]:
    env = {
        "TOKENBUS_BRIDGE__MAX_HEADER_BYTES": str(MAX_HEAD),
        "TOKENBUS_BRIDGE__HEADER_TIMEOUT_S": "1",
        "TOKENBUS_BRIDGE__BODY_TIMEOUT_S": "1",
        "TOKENBUS_BRIDGE__MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT),
        "TOKENBUS_BRIDGE__MAX_BODY_BYTES": "4096",
    }
    with Procs(nats_server.url, tmp_path_factory.mktemp("http-limits")) as procs:
        yield await start_stack(
            procs,
            new_model(),
            worker_args=("--sim-prefill-ms", "1", "--sim-decode-ms", "1"),
            env=env,
        )


# -- raw HTTP on a socket -------------------------------------------------------------------
def _addr(stack: ProcStack) -> tuple[str, int]:
    u = urlsplit(stack.base)
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


@contextlib.contextmanager
def _connect(stack: ProcStack) -> Iterator[socket.socket]:
    with socket.create_connection(_addr(stack), timeout=HANG_S) as s:
        yield s


def _send(s: socket.socket, data: bytes) -> None:
    """Send what the bridge still reads: it may close (and refuse the rest) on an error."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(data)


def _until_closed(s: socket.socket) -> bytes:
    """Everything the bridge sends until it closes; it must close within ``HANG_S``."""
    data = b""
    deadline = time.monotonic() + HANG_S
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            data += chunk
            assert time.monotonic() < deadline, f"the bridge keeps sending: {data[:300]!r}"
    return data


def _parse(data: bytes) -> list[Response]:
    """The responses in ``data``, in order (interim 1xx ones left out)."""
    out: list[Response] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a truncated response: {data[:300]!r}"
        status_line, *lines = head.split(b"\r\n")
        status = int(status_line.split()[1])
        headers = {}
        for line in lines:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if status < 200:
            data = rest
            continue
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            body, data = rest[:n], rest[n:]
        elif headers.get(b"transfer-encoding") == b"chunked":
            body, data = _dechunk(rest)
        else:
            body, data = rest, b""
        out.append((status, headers, body))
    return out


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    parts, at = [], 0
    while True:
        end = data.index(b"\r\n", at)
        n = int(data[at:end], 16)
        parts.append(data[end + 2 : end + 2 + n])
        at = end + 2 + n + 2
        if n == 0:
            return b"".join(parts), data[at:]


def _read_one(s: socket.socket) -> Response:
    """One whole response from a connection that stays open (Content-Length framed)."""
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            n = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v)
            if len(rest) >= n:
                assert len(rest) == n, f"more than one response: {data[:300]!r}"
                return _parse(data)[0]
        chunk = s.recv(65536)
        assert chunk, f"closed mid-response: {data[:300]!r}"
        data += chunk


def _check(resp: Response) -> None:
    """Never a 5xx; an error with a body is OpenAI-shaped."""
    status, headers, body = resp
    assert status < 500, resp
    if status >= 400 and body:
        assert headers.get(b"content-type") == b"application/json", resp
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert "Traceback" not in err["message"]


def _error(resp: Response) -> dict[str, Any]:
    _check(resp)
    err: dict[str, Any] = json.loads(resp[2])["error"]
    return err


def _get(path: str = "/health", *extra: bytes) -> bytes:
    return b"".join([f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode(), *extra, b"\r\n"])


CLOSE = b"Connection: close\r\n"


def _chat_post(stack: ProcStack, max_tokens: int, extra: bytes = b"") -> bytes:
    """A whole chat completion request (head lines ``extra`` added) for ``stack``'s model."""
    body = json.dumps(
        {
            "model": stack.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


def _until(cond: Callable[[], bool], timeout: float = 10, what: str = "condition") -> None:
    """Until ``cond()`` holds (polled), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in time")
        time.sleep(0.01)


def _held_by_the_bridge(port: int) -> int:
    """Connections the process listening on ``port`` has not closed on its side yet: its
    sockets on that port that are established or half-closed (the client closed first)."""
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                local, _, state = line.split()[1:4]
                if int(local.rsplit(":", 1)[1], 16) == port and state in ("01", "08"):
                    held += 1
    return held


def _serves(stack: ProcStack) -> None:
    with _connect(stack) as s:
        s.sendall(_get("/health", CLOSE))
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 200, resp


# -- the head -------------------------------------------------------------------------------
@pytest.mark.stack
def test_a_head_under_the_limit_is_served(limits_stack: ProcStack) -> None:
    with _connect(limits_stack) as s:
        s.sendall(_get("/health", b"X-Big: " + b"a" * (MAX_HEAD - 200) + b"\r\n", CLOSE))
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 200, resp


@pytest.mark.stack
@pytest.mark.parametrize("pieces", [1, 7])
def test_a_head_over_the_limit_gets_431_and_the_connection_closes(
    limits_stack: ProcStack, pieces: int
) -> None:
    head = _get("/health", b"X-Big: " + b"a" * MAX_HEAD + b"\r\n")
    step = -(-len(head) // pieces)
    with _connect(limits_stack) as s:
        for i in range(0, len(head), step):
            _send(s, head[i : i + step])
            time.sleep(0.01)  # the input's pace: each piece arrives on its own
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 431
    assert _error(resp)["code"] == "request_header_fields_too_large"
    assert resp[1][b"connection"] == b"close"


@pytest.mark.stack
def test_a_head_that_trickles_past_the_timeout_gets_408_and_the_connection_closes(
    limits_stack: ProcStack,
) -> None:
    t0 = time.monotonic()
    with _connect(limits_stack) as s:
        _send(s, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        # A byte every 0.2 s keeps the connection busy, never the head complete.
        for _ in range(30):
            if select.select([s], [], [], 0)[0]:  # answered (or closed)
                break
            _send(s, b"a")
            time.sleep(0.2)
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 408
    assert _error(resp)["code"] == "request_timeout"
    assert time.monotonic() - t0 < 4


@pytest.mark.stack
def test_the_request_duration_counts_from_the_first_byte(limits_stack: ProcStack) -> None:
    # The bridge's request duration (its log line, and the histogram made from the same
    # record) starts at the request's first byte, like its t1: a head that takes 0.4 s to
    # arrive is 0.4 s of the request, even though the handler starts only once it is whole.
    assert_chat_served(limits_stack.base, limits_stack.model)  # a replica is known by now
    rid = f"slow-head-{time.time_ns()}"
    post = _chat_post(limits_stack, 2, f"X-Request-Id: {rid}\r\n".encode() + CLOSE)
    with _connect(limits_stack) as s:
        _send(s, post[:20])
        time.sleep(0.4)  # the input: a head that takes 0.4 s to arrive (what is measured)
        _send(s, post[20:])
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 200, resp
    for _ in range(50):
        lines = [
            json.loads(ln)
            for ln in limits_stack.bridge.output().splitlines()
            if ln.startswith("{") and rid in ln
        ]
        done = [ln for ln in lines if ln.get("event") == "request"]
        if done:
            break
        time.sleep(0.1)
    assert done, f"no request line for {rid}"
    # Counted from the head's end it would be the handler's few ms; from the first byte, the
    # 0.4 s the head took, less however late the bridge's loop read that first byte (399.8
    # ms once, under six pytest workers): 300 ms tells the two apart with room for that.
    assert done[0]["duration_ms"] >= 300, done[0]


@pytest.mark.stack
def test_a_connection_that_sends_nothing_is_closed_without_an_answer(
    limits_stack: ProcStack,
) -> None:
    with _connect(limits_stack) as s:
        assert _until_closed(s) == b""


@pytest.mark.stack
def test_the_head_timeout_does_not_cut_a_long_answer_on_a_kept_alive_connection(
    limits_stack: ProcStack,
) -> None:
    # A generation longer than the head timeout, then a second request on the same
    # connection: the head timer runs only while a head is arriving.
    post = _chat_post(limits_stack, 1500)
    with _connect(limits_stack) as s:
        s.settimeout(30)
        t0 = time.monotonic()
        s.sendall(post)
        first = _read_one(s)
        assert first[0] == 200, first
        assert time.monotonic() - t0 > 1.0  # longer than the head timeout
        time.sleep(0.3)  # a negative check: a head timer left running would close it now
        s.sendall(_get("/health"))
        assert _read_one(s)[0] == 200


@contextlib.asynccontextmanager
async def _served(routes: dict[tuple[str, str], Route]) -> AsyncIterator[int]:
    """The bridge's HTTP server on a free port, serving ``routes``: its port; stopped after."""
    srv = HTTPServer(RouteTable(routes), "127.0.0.1", 0, reuse_port=False, shutdown_timeout=1)
    await srv.start()
    try:
        yield srv.sock.getsockname()[1]
    finally:
        await srv.stop()


@pytest.mark.unit
async def test_body_now_writes_at_once_until_the_client_falls_behind() -> None:
    """``BodyNow`` (how the bridge writes most tokens, from the stream's delivery callback)
    writes a chunked body's pieces at once, refuses while the client reads too slowly
    (``send`` then waits for the socket), and refuses outside a chunked body in progress.
    A client that reads nothing for a while gets every piece, in order."""
    # 8 MB: more than the kernel holds for a client that does not read (tcp_wmem's 4 MB
    # at most on the sending side, the receive buffer's 128 kB until the client reads).
    pieces = [b"%07d|" % i * 16 for i in range(64_000)]
    seen: dict[str, Any] = {}
    behind = threading.Event()  # the client fell behind: the app's writes are refused

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        now = scope[BODY_NOW]
        seen["before_start"] = now(b"x")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen["empty"] = now(b"")
        refused = 0
        for p in pieces:
            if not now(p):
                refused += 1
                behind.set()
                await send({"type": "http.response.body", "body": p, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["refused"], seen["after_end"] = refused, now(b"x")

    async def fixed(scope: Scope, receive: Receive, send: Send) -> None:
        now = scope[BODY_NOW]
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        seen["fixed"] = now(b"x")
        await send({"type": "http.response.body", "body": b"ok"})

    def read(port: int, path: str, ready: Callable[[], bool]) -> Response:
        with socket.socket() as s:
            s.settimeout(HANG_S)
            s.connect(("127.0.0.1", port))
            s.sendall(_get(path, CLOSE))
            _until(ready, HANG_S, f"{path}: the app's writes")  # nothing read meanwhile
            (resp,) = _parse(_until_closed(s))
            return resp

    async with _served({("GET", "/big"): app, ("GET", "/fixed"): fixed}) as port:
        status, _, body = await asyncio.to_thread(read, port, "/big", behind.is_set)
        fixed_resp = await asyncio.to_thread(read, port, "/fixed", lambda: "fixed" in seen)
    assert status == 200 and body == b"".join(pieces)
    assert fixed_resp[0] == 200 and fixed_resp[2] == b"ok"
    assert 0 < seen["refused"] < len(pieces)  # at once at first, then through send
    assert seen["before_start"] is seen["empty"] is seen["after_end"] is seen["fixed"] is False


class _Recorded:
    """The socket side of a response's transport: each write kept as one."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.unit
async def test_pieces_written_from_callbacks_leave_in_one_write_per_turn() -> None:
    """Issue 70: what ``BodyNow`` writes from the stream's callbacks in one loop turn, and
    what the response's task writes in the next (the answer's end, come with the last
    token), leave the bridge in one socket write; a lone piece still goes within two turns;
    a burst past LATER_MAX goes at once (so flow control sees it); a close writes what is
    held first."""
    sock = _Recorded()
    t = _HeadFirst(sock)
    t.later(b"a")
    t.later(b"b")
    await _turns(1)
    t.write(b"end")
    assert sock.writes == [b"abend"]
    t.later(b"c")
    await _turns(3)
    assert sock.writes == [b"abend", b"c"]
    big = b"x" * LATER_MAX
    t.later(big)
    assert sock.writes[-1] == big
    t.later(b"d")
    t.close()
    assert sock.writes[-1] == b"d" and sock.closed
    await _turns(3)
    assert sock.writes[-1] == b"d"  # nothing written twice


@pytest.mark.unit
async def test_a_held_head_goes_out_with_the_first_piece_of_body_or_before_a_close() -> None:
    """``BodyNow.hold_head`` (how the bridge starts an SSE answer): the head ``send`` writes
    waits for the first piece of body and leaves in the same write, so the client's first
    read holds both. A response that fails before any body still gets its head out before
    the connection closes."""
    read_once = threading.Event()  # the client's first read returned

    async def first(scope: Scope, receive: Receive, send: Send) -> None:
        scope[BODY_NOW].hold_head()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        # A negative check: a head written on its own would be read by now.
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.to_thread(read_once.wait, HANG_S)  # the next piece after that read
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})

    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        scope[BODY_NOW].hold_head()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the app failed after its head")

    def first_read(port: int, path: str) -> tuple[bytes, bytes]:
        with socket.socket() as s:
            s.settimeout(HANG_S)
            s.connect(("127.0.0.1", port))
            s.sendall(_get(path, CLOSE))
            got = s.recv(65536)
            read_once.set()
            return got, got + _until_closed(s)

    async with _served({("GET", "/first"): first, ("GET", "/fails"): fails}) as port:
        head_and_first, whole = await asyncio.to_thread(first_read, port, "/first")
        _, failed_whole = await asyncio.to_thread(first_read, port, "/fails")
    assert head_and_first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert head_and_first.endswith(b"data: 1\n\n\r\n"), head_and_first  # head + first chunk
    ((status, _, body),) = _parse(whole)
    assert status == 200 and body == b"data: 1\n\ndata: 2\n\n"
    assert failed_whole.startswith(b"HTTP/1.1 200 OK\r\n"), failed_whole


# -- a body answered before it all came ------------------------------------------------------
@pytest.mark.stack
def test_a_body_answered_early_must_still_come_in_time(limits_stack: ProcStack) -> None:
    declared = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    with _connect(limits_stack) as s:
        t0 = time.monotonic()
        s.sendall(declared + b"{")
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 413 and _error(resp)["code"] == "payload_too_large"
    assert time.monotonic() - t0 < 4
    # Sent in full, the body is read and dropped and the connection serves on.
    with _connect(limits_stack) as s:
        s.sendall(declared + b"x" * 100_000)
        assert _read_one(s)[0] == 413
        s.sendall(_get("/health"))
        assert _read_one(s)[0] == 200


# -- connections per client -------------------------------------------------------------------
@pytest.mark.stack
def test_connections_beyond_the_per_client_limit_are_refused_while_the_others_serve(
    limits_stack: ProcStack,
) -> None:
    port = _addr(limits_stack)[1]
    # Until the earlier tests' connections closed on the bridge's side too.
    _until(lambda: _held_by_the_bridge(port) == 0, what="the bridge closing old connections")
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(_connect(limits_stack)) for _ in range(PER_CLIENT)]
        for s in socks:
            s.sendall(_get("/health"))
            assert _read_one(s)[0] == 200
        with _connect(limits_stack) as extra:
            extra.sendall(_get("/health"))
            (resp,) = _parse(_until_closed(extra))
        assert resp[0] == 429, resp
        assert _error(resp)["code"] == "too_many_connections"
        assert resp[1][b"retry-after"] == b"1"
        for s in socks:  # the first ones still serve
            s.sendall(_get("/health"))
            assert _read_one(s)[0] == 200
        socks[0].close()
        deadline = time.monotonic() + 5
        while True:  # once one closes, a new one is taken
            with _connect(limits_stack) as s:
                s.sendall(_get("/health", CLOSE))
                (resp,) = _parse(_until_closed(s))
            if resp[0] == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert resp[0] == 200, resp


# -- malformed HTTP -------------------------------------------------------------------------
@pytest.mark.stack
@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"G\x00T /health HTTP/1.1\r\n\r\n", "Invalid method"),
        (b"GET /health HTTP/7.3\r\n\r\n", "Invalid HTTP version"),
        (b"GET /health HTTP/1.1\r\nX: a\x00b\r\n\r\n", "Invalid header value char"),
        (b"GET /health HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        (b"GET /health HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "Duplicate"),
        (b"GET /health HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", "overflow"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "chunk size",
        ),
        (b"CONNECT a:1 HTTP/1.1\r\n\r\n", "Invalid URL"),
    ],
)
def test_malformed_http_gets_an_openai_shaped_400(
    limits_stack: ProcStack, raw: bytes, reason: str
) -> None:
    with _connect(limits_stack) as s:
        s.sendall(raw)
        (resp,) = _parse(_until_closed(s))
    assert resp[0] == 400
    err = _error(resp)
    assert err["code"] == "invalid_request" and reason in err["message"], err


@pytest.mark.stack
def test_pipelined_requests_are_answered_in_order_up_to_the_bad_one(
    limits_stack: ProcStack,
) -> None:
    with _connect(limits_stack) as s:
        s.sendall(_get("/health") + _get("/ready") + b"BAD\x00 / HTTP/1.1\r\n\r\n" + _get())
        resps = _parse(_until_closed(s))
    assert [r[0] for r in resps] == [200, 200, 400], resps
    _check(resps[2])


@pytest.mark.unit
async def test_an_exception_that_escapes_the_app_is_an_openai_shaped_500() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("a bug in a handler")

    async with (
        _served({("GET", "/broken"): broken}) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h,
    ):
        r = await h.get("/broken")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "the gateway failed; retry",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


# Hostile raw HTTP: requests built from parts, each part mostly valid and else odd or broken
# (so that a request often gets past its request line), several to a connection. HEAD is
# left out: its answer has a Content-Length and no body, which a reader of raw responses
# cannot tell apart from the next answer.
def _mostly(good: st.SearchStrategy[bytes], *odd: st.SearchStrategy[bytes]) -> Any:
    """``good`` three times in four, else one of ``odd`` (``one_of(good, good, good, ...)``
    would not do: it drops repeated strategies)."""
    bad = st.one_of(*odd)
    return st.sampled_from(range(4)).flatmap(lambda i: bad if i == 0 else good)


_methods = _mostly(
    st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT"]),
    st.sampled_from([b"get", b"G\x00T", b"POST\x7f", b"", b"GET GET", b"\xff\xfe", b"P" * 300]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=8)
    .map(str.encode)
    .filter(lambda m: m != b"HEAD"),
)
_targets = _mostly(
    st.sampled_from([b"/health", b"/ready", b"/v1/models", b"/v1/chat/completions", b"/nope"]),
    st.sampled_from([b"*", b"http://x/health", b"/health?a=%00", b"/%ff%00", b"/\x00", b"//"]),
    st.sampled_from([b"", b"/a b", b"/" + b"a" * 9000]),
    st.binary(max_size=40),
)
_versions = _mostly(
    st.just(b"HTTP/1.1"),
    st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1", b"http/1.1", b"HTTP/9.9", b""]),
)
_lengths = st.one_of(
    st.integers(-5, 10**20).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b"abc", b"1, 2", b" 5", b"0x10", b"+3", b"5\x00"]),
)
_header = st.one_of(
    st.tuples(st.just(b"Content-Length"), _lengths),
    st.tuples(
        st.just(b"Transfer-Encoding"),
        st.sampled_from([b"chunked", b"gzip", b"chunked, gzip", b"gzip, chunked", b"xchunked"]),
    ),
    st.tuples(
        st.sampled_from([b"Connection", b"Upgrade", b"Expect"]),
        st.sampled_from([b"close", b"keep-alive", b"upgrade", b"websocket", b"100-continue"]),
    ),
    st.tuples(
        st.sampled_from([b"Host", b"Authorization", b"X-Session-Id", b"Content-Type"]),
        st.binary(max_size=30),
    ),
    st.tuples(st.just(b"X-Big"), st.sampled_from([b"a" * 4000, b"a" * 9000])),
    # Header injection: line breaks, NULs and separators in names and values.
    st.tuples(
        st.sampled_from([b"X-A", b"X A", b"X:A", b"X-A\r\nX-B", b"", b"\x00", b" X-A"]),
        st.sampled_from([b"v\r\nX-Injected: 1", b"v\nX: 1", b"v\rX: 1", b"\x00", b" v ", b"\x7f"]),
    ),
)
_chunk = _mostly(
    st.binary(min_size=1, max_size=20).map(lambda b: b"%x\r\n%s\r\n" % (len(b), b)),
    st.sampled_from([b"zz\r\n", b"ffffffffffffffffffff\r\n", b"5\r\nab\r\n", b"3;x=y\r\nabc\r\n"]),
    st.sampled_from([b"-1\r\n", b"3\r\nabcde\r\n", b"3\nabc\n", b"0\r\nX: 1\r\n\r\n"]),
)
_body = st.one_of(
    st.binary(max_size=60),
    st.sampled_from([b"{}", b'{"model": "x", "messages": []}', b"[" * 100, b"x" * 5000]),
)
_eol = _mostly(st.just(b"\r\n"), st.sampled_from([b"\n", b"\r", b"\r\r\n"]))


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """One request: a line, headers, and a body framed by an exact Content-Length, by
    chunks (perhaps bad, perhaps unfinished), or not at all, besides any framing headers
    drawn among the others."""
    eol = draw(_eol)
    line = b" ".join([draw(_methods), draw(_targets), draw(_versions)])
    headers = draw(st.lists(_header, max_size=4))
    framing = draw(st.sampled_from(["length", "chunked", "none"]))
    if framing == "chunked":
        body = b"".join(draw(st.lists(_chunk, max_size=4)))
        body += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\n\r\n", b""]))
        headers.append((b"Transfer-Encoding", b"chunked"))
    else:
        body = draw(_body)
        if framing == "length":
            headers.append((b"Content-Length", str(len(body)).encode()))
    headers = draw(st.permutations(headers))
    return b"".join([line, eol, *(n + b": " + v + eol for n, v in headers), eol, body])


raw_http = st.lists(_requests(), min_size=1, max_size=3).map(b"".join)


@pytest.mark.stack
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=raw_http)
def test_hostile_raw_http_never_gets_a_5xx_nor_hangs(limits_stack: ProcStack, raw: bytes) -> None:
    # A well-formed request closes the connection last, whatever came before: an answer to
    # each, and the connection closed in bounded time.
    with _connect(limits_stack) as s:
        _send(s, raw + _get("/health", CLOSE))
        data = _until_closed(s)
    for resp in _parse(data):
        _check(resp)
    _serves(limits_stack)


@pytest.mark.stack
def test_everything_still_serves_after_the_hostile_input(limits_stack: ProcStack) -> None:
    assert limits_stack.all_alive()
    assert_chat_served(limits_stack.base, limits_stack.model)
    assert "Traceback" not in limits_stack.bridge.output()
