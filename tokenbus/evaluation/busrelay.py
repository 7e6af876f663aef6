"""A bare byte tunnel through nats-server: the floor of tokenbus' own shape.

``tokenbus bench --spawn --peer busrelay`` puts it in front of the same engine server as
tokenbus and the other peers. It has the shape the issue measures tokenbus in: a Python
process facing the clients (``front``, where the bridge is), a Python process facing the
engine (``back``, where the worker is), and a nats-server between them. It does none of
tokenbus' work: no HTTP parsing, no JSON, no frames, no stage. Each client connection is
tunnelled to an upstream connection of its own, and bytes are copied both ways as they
arrive. Like tokenbus' outbox, what a side reads in one event-loop turn leaves as one NATS
message per destination process (msgpack ``[[connection, bytes], ...]``; empty bytes: that
side closed). A front listens only once a back answers on the bus, so a client that can
connect is never tunnelled to nobody. What it costs per output token is the least any
design of this shape pays before it does any work of its own (docs/benchmarks.md, issue 13).

It is a measuring instrument, not a gateway: no keys, no routing, one upstream, no flow
control (the benchmark's clients read as fast as they can).

    nats-server -p 4333
    python -m tokenbus.evaluation.busrelay back --nats nats://127.0.0.1:4333 \\
        --upstream http://127.0.0.1:8000
    python -m tokenbus.evaluation.busrelay front --nats nats://127.0.0.1:4333 --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import msgpack
from nats.aio.msg import Msg

from services import natsclient, runtime
from tokenbus.evaluation.pyrelay import address

TO_BACK = "floor.c2s"  # queue group "back": every back process takes a share of connections
BACK_READY = "floor.ready"  # a back answers once it takes connections

T = TypeVar("T")


def to_front(front: str) -> str:
    return f"floor.s2c.{front}"


class _Batches:
    """Items queued in one loop turn, sent as one message per subject when the turn ends."""

    def __init__(self, publish: Callable[[str, bytes], Any]) -> None:
        self._publish = publish
        self._pending: dict[str, list[Any]] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, subject: str, item: Any) -> None:
        self._pending.setdefault(subject, []).append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                pending, self._pending = self._pending, {}
                for subject, items in pending.items():
                    await self._publish(subject, msgpack.packb(items))
        finally:
            self._task = None


class _Socket(asyncio.Protocol):
    """One TCP connection of a tunnel: what it reads goes to ``out(bytes)``; ``b""`` when
    it closes (once)."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self._out: Callable[[bytes], None] | None = out
        self.early: list[bytes] = []  # for the socket, before it was connected
        self._close_when_made = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        for data in self.early:
            self.transport.write(data)
        self.early = []
        if self._close_when_made:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._out is not None:
            self._out(data)

    def eof_received(self) -> bool | None:
        self.lost()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost()

    def lost(self) -> None:
        """The socket closed, or never connected: tell the other side, once."""
        out, self._out = self._out, None
        if out is not None:
            out(b"")

    def write(self, data: bytes) -> None:
        """``data`` to the socket; ``b""`` closes it."""
        if self.transport is None:
            if data:
                self.early.append(data)
            else:  # the other side closed before this one connected
                self._out = None
                self._close_when_made = True
            return
        if data:
            self.transport.write(data)
        elif not self.transport.is_closing():
            self._out = None
            self.transport.close()


async def _retried(attempt: Callable[[], Awaitable[T]], timeout: float) -> T:
    """``attempt()``, again every 0.1 s while it fails, until ``timeout`` seconds pass."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        try:
            return await attempt()
        except Exception:
            if loop.time() > until:
                raise
            await asyncio.sleep(0.1)


async def _connect(url: str) -> Any:
    """A NATS connection, retried while the server starts."""
    return await _retried(
        lambda: natsclient.connect(url, allow_reconnect=False, connect_timeout=1), 15.0
    )


async def _back_answers(nc: Any) -> None:
    """Until a back process answers (before that, what a client sends would reach nobody)."""
    await _retried(lambda: nc.request(BACK_READY, b"", timeout=0.5), 30.0)


async def front(host: str, port: int, nats_url: str) -> asyncio.Server:
    """Listen on ``host:port`` once a back process answers; every connection is tunnelled
    to a back process."""
    nc = await _connect(nats_url)
    await _back_answers(nc)
    me = secrets.token_hex(4)
    out = _Batches(nc.publish)
    clients: dict[int, _Socket] = {}
    ids = iter(range(1, 1 << 62))

    def on_msg(msg: Msg) -> None:
        for cid, data in msgpack.unpackb(msg.data):
            client = clients.get(cid)
            if client is not None:
                if not data:
                    del clients[cid]
                client.write(data)

    await natsclient.subscribe_direct(nc, to_front(me), on_msg)

    def accept() -> _Socket:
        cid = next(ids)

        def send(data: bytes) -> None:
            if not data:
                clients.pop(cid, None)
            out.add(TO_BACK, [me, cid, data])

        clients[cid] = sock = _Socket(send)
        return sock

    # The bridge's listen backlog (see pyrelay).
    return await asyncio.get_running_loop().create_server(accept, host, port, backlog=4096)


async def back(nats_url: str, upstream: str) -> Any:
    """Take the fronts' connections and tunnel each to ``upstream`` (http://h:p)."""
    up_host, up_port = address(upstream)
    nc = await _connect(nats_url)
    loop = asyncio.get_running_loop()
    out = _Batches(nc.publish)
    ups: dict[tuple[str, int], _Socket] = {}
    connecting: set[asyncio.Task[None]] = set()

    def open_upstream(key: tuple[str, int]) -> _Socket:
        subject, cid = to_front(key[0]), key[1]

        def send(data: bytes) -> None:
            if not data:
                ups.pop(key, None)
            out.add(subject, [cid, data])

        sock = _Socket(send)

        async def connect() -> None:
            try:
                await loop.create_connection(lambda: sock, up_host, up_port)
            except OSError:
                sock.lost()  # the client sees its connection closed, not a hang

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return sock

    def on_msg(msg: Msg) -> None:
        for fid, cid, data in msgpack.unpackb(msg.data):
            key = (fid, cid)
            sock = ups.get(key)
            if sock is None:
                if not data:
                    continue
                ups[key] = sock = open_upstream(key)
            elif not data:
                del ups[key]
            sock.write(data)

    await natsclient.subscribe_direct(nc, TO_BACK, on_msg, queue="back")

    async def ready(msg: Msg) -> None:
        await msg.respond(b"")

    # After the subscription above: the server has it by the time a front hears the answer.
    await nc.subscribe(BACK_READY, cb=ready)
    return nc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenbus.evaluation.busrelay", description=__doc__)
    p.add_argument("side", choices=("front", "back"))
    p.add_argument("--nats", required=True, help="nats://HOST:PORT of the tunnel's nats-server")
    p.add_argument("--host", default="127.0.0.1", help="front: where to listen")
    p.add_argument("--port", type=int, help="front: the port to listen on")
    p.add_argument("--upstream", help="back: http://HOST:PORT of the engine server")
    a = p.parse_args(argv)
    if a.side == "front" and a.port is None:
        p.error("front needs --port")
    if a.side == "back":
        try:
            address(a.upstream or "")
        except ValueError as exc:
            p.error(str(exc))

    async def run() -> None:
        if a.side == "front":
            server = await front(a.host, a.port, a.nats)
            async with server:
                await server.serve_forever()
        else:
            _held = await back(a.nats, a.upstream)  # its connection, kept while it serves
            await asyncio.Event().wait()  # until stopped

    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(run())


if __name__ == "__main__":
    main()
