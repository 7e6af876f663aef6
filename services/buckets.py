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
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus_schemas import errors as E

T = TypeVar("T")


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
        # Through a node just back from a stall too (its JetStream answers 503 "temporarily
        # unavailable" while it catches up): a watcher made again is only a new consumer.
        self._watcher = await through_stall(self.kv.watchall, what="watching a bucket")
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


# While a bucket's stream has no leader (the leader paused or cut off, a new one being
# elected: seconds), reads and writes time out or answer 503. A compare-and-set retries
# through that for up to this long (read at each call: tests set it small).
STALL_RETRY_S = 20.0
_STALL_PAUSE_S = 0.25


def _give_up(stall_s: float | None) -> float:
    """When a retry through a stall that began now gives up."""
    return time.monotonic() + (STALL_RETRY_S if stall_s is None else stall_s)


_NO_LEADER = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
# For a bucket that exists: a publish with no stream to answer is its stream without leader.
_TRANSIENT = (*_NO_LEADER, nats.js.errors.NoStreamResponseError)


# Where a compare-and-set entry keeps the ids of its last writes (a JSON object's key that
# the changes never see): a write whose answer was lost is found there, not made twice.
MARK = "_w"
_MARKS_KEPT = 16


async def cas(
    kv: KeyValue,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    tries: int = 100,
    stall_s: float | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply ``change`` (a JSON object to a new one; it may raise) to the entry at ``key``
    atomically, retrying on a concurrent write (up to ``tries``) and through a leaderless
    stream (up to ``stall_s``): (before, after), without :data:`MARK`.

    Each write carries an id of its own under :data:`MARK` (the last few are kept). A write
    whose answer was lost (a timeout) may have been applied: before trying again, the entry
    is read and, when it holds one of this call's ids, that write's (before, after) is
    returned instead of applying ``change`` twice."""
    give_up = _give_up(stall_s)
    uncertain = False
    clashes = 0
    made: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    while True:
        writing = False
        try:
            try:
                entry = await kv.get(key)
                state = json.loads(entry.value) if entry.value else {}
                rev: int | None = entry.revision
            except KeyNotFoundError:
                state, rev = {}, None
            marks = state.pop(MARK, None)
            marks = marks if isinstance(marks, list) else []
            if uncertain:
                done = next((m for m in marks if m in made), None)
                if done is not None:
                    return made[done]
            new = change(dict(state))
            mark = uuid.uuid4().hex[:12]
            made[mark] = (state, new)
            data = json.dumps(
                {**new, MARK: [*marks, mark][-_MARKS_KEPT:]}, separators=(",", ":")
            ).encode()
            writing = True
            if rev is None:
                await kv.create(key, data)
            else:
                await kv.update(key, data, last=rev)
            return state, new
        except KeyWrongLastSequenceError:
            clashes += 1
            if clashes >= tries:
                raise E.ServiceUnavailable(
                    f"{key}: changed under every one of {tries} tries (concurrent writers, "
                    "or a NATS node cut off from its cluster); retry"
                ) from None
        except _TRANSIENT:
            if time.monotonic() >= give_up:
                raise E.ServiceUnavailable(
                    f"{key}: the bucket's stream has no leader (a NATS node stalled?); retry"
                ) from None
            uncertain = uncertain or writing
            await asyncio.sleep(_STALL_PAUSE_S)


async def through_stall(
    op: Callable[[], Awaitable[T]], *, what: str, stall_s: float | None = None
) -> T:
    """``op()``, tried again while the stream it writes has no leader (up to ``stall_s``).
    Only for an ``op`` that is safe to repeat (a publish with a ``Nats-Msg-Id``)."""
    give_up = _give_up(stall_s)
    while True:
        try:
            return await op()
        except _NO_LEADER:
            if time.monotonic() >= give_up:
                raise E.ServiceUnavailable(
                    f"{what}: the stream has no leader (a NATS node stalled?); retry"
                ) from None
            await asyncio.sleep(_STALL_PAUSE_S)


async def create(kv: KeyValue, key: str, data: bytes, *, stall_s: float | None = None) -> None:
    """Create ``key`` with ``data`` (``KeyWrongLastSequenceError`` when it exists), through
    a leaderless stream (up to ``stall_s``): a create whose answer was lost and that is
    found stored with ``data`` counts as done."""
    give_up = _give_up(stall_s)
    uncertain = False
    while True:
        try:
            await kv.create(key, data)
            return
        except KeyWrongLastSequenceError:
            if not uncertain:
                raise
            try:
                entry = await kv.get(key)
            except _TRANSIENT:
                entry = None
            if entry is not None and entry.value == data:
                return
            if entry is not None:
                raise
        except _TRANSIENT:
            uncertain = True
        if time.monotonic() >= give_up:
            raise E.ServiceUnavailable(
                f"{key}: the bucket's stream has no leader (a NATS node stalled?); retry"
            )
        await asyncio.sleep(_STALL_PAUSE_S)
