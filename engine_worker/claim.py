"""One process per replica id (docs/deploy.md, "Replica ids").

A replica's generate subject is its id: two processes started with the same id would both
be sent its requests. Each worker therefore says who it is on ``tb.v1.replica.<id>.claim``
(its boot id and when it started) before it loads its engine, answers every claim of
another process with its own, and says it again every :data:`REPEAT_S`. The older process
keeps the id (start time, then boot id: every process decides alike); a newer one that
hears an older one refuses to start (exit status 2, the reason in its log and on stderr),
and one that hears it only later (a partition healed, a paused process resumed) stops
serving and exits the same way. Until it does, the generate subject's queue group (named
after the replica) gives each request to one of them, never to both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import codec, subjects

REPEAT_S = 5.0  # a serving process says it again this often


class ReplicaTaken(Exception):
    """Another, older process serves this replica id."""


class ReplicaClaim:
    """This process's claim of ``replica``; ``on_lost`` is called (once) when an older
    process turns out to serve it too."""

    def __init__(self, nc: NATS, replica: str, boot: str, on_lost: Callable[[str], None]) -> None:
        self.nc = nc
        self.replica = replica
        self.boot = boot
        self.since_ns = time.time_ns()
        self.on_lost = on_lost
        self.older: dict[str, Any] | None = None  # the process that holds the id
        self._heard = asyncio.Event()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None

    def _mine(self) -> dict[str, Any]:
        return {"replica": self.replica, "boot": self.boot, "since_ns": self.since_ns}

    async def _say(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.replica_claim(self.replica), codec.encode(self._mine()))

    def describe(self) -> str:
        o = self.older or {}
        age = max(0.0, (time.time_ns() - int(o.get("since_ns", 0))) / 1e9)
        return (
            f"replica id {self.replica!r} is already served by another process (boot "
            f"{o.get('boot')}, up {age:.0f} s): give each worker an id of its own "
            "(--replica, TOKENBUS_WORKER__REPLICA), or none for a generated one"
        )

    async def take(self, wait_s: float) -> None:
        """Say the claim and listen ``wait_s`` for an older process's: ReplicaTaken if one
        answers. From then on, answer newer ones and say it again every :data:`REPEAT_S`."""
        self._sub = await self.nc.subscribe(subjects.replica_claim(self.replica), cb=self._on)
        await self._say()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), wait_s)
        if self.older is not None:
            await self.release()
            raise ReplicaTaken(self.describe())
        self._task = asyncio.get_running_loop().create_task(self._repeat())

    async def _repeat(self) -> None:
        while True:
            await asyncio.sleep(REPEAT_S)
            await self._say()

    async def _on(self, msg: Msg) -> None:
        try:
            other = codec.decode_map(msg.data)
            boot, since = str(other["boot"]), int(other["since_ns"])
        except Exception:
            return
        if boot == self.boot:
            return
        if (since, boot) < (self.since_ns, self.boot):  # older: it keeps the id
            if self.older is None:
                self.older = other
                self._heard.set()
                if self._task is not None:  # serving already: stop
                    self.on_lost(self.describe())
            return
        await self._say()  # a newer one: tell it at once

    async def release(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
