"""Frames to callers, sent once per event-loop turn.

Under load a sim or vLLM step produces a token for hundreds of streams at once, and most of
those streams belong to a few bridge processes. Frames queued in the same loop turn for
several streams of one tokenbus client travel as one batch message to that client's inbox
prefix: one NATS message instead of hundreds, with every frame kept whole and in order.
Nothing waits for a batch to fill: a lone frame (the first token at low load) goes out in
the same turn it was produced, as a plain message.

Under load a stream's text may also be *held* (:meth:`Outbox.hold`, the worker's
``stream_coalesce_ms``): its runner keeps the text of several engine steps and registers a
drain, which the outbox calls when the hold ends, or at once when anything else is sent to
that stream (its final frame, a keepalive, an error): no frame ever overtakes held text of
its own stream. A stream read from a socket (the ``openai`` backend's upstream) may pause
its reading for the hold as well (``worker.stream_coalesce_reads``): the tokens the upstream
writes meanwhile wait in the socket, and when the hold ends each such stream reads them in
one read before every held stream drains (:data:`READ_GAP_S` later): one system call, one
callback and one parse of a buffer for several tokens instead of one of each per token.

What must reach the bus before a caller hears that its request ended (the usage report
that settles its spend, its telemetry record) is queued with :meth:`Outbox.send_first`
and the :attr:`Outbox.before` hook: each flush hands those to the connection first. One
connection keeps its messages in order, so a worker killed right after a final frame left
has sent them already.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.aio.client import Client as NATS

from bus_schemas import frames, subjects

MAX_BATCH_FRAMES = 1024
MAX_BATCH_BYTES = 256 * 1024
# When a hold ends, the streams whose reading it paused read again, and the held streams
# drain this much later: a timer runs after the loop has polled its sockets, so what waited in
# them has been read into the held text by then.
READ_GAP_S = 0.001


class Reader(Protocol):
    """A stream whose reading can be paused for a hold (the ``openai`` backend's)."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Outbox:
    """Per-connection sender of stream frames with per-client batching."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._pending: dict[str, list[tuple[str, str, bytes]]] = {}
        self._first: list[tuple[str, bytes]] = []
        # Called at each flush before anything queued leaves (the worker's records).
        self.before: Callable[[], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None
        # Streams holding text (reply -> its drain) and the timer that ends their hold.
        self._held: dict[str, Callable[[], None]] = {}
        # Streams whose reading the hold paused (reply -> the stream), and whether the hold
        # has ended and they are reading what waited (the drains follow READ_GAP_S later).
        self._paused: dict[str, Reader] = {}
        self._reading = False
        self._timer: asyncio.TimerHandle | None = None
        self.messages = 0
        self.frames = 0

    def send(self, reply: str, frame: bytes) -> None:
        """Queue ``frame`` for ``reply``, behind the text that stream holds; it leaves in
        this loop turn's flush."""
        if self._paused:
            reader = self._paused.pop(reply, None)
            if reader is not None:
                _guarded(reader.resume_reading, "a paused stream's resume failed")
        if self._held:
            drain = self._held.pop(reply, None)
            if drain is not None:
                drain()
        split = subjects.split_inbox(reply)
        key, tok = split if split else (reply, "")
        self._pending.setdefault(key, []).append((reply, tok, frame))
        self._schedule()

    def hold(
        self, reply: str, drain: Callable[[], None], hold_s: float, reader: Reader | None = None
    ) -> None:
        """``reply``'s stream holds text: ``drain`` sends it (through :meth:`send`) at the
        latest ``hold_s`` after the first stream of this hold began holding, or before any
        other frame to ``reply``. Every stream holding is drained by one timer. With a
        ``reader``, the stream reads nothing more until the hold ends (then what waited is
        read first, and drained with the rest)."""
        self._held[reply] = drain
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(hold_s, self.release)
        # A pause that fails leaves it reading: the hold is only shorter on reads.
        if (
            reader is not None
            and not self._reading
            and reply not in self._paused
            and _guarded(reader.pause_reading, "a held stream's pause failed")
        ):
            self._paused[reply] = reader

    def release(self, now: bool = False) -> None:
        """The hold ends: the streams it paused read again, and every stream that holds text
        drains :data:`READ_GAP_S` later (``now``, or none paused: at once)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._paused:
            paused, self._paused = self._paused, {}
            for reader in paused.values():
                _guarded(reader.resume_reading, "a paused stream's resume failed")
            if not now:
                self._reading = True
                self._timer = asyncio.get_running_loop().call_later(READ_GAP_S, self.release)
                return
        self._reading = False
        held, self._held = self._held, {}
        for drain in held.values():
            _guarded(drain, "a held stream's drain failed")

    def send_first(self, subject: str, data: bytes) -> None:
        """Queue a message that leaves in this loop turn's flush, ahead of every frame."""
        self._first.append((subject, data))
        self._schedule()

    def _schedule(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def flush(self) -> None:
        """Wait until everything queued or held so far has been handed to the connection."""
        self.release(now=True)
        while self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._task)

    async def _flush(self) -> None:
        try:
            while self._pending or self._first:
                if self.before is not None:
                    with contextlib.suppress(Exception):
                        await self.before()
                first, self._first = self._first, []
                for subject, data in first:
                    with contextlib.suppress(Exception):
                        await self.nc.publish(subject, data)
                pending, self._pending = self._pending, {}
                for key, items in pending.items():
                    await self._send_group(key, items)
        finally:
            self._task = None

    async def _send_group(self, key: str, items: list[tuple[str, str, bytes]]) -> None:
        if len(items) == 1 or not items[0][1]:
            for reply, _, frame in items:
                await self._publish(reply, frame)
            return
        batch: list[tuple[str, bytes]] = []
        size = 0
        for _, tok, frame in items:
            batch.append((tok, frame))
            size += len(frame) + len(tok)
            if len(batch) >= MAX_BATCH_FRAMES or size >= MAX_BATCH_BYTES:
                await self._publish(subjects.inbox_batch(key), frames.batch(batch), len(batch))
                batch, size = [], 0
        if batch:
            await self._publish(subjects.inbox_batch(key), frames.batch(batch), len(batch))

    async def _publish(self, subject: str, data: bytes, nframes: int = 1) -> None:
        self.messages += 1
        self.frames += nframes
        # A closed or reconnecting connection loses these frames; the caller's deadline and
        # the router's liveness checks turn that into a retryable error, never a hang.
        with contextlib.suppress(Exception):
            await self.nc.publish(subject, data)


def _guarded(call: Callable[[], None], message: str) -> bool:
    """``call()``, True if it returned: one stream's fault is the loop's to report, never the
    other streams' (their drains, pauses and resumes go on)."""
    try:
        call()
    except Exception as exc:
        asyncio.get_running_loop().call_exception_handler({"message": message, "exception": exc})
        return False
    return True
