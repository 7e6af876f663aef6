"""Reading a JetStream KV bucket whole, without nats-py's race on "the initial values are in".

nats-py marks the end of a watch's initial values with ``None``. When the consumer's info
answer overtakes the values the server already pushed, that marker comes *first* (it sees
nothing pending and nothing received yet), so a cache that trusts it starts empty, and
``KeyValue.keys()`` (built on the same watch) says a full bucket has no keys. Seen in CI as
a valid API key refused by a service that had just opened the key store.

Here the end of the initial values is told from the values themselves: the entry after
which nothing is pending, or the marker when the bucket really was empty; and keys are
listed from the stream's own subject counts, which no watch can overtake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue


async def keys(kv: KeyValue, pattern: str = ">", *, live: bool = False) -> list[str]:
    """The keys of ``kv`` matching ``pattern`` (a subject pattern over keys). A deleted key
    is among them (its marker is a message; a ``get`` of it raises ``KeyNotFoundError``)
    unless ``live``, which reads each key to leave those out. nats-server lists at most
    100 000 subjects in one answer: more keys than that under ``pattern`` are not all seen.
    (nats-py's KeyValue keeps its stream and subject prefix in ``_stream`` and ``_pre``.)"""
    prefix = kv._pre  # "$KV.<bucket>."
    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{prefix}{pattern}")
    found = sorted(s[len(prefix) :] for s in (info.state.subjects or {}))
    if not live:
        return found
    out = []
    for k in found:
        with contextlib.suppress(KeyNotFoundError):
            await kv.get(k)
            out.append(k)
    return out


class Follow:
    """Every change of a bucket handed to ``apply``, the values it holds first; ``synced``
    is set once those are all applied."""

    def __init__(self, kv: KeyValue, apply: Callable[[Any], None]) -> None:
        self.kv = kv
        self.apply = apply
        self.synced = asyncio.Event()
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Follow:
        self._watcher = await self.kv.watchall()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _empty(self) -> bool:
        try:
            return (await self.kv.status()).stream_info.state.messages == 0
        except Exception:  # JetStream did not answer: the values, if any, still follow
            return False

    async def _run(self) -> None:
        async for entry in self._watcher:
            if entry is None:
                # Either nothing was there, or the marker overtook the values (they follow).
                if not self.synced.is_set() and await self._empty():
                    self.synced.set()
                continue
            self.apply(entry)
            if entry.delta == 0:
                self.synced.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
