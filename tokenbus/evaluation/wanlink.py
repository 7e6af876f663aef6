"""A wide-area link between two processes on loopback: a TCP proxy in the test's own loop
that can add a delay each way, stall (a partition: the connections stay open and nothing
crosses until it heals, as TCP retransmits after a cut cable) or cut (connections closed,
new ones refused), and counts the bytes that cross each way. This kernel has no
``tc netem``; a proxy is the userspace stand-in (issue 71). It does not model loss: over
TCP a lost segment is a delay of a retransmit, which ``delay_s`` stands for. The sites'
tests (tests/test_sites.py) and the nemesis' site faults (nemesis_faults) use it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Self

from tokenbus.launcher import free_port

READ_SIZE = 65536


class WanLink:
    """Listens on ``port`` of ``listen_host`` (a network namespace's host dials the machine's
    address on their bridge) and forwards each connection to ``target_port`` of
    ``target_host``."""

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", listen_host: str = "127.0.0.1"
    ) -> None:
        self.target_port, self.target_host = target_port, target_host
        self.listen_host = listen_host
        self.port = free_port()
        self.delay_s = 0.0
        self.up = 0  # bytes from the dialling side (the site) to the target (the hub)
        self.down = 0  # and back
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._cut = False
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: list[tuple[asyncio.StreamWriter, bytes, Callable[[int], None]]] = []

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        return self

    def stall(self) -> None:
        """Nothing crosses until :meth:`heal`; the connections stay open."""
        self._flowing.clear()

    def cut(self) -> None:
        """Every connection closed, new ones refused until :meth:`heal`."""
        self._cut = True
        for w in list(self._conns):
            w.transport.abort()

    def heal(self) -> None:
        self._cut = False
        self._flowing.set()
        held, self._held = self._held, []
        for dst, data, count in held:
            if not dst.is_closing():
                dst.write(data)
                count(len(data))

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_w))

        def count_up(n: int) -> None:
            self.up += n

        def count_down(n: int) -> None:
            self.down += n

        pumps = [
            self._spawn(self._pump(reader, up_w, count_up)),
            self._spawn(self._pump(up_r, writer, count_down)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for w in (writer, up_w):
            self._conns.discard(w)
            w.transport.abort()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: Callable[[int], None]
    ) -> None:
        """Bytes from ``src`` to ``dst`` in order, each written ``delay_s`` after it was read
        (a timer, not a wait: the loop goes on reading); while stalled, held until healed."""
        loop = asyncio.get_running_loop()
        last_due = 0.0

        def deliver(data: bytes) -> None:
            if not self._flowing.is_set():
                self._held.append((dst, data, count))
                return
            if not dst.is_closing():
                dst.write(data)
                count(len(data))

        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._flowing.wait()
                data = await src.read(READ_SIZE)
                if not data:
                    return
                last_due = max(last_due, loop.time() + self.delay_s)
                loop.call_at(last_due, deliver, data)
