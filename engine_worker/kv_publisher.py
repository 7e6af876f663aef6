"""A worker's KV events on the bus: the engine's prefix-cache events published in batches,
and snapshot requests answered (:mod:`bus_schemas.kv_events`, docs/kv-events.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from bus_schemas import codec, marks, subjects
from bus_schemas import kv_events as KV
from engine_worker.backends.base import KVEventSource


@dataclass(eq=False)
class KVPublisher:
    """The events of one engine's prefix cache (one that reports itself, such as the sim
    with ``kv_cache_blocks``), published for the routers' KV indexes."""

    nc: Any
    source: KVEventSource
    model: str
    replica: str
    boot: str
    interval_s: float  # how long events are gathered into one publication (0: a loop turn)
    own_reply: Callable[[Msg], str | None]  # a snapshot request's reply, if from a role
    _sub: Any = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _closing: bool = field(default=False, init=False)

    async def start(self) -> None:
        """Publish the engine's KV events and answer snapshot requests from now on."""
        self.source.on_events(self._wake.set)
        self._sub = await self.nc.subscribe(
            subjects.kv_snapshot(self.model, self.replica), cb=self._on_snapshot
        )
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def hashing_kind(self) -> str:
        """How its events are hashed: as the sim ("text") or as vLLM ("vllm")."""
        hashing = getattr(self.source, "hashing", None)
        return str(hashing.get("kind")) if isinstance(hashing, dict) else KV.SCHEME_TEXT

    async def _loop(self) -> None:
        """Publish pending KV events, gathered over ``interval_s`` (or one event-loop turn)
        into as few messages as hold them, until stopped."""
        while True:
            await self._wake.wait()
            if not self._closing:
                await asyncio.sleep(self.interval_s)  # 0: the events of this loop turn
            self._wake.clear()
            await self._publish()
            if self._closing:
                return

    async def _publish(self) -> None:
        kv = self.source
        first, events = kv.drain_events()
        if not events:
            return
        subject = subjects.kv_events(self.model, self.replica)
        for batch in KV.batches(
            replica=self.replica,
            model=self.model,
            boot=self.boot,
            block_size=kv.block_size,
            seq_first=first,
            events=events,
            ts_ms=marks.now_ms(),
        ):
            # A batch lost here is a gap in the numbers: its readers ask for a snapshot.
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, codec.encode(batch))

    async def _on_snapshot(self, msg: Msg) -> None:
        """Answer a snapshot request (whatever its body) with the cache as it is now, in as
        many pages as it takes, all built at this instant."""
        kv = self.source
        if not self.own_reply(msg):
            return
        seq, blocks = kv.snapshot()
        pages = KV.snapshot_pages(
            replica=self.replica,
            model=self.model,
            boot=self.boot,
            block_size=kv.block_size,
            capacity_blocks=kv.capacity,
            seq=seq,
            blocks=blocks,
            stats=kv.stats(),
            medium=kv.medium,
            hashing=getattr(kv, "hashing", None),
        )
        for page in pages:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, codec.encode(page))

    async def stop(self) -> None:
        """After the engine stopped: publish its last events (its cache cleared), then stop."""
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 2.0)
        self.source.on_events(None)
