"""A bare Python byte relay: the floor of any Python process that every token crosses.

``tokenbus bench --spawn --peer pyrelay`` puts it in front of the same engine server as
tokenbus and the other peers. Each client connection gets an upstream connection of its
own, and bytes are copied both ways as they arrive (uvloop, one ``data_received`` and one
``write`` per read): no HTTP parsing, no JSON, no stage. What it costs per output token is
what a Python gateway pays before it does any work of its own (docs/benchmarks.md, issue 13).

It is a measuring instrument, not a gateway: no keys, no routing, one upstream.

    python -m tokenbus.evaluation.pyrelay --port 8100 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import cast
from urllib.parse import urlsplit

from services import runtime


class _Side(asyncio.Protocol):
    """One socket of a pair; what it reads is written to the other."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _Side | None = None
        self._early: list[bytes] = []  # read before the other side was connected
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def pair(self, other: _Side) -> None:
        self.other = other
        early, self._early = self._early, []
        assert other.transport is not None
        for data in early:
            other.transport.write(data)
        if self._eof:
            other.close()

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is None or other.transport is None:
            self._early.append(data)
        else:
            other.transport.write(data)

    def eof_received(self) -> bool | None:
        self._eof = True
        if self.other is not None:
            self.other.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None:
            self.other.close()

    # Flow control: a side whose writes back up stops the other from reading.
    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def address(upstream: str) -> tuple[str, int]:
    """``http://HOST[:PORT]`` -> (host, port); ValueError saying why not."""
    parts = urlsplit(upstream)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--upstream wants http://HOST:PORT, got {upstream!r}")
    return parts.hostname, parts.port or 80


async def serve(host: str, port: int, upstream: str) -> asyncio.Server:
    """Listen on ``host:port``; every connection is relayed to ``upstream`` (http://h:p)."""
    up_host, up_port = address(upstream)
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    def accept() -> _Side:
        client = _Side()

        async def connect() -> None:
            try:
                _, up = await loop.create_connection(_Side, up_host, up_port)
            except OSError:
                client.close()  # the client sees its connection closed, not a hang
                return
            up.pair(client)
            client.pair(up)
            if client.transport is None or client.transport.is_closing():
                up.close()  # the client left while we connected

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    # A backlog as deep as the bridge's: with asyncio's default (100), 256 clients connecting
    # at once overflow it, and a dropped SYN is retried after a second.
    return await loop.create_server(accept, host, port, backlog=4096)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenbus.evaluation.pyrelay", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="http://HOST:PORT of the engine server")
    a = p.parse_args(argv)
    try:
        address(a.upstream)
    except ValueError as exc:
        p.error(str(exc))

    async def run() -> None:
        server = await serve(a.host, a.port, a.upstream)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(run())


if __name__ == "__main__":
    main()
