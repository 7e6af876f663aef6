"""A TCP load balancer with health checks, for the harnesses (the nemesis): what HAProxy does
in front of the compose profile's two bridges (compose/haproxy.cfg), in this process, so a
run needs no HAProxy installed.

It sends each new client connection to a backend whose ``GET /ready`` answered 200 at its
last ``rise`` checks (every ``check_every_s``; out after ``fall`` failures), least
connections first; a connection the chosen backend refuses is tried on the next one (no byte
went upstream, so nothing is sent twice). Once connected, bytes pass both ways unchanged
until either side closes: a backend that dies mid-stream cuts that connection, as with any
balancer. It runs on the harness's own "host", so a crashed host never takes it down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Backend:
    host: str
    port: int
    up: bool = False
    passes: int = 0
    fails: int = 0
    open: int = 0  # connections through it now
    served: int = 0  # connections it was given


@dataclass
class Balancer:
    backends: list[Backend]
    check_every_s: float = 0.5
    rise: int = 2
    fall: int = 2
    connect_timeout_s: float = 1.0
    refused: int = 0  # client connections no backend took
    retried: int = 0  # connections tried on another backend after a refusal
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def of(cls, ports: list[int], host: str = "127.0.0.1", check_every_s: float = 0.5) -> Balancer:
        return cls([Backend(host, p) for p in ports], check_every_s=check_every_s)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (a free port by default) and start checking; the port."""
        for b in self.backends:  # known good at once when they already are
            if await self._ready(b):
                b.up, b.passes = True, self.rise
        self._spawn(self._check_loop())
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ready(self, b: Backend) -> bool:
        try:
            r, w = await asyncio.wait_for(
                asyncio.open_connection(b.host, b.port), self.connect_timeout_s
            )
        except (OSError, TimeoutError):
            return False
        try:
            w.write(b"GET /ready HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")
            line = await asyncio.wait_for(r.readline(), self.check_every_s * 2 + 1)
            return line.split(b" ")[1:2] == [b"200"]
        except (OSError, TimeoutError, IndexError):
            return False
        finally:
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()

    async def _check_loop(self) -> None:
        while True:
            results = await asyncio.gather(*(self._ready(b) for b in self.backends))
            for b, ok in zip(self.backends, results, strict=True):
                if ok:
                    b.passes, b.fails = b.passes + 1, 0
                    b.up = b.up or b.passes >= self.rise
                else:
                    b.passes, b.fails = 0, b.fails + 1
                    b.up = b.up and b.fails < self.fall
            await asyncio.sleep(self.check_every_s)

    def _order(self) -> list[Backend]:
        up = sorted((b for b in self.backends if b.up), key=lambda b: (b.open, b.served))
        return up or sorted(self.backends, key=lambda b: b.open)  # none checked up: try all

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        chosen: Backend | None = None
        for i, b in enumerate(self._order()):
            try:
                upstream = await asyncio.wait_for(
                    asyncio.open_connection(b.host, b.port), self.connect_timeout_s
                )
            except (OSError, TimeoutError):
                b.passes, b.fails = 0, b.fails + 1  # a refusal counts as a failed check
                b.up = b.up and b.fails < self.fall
                continue
            chosen = b
            self.retried += i > 0
            break
        if upstream is None or chosen is None:
            self.refused += 1
            writer.close()
            return
        chosen.open += 1
        chosen.served += 1
        up_r, up_w = upstream
        loop = asyncio.get_running_loop()
        pipes = [loop.create_task(_pipe(reader, up_w)), loop.create_task(_pipe(up_r, writer))]
        try:
            # Either side closing (or failing: a backend that died) ends the connection.
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            chosen.open -= 1
            for t in pipes:
                t.cancel()
            for w in (writer, up_w):
                w.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Bytes from ``src`` to ``dst`` until ``src`` ends or either side fails."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
