"""Streamed HTTP/1.1 POSTs to one upstream, handed over as they arrive (push, not pull).

The ``openai`` backend relays an upstream's server-sent events. Pulled through a client
library (a response stream read by a task), every token costs a task wake-up, a stream
buffer and a chain of async generators before the worker sees it: about two thirds of the
worker's CPU per token. Here the connection's protocol parses the response where the bytes
arrive, in ``data_received``, and calls back with each event's data, so the worker turns
the token into a frame in the same callback (``benchmarks.md``, issue 13).

Only what the backend needs: POST with a JSON body, keep-alive connections reused LIFO,
``Content-Length``, chunked or read-to-close bodies, interim (1xx) answers skipped, TLS for
``https`` upstreams. A connection that fails, is aborted, or was not read to its end is
closed, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import NamedTuple, cast
from urllib.parse import urlsplit

# A response head larger than this is no HTTP server we can talk to.
MAX_HEAD = 64 * 1024
# An error answer's body is kept up to this much (it becomes the error's message).
MAX_ERROR_BODY = 64 * 1024
# Idle connections kept per upstream.
MAX_IDLE = 1024


class UpstreamProtocolError(Exception):
    """The upstream's answer is not HTTP/1.1 as we read it."""


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the answer ended."""


class Response:
    """What one request's callbacks are told; subclass and override."""

    # The connection the request was written on (set when it is): its reading can be paused
    # for this answer (:meth:`_Connection.pause`).
    conn: _Connection | None = None

    def head(self, status: int, headers: dict[str, str]) -> None:
        """The status and headers (lower-case names) arrived."""

    def body(self, data: bytes) -> None:
        """Body bytes (chunked framing removed), as they arrive."""

    def end(self) -> None:
        """The body ended; the connection may be reused."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self._r: Response | None = None
        self._done: asyncio.Future[None] | None = None
        self._buf = b""
        self._in_head = True
        self._mode = ""  # "length", "chunked", "close"
        self._left = 0  # bytes left of the body (length) or of the current chunk (chunked)
        self._chunk_state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self.got_bytes = False
        self._keep_alive = True

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self._done is not None and not self._done.done():
            if self._mode == "close" and not self._in_head:
                self._finish()
            else:
                self._fail(UpstreamClosed("the upstream closed the connection mid-answer"))

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            # Bytes nobody asked for: the connection is out of step; never reuse it.
            self.abort()
            return
        self.got_bytes = True
        try:
            self._feed(data)
        except BaseException as exc:  # a callback's error ends this request, not the loop
            self._fail(exc)

    # -- requests ---------------------------------------------------------------------------
    def start(self, request: tuple[bytes, bytes], r: Response) -> asyncio.Future[None]:
        assert self.transport is not None
        self._r = r
        self._done = asyncio.get_running_loop().create_future()
        self._buf = b""
        self._in_head = True
        self._mode = ""
        self.got_bytes = False
        self.reusable = False
        r.conn = self
        # The head and the body as they are: one write of both, no joined copy (4 MiB of
        # JSON is 0.3 ms of copying and as many page faults, on the request's path).
        self.transport.writelines(request)
        return self._done

    def abort(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def pause(self, r: Response) -> None:
        """Read no more for ``r`` until :meth:`resume`: what the upstream writes meanwhile
        waits in the socket and arrives in one read (the worker's coalescing hold, which
        sends nothing of a held stream before the hold ends anyway). Nothing once ``r``'s
        answer is over: the connection may serve another request by then."""
        t = self.transport
        if self._r is r and t is not None and not t.is_closing() and t.is_reading():
            t.pause_reading()

    def resume(self, r: Response) -> None:
        """Read again for ``r`` (nothing once its answer is over)."""
        if self._r is r:
            self._reading()

    def _reading(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing() and not t.is_reading():
            t.resume_reading()

    def _fail(self, exc: BaseException) -> None:
        self.abort()
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self._r = None

    def _finish(self) -> None:
        r, self._r = self._r, None
        if r is not None:
            try:
                r.end()
            except BaseException as exc:  # from connection_lost too: never out of the loop
                self._fail(exc)
                return
        self._reading()  # an answer that ended while paused: the next request reads
        self.reusable = self._keep_alive and not self.closed and not self._buf
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- parsing ----------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._in_head:
            buf = self._buf + data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise UpstreamProtocolError("the upstream's answer head is too large")
                    self._buf = buf
                    return
                status, headers = _parse_head(buf[:end])
                buf = buf[end + 4 :]
                if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): skip
                    continue
                break
            self._in_head = False
            self._buf = b""
            self._start_body(status, headers)
            if self._r is None:
                return
            data = buf
            if not data and self._mode != "length":
                return
        if self._mode == "chunked":
            self._chunked(data)
        elif self._mode == "length":
            take = data[: self._left]
            self._left -= len(take)
            if take and self._r is not None:
                self._r.body(take)
            if len(data) > len(take):
                raise UpstreamProtocolError("the upstream sent more than its Content-Length")
            if self._left == 0:
                self._finish()
        elif data and self._r is not None:
            self._r.body(data)

    def _start_body(self, status: int, headers: dict[str, str]) -> None:
        r = self._r
        assert r is not None
        conn = headers.get("connection", "").lower()
        self._keep_alive = "close" not in conn
        r.head(status, headers)
        if status in (204, 304):
            self._mode, self._left = "length", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode, self._chunk_state = "chunked", 0
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise UpstreamProtocolError("the upstream sent a bad Content-Length") from None
            if self._left < 0:
                raise UpstreamProtocolError("the upstream sent a bad Content-Length")
            self._mode = "length"
        else:
            self._mode, self._keep_alive = "close", False

    def _chunked(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        n = len(buf)
        out: list[bytes] = []
        while pos < n:
            state = self._chunk_state
            if state == 1:  # chunk data
                take = min(self._left, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = 2
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > MAX_HEAD:
                    raise UpstreamProtocolError("the upstream sent a malformed chunk")
                self._buf = buf[pos:]
                break
            line = buf[pos:eol]
            pos = eol + 2
            if state == 0:  # size line (extensions after ';' ignored)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamProtocolError("the upstream sent a malformed chunk") from None
                if size:
                    self._left, self._chunk_state = size, 1
                else:
                    self._chunk_state = 3
            elif state == 2:  # the CRLF after a chunk's data
                if line:
                    raise UpstreamProtocolError("the upstream sent a malformed chunk")
                self._chunk_state = 0
            elif not line:  # state 3: trailers end with an empty line
                if out and self._r is not None:
                    self._r.body(b"".join(out))
                if pos < n:
                    raise UpstreamProtocolError("the upstream sent bytes after its answer")
                self._finish()
                return
        if out and self._r is not None:
            self._r.body(out[0] if len(out) == 1 else b"".join(out))


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise UpstreamProtocolError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise UpstreamProtocolError(f"a bad status line: {lines[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            key = name.strip().lower().decode("latin-1")
            val = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
    if parts[0] == b"HTTP/1.0" and "keep-alive" not in headers.get("connection", "").lower():
        headers["connection"] = "close"
    return status, headers


class Sent(NamedTuple):
    """A request written on a connection (:meth:`UpstreamHTTP.send_now`)."""

    conn: _Connection
    done: asyncio.Future[None]
    request: tuple[bytes, bytes]

    def abort(self) -> None:
        """Give the request up: its connection is closed (the upstream sees the client go)."""
        self.conn.abort()


class UpstreamHTTP:
    """POSTs to one upstream over reused keep-alive connections."""

    def __init__(
        self, base_url: str, headers: dict[str, str], *, connect_timeout: float = 10.0
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        default_port = self.port == (443 if url.scheme == "https" else 80)
        host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
        authority = host if default_port else f"{host}:{self.port}"
        # A User-Agent, as every client library sends one (some fronts refuse requests without).
        fixed = {
            "Host": authority,
            "User-Agent": "tokenbus-worker",
            "Accept": "text/event-stream",
            **headers,
        }
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[bytes, bytes]:
        """The request's head, and its body."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        head = b"POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n" % (
            (self.prefix + path).encode(),
            self._fixed,
            extra,
            len(body),
        )
        return head, body

    def send_now(self, path: str, body: bytes, headers: dict[str, str], r: Response) -> Sent | None:
        """Write the request at once on a kept connection, None when none is kept; ``r`` is
        called back from here on, and :meth:`post` with the result waits for the end. The
        worker writes a request this way before it acknowledges it, so the upstream starts
        while the bus hears back (its prefill hides that work)."""
        conn = self._take()
        if conn is None:
            return None
        request = self.request_bytes(path, body, headers)
        return Sent(conn, conn.start(request, r), request)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        r: Response,
        sent: Sent | None = None,
    ) -> None:
        """Send the request (or take the one :meth:`send_now` wrote: ``sent``) and call ``r``
        back as the answer arrives, until it ends. Cancelled (or failing), the connection is
        aborted: the upstream sees the client go."""
        if sent is None:
            sent = self.send_now(path, body, headers, r)
        if sent is not None:
            try:
                await self._finish(sent)
                return
            except UpstreamClosed:
                if sent.conn.got_bytes:
                    raise
                # A kept connection the upstream had closed meanwhile: once more, on a new one.
            request = sent.request
        else:
            request = self.request_bytes(path, body, headers)
        conn = await self._connect()
        await self._finish(Sent(conn, conn.start(request, r), request))

    async def _finish(self, sent: Sent) -> None:
        """The answer of a request written on ``sent.conn``, which is kept for reuse after if
        it can be."""
        try:
            await sent.done
        except BaseException:
            sent.conn.abort()
            raise
        self._put(sent.conn)

    def _take(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _put(self, conn: _Connection) -> None:
        if conn.reusable and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.abort()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                _Connection,
                self.host,
                self.port,
                ssl=self.ssl,
                server_hostname=self.host if self.ssl else None,
            )
        return conn

    def close(self) -> None:
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.abort()
        self._idle.clear()


class SSEParser:
    """Server-sent events from body bytes: ``on_data`` gets each event's data (its ``data:``
    lines joined with newlines); other fields and comments are skipped. Call ``close`` at the
    end: an event not closed by a blank line still counts."""

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self.on_data = on_data
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        if b"\n" not in chunk:
            self._buf += chunk
            return
        buf = self._buf + chunk if self._buf else chunk
        *lines, self._buf = buf.split(b"\n")
        data = self._data
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                if line.startswith(b"data:"):
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif data:
                payload = data[0] if len(data) == 1 else b"\n".join(data)
                data.clear()
                self.on_data(payload)

    def close(self) -> None:
        line = self._buf.rstrip(b"\r")
        self._buf = b""
        if line.startswith(b"data:"):
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        if self._data:
            payload = b"\n".join(self._data)
            self._data = []
            self.on_data(payload)
