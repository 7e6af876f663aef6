"""JetStream buckets: the one place tokenbus opens and writes them.

* :func:`open_kv` and :func:`open_objects` open a KV bucket or an object store, creating it
  when missing (:func:`open_stream` a plain stream): through a node just back from a stall,
  and through two processes creating it at once (the one that loses opens the other's).
* :func:`cas` (compare-and-set of a JSON entry), :func:`create` and :func:`through_stall`
  write through a stream without leader, never applying a write twice.
* :func:`read` reads an entry through a stall, never older than this process's own write.
* :func:`keys` and :class:`Follow` read a bucket whole, without nats-py's race on "the
  initial values are in"; :func:`values` reads the entries under some keys in one pass.

That race: nats-py marks the end of a watch's initial values with ``None``. When the
consumer's info answer overtakes the values the server already pushed, that marker comes
*first* (it sees nothing pending and nothing received yet), so a cache that trusts it starts
empty, and ``KeyValue.keys()`` (built on the same watch) says a full bucket has no keys.
Seen in CI as a valid API key refused by a service that had just opened the key store.
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
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus_schemas import errors as E
from services import logging as tlog
from services.config import kv_replicas

T = TypeVar("T")
log = tlog.get("buckets")


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


async def values(
    kv: KeyValue, patterns: list[str], *, most: int, timeout: float = 5.0
) -> tuple[list[tuple[str, bytes]], bool]:
    """The latest value of each key of ``kv`` matching one of ``patterns`` (subject patterns
    over keys; deleted keys left out), in one pass of a consumer made for it (one message
    per key, not a ``get`` each), oldest change first: at most ``most`` of them, and whether
    more were left unread."""
    js: JetStreamContext = kv._js
    prefix, stream = kv._pre, kv._stream
    filters = [prefix + p for p in patterns]
    name = f"read-{uuid.uuid4().hex[:12]}"
    cfg = api.ConsumerConfig(
        name=name,
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=30.0,
        mem_storage=True,
        **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
    )
    left = (await js.add_consumer(stream, config=cfg, timeout=timeout)).num_pending or 0
    out: list[tuple[str, bytes]] = []

    def keep(msgs: list[Msg]) -> None:
        for m in msgs:
            if m.data and not (m.headers or {}).get("KV-Operation"):
                out.append((m.subject[len(prefix) :], m.data))

    await read_consumer(js, stream, name, min(left, most), keep, timeout=timeout)
    return out, left > most


async def read_consumer(
    js: JetStreamContext,
    stream: str,
    name: str,
    left: int,
    on_batch: Callable[[list[Msg]], None],
    *,
    timeout: float,
    batch: int = 256,
) -> None:
    """Fetch ``left`` messages from ``stream``'s pull consumer ``name`` (one made for this
    read, acknowledging nothing), ``batch`` at a time, each batch handed to ``on_batch``;
    the consumer is deleted after, whatever happened."""
    try:
        sub = await js.pull_subscribe_bind(name, stream=stream)
        try:
            while left > 0:
                msgs = await sub.fetch(min(left, batch), timeout=timeout)
                on_batch(msgs)
                left -= len(msgs)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)


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
# A stale answer is a node that has not yet heard of a new leader: milliseconds.
_FRESH_PAUSE_S = 0.02


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
    known: dict[str, tuple[dict[str, Any], int]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply ``change`` (a JSON object to a new one; it may raise) to the entry at ``key``
    atomically, retrying on a concurrent write (up to ``tries``) and through a leaderless
    stream (up to ``stall_s``): (before, after), without :data:`MARK`.

    Each write carries an id of its own under :data:`MARK` (the last few are kept). A write
    whose answer was lost (a timeout) may have been applied: before trying again, the entry
    is read and, when it holds one of this call's ids, that write's (before, after) is
    returned instead of applying ``change`` twice.

    ``known``: the caller's memory of entries it wrote last (key: (entry, revision)). The
    first try then writes on what it remembers, without reading the entry first (one round
    trip instead of two); someone else's write since makes it clash, and it reads. Updated
    with each write that lands. A change refused (raised) on the remembered entry is applied
    again to the entry as read: only a write would have found the memory stale."""
    give_up = _give_up(stall_s)
    uncertain = False
    clashes = 0
    made: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    remembered = known.pop(key, None) if known is not None else None
    rev: int | None
    while True:
        writing = False
        from_memory = False
        try:
            if remembered is not None:
                state, rev = dict(remembered[0]), remembered[1]
                remembered = None
                from_memory = True
            else:
                try:
                    entry = await kv.get(key)
                    state = json.loads(entry.value) if entry.value else {}
                    rev = entry.revision
                except KeyNotFoundError:
                    state, rev = {}, None
            marks = state.pop(MARK, None)
            marks = marks if isinstance(marks, list) else []
            if uncertain:
                done = next((m for m in marks if m in made), None)
                if done is not None:
                    return made[done]
            try:
                new = change(dict(state))
            except Exception:
                if from_memory:
                    # Refused on what this process remembers, which another may have
                    # changed since (a hold it made): decided again on the entry as it is.
                    continue
                if await _read_behind(kv, key, rev):
                    # Refused on a read that a replica behind the stream's leader answered
                    # (a bucket's reads go to any replica: one cut off from its cluster, or
                    # catching up, answers with an older entry). A write would have found it
                    # stale; a refusal must too, or a usage report found "no hold" on an
                    # entry from before its hold and was dropped as settled (the nemesis
                    # run's undercharge, docs/nemesis.md finding 16).
                    clashes += 1
                    if clashes >= tries:
                        raise E.ServiceUnavailable(
                            f"{key}: read behind the stream's leader on every one of {tries} "
                            "tries (a NATS node cut off from its cluster); retry"
                        ) from None
                    continue
                raise
            mark = uuid.uuid4().hex[:12]
            made[mark] = (state, new)
            body = {**new, MARK: [*marks, mark][-_MARKS_KEPT:]}
            data = json.dumps(body, separators=(",", ":")).encode()
            writing = True
            if rev is None:
                written = await kv.create(key, data)
            else:
                written = await kv.update(key, data, last=rev)
            if known is not None and isinstance(written, int):
                known[key] = (body, written)
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


async def leader_read(kv: KeyValue, key: str) -> api.RawStreamMsg | None:
    """``key``'s last message as the bucket stream's leader holds it (the leader's own read,
    not a direct get, which any replica may answer: one that has stored a write but not yet
    applied it answers "not found"); None when there is no entry or it was deleted."""
    js: JetStreamContext = kv._js  # nats-py keeps the bucket's stream and subject prefix
    try:
        msg = await js.get_last_msg(kv._stream, f"{kv._pre}{key}", direct=False)
    except nats.js.errors.NotFoundError:
        return None
    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
        return None
    return msg


async def _read_behind(kv: KeyValue, key: str, rev: int | None) -> bool:
    """Whether the stream's leader holds another revision of ``key`` than ``rev`` (None: no
    entry), the one a read gave (:func:`leader_read`): a change refused on that read stands
    only where the leader agrees."""
    msg = await leader_read(kv, key)
    return rev is not None if msg is None else msg.seq != rev


class _NothingToWrite(Exception):
    """Every change of a group was refused: the entry stays as it is."""

    def __init__(self, outcomes: list[Any]) -> None:
        super().__init__("nothing to write")
        self.outcomes = outcomes


Change = Callable[[dict[str, Any]], dict[str, Any]]


class Grouped:
    """Changes to one entry committed together, by :func:`cas`: while a write to the entry
    is in flight, the changes that come meanwhile wait and go as one compare-and-set when it
    is done, each applied to the state the one before it left. A change that raises one of
    ``refusals`` is left out and raises to its caller alone (a group whose every change was
    refused writes nothing); any other failure fails the whole group. Many requests of one
    key in one process then cost one write per round trip instead of one each, and never
    race each other for the entry's revision; only other processes' writes clash.

    The group is written in a task of its own: a caller cancelled meanwhile does not stop
    the others' changes. ``known``: as :func:`cas`'s (the next write skips the read)."""

    def __init__(
        self,
        kv: Callable[[], KeyValue],
        *,
        tries: int = 100,
        refusals: tuple[type[BaseException], ...] = (Exception,),
        known: dict[str, tuple[dict[str, Any], int]] | None = None,
    ) -> None:
        self._kv = kv
        self._tries = tries
        self._refusals = refusals
        self._known = known
        self._waiting: dict[str, list[tuple[Change, asyncio.Future[Any]]]] = {}
        self._writing: set[str] = set()
        self._committing: set[asyncio.Task[None]] = set()

    async def apply(self, key: str, change: Change) -> tuple[dict[str, Any], dict[str, Any]]:
        """Apply ``change`` (which may raise) to the entry at ``key`` atomically: (before,
        after); through a stalled stream leader too, never twice."""
        fut: asyncio.Future[tuple[dict[str, Any], dict[str, Any]]]
        fut = asyncio.get_running_loop().create_future()
        # Its caller may be gone (cancelled) when it is decided: never an unread exception.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._waiting.setdefault(key, []).append((change, fut))
        if key not in self._writing:
            self._writing.add(key)
            task = asyncio.get_running_loop().create_task(self._commit(key))
            self._committing.add(task)
            task.add_done_callback(self._committing.discard)
        return await asyncio.shield(fut)

    async def _commit(self, key: str) -> None:
        """Write the changes waiting for ``key``, a group at a time, until none wait."""
        try:
            while self._waiting.get(key):
                await self._commit_group(key, self._waiting.pop(key))
        finally:
            self._writing.discard(key)

    async def _commit_group(
        self, key: str, group: list[tuple[Change, asyncio.Future[Any]]]
    ) -> None:
        # Each try's outcome per change, by the state that try would write (the write that
        # landed is known by what cas returns).
        tries: dict[int, list[Any]] = {}

        def apply(cur: dict[str, Any]) -> dict[str, Any]:
            state = cur
            outcomes: list[Any] = []
            for change, _ in group:
                try:
                    after = change(dict(state))
                except self._refusals as exc:  # that change alone is left out
                    outcomes.append(exc)
                    continue
                outcomes.append((state, after))
                state = after
            if all(isinstance(o, BaseException) for o in outcomes):
                raise _NothingToWrite(outcomes)
            tries[id(state)] = outcomes
            return state

        try:
            _, written = await cas(self._kv(), key, apply, tries=self._tries, known=self._known)
            outcomes = tries[id(written)]
        except _NothingToWrite as nothing:
            outcomes = nothing.outcomes
        except Exception as exc:  # the write failed: every change in it did
            outcomes = [exc] * len(group)
        for (_, fut), outcome in zip(group, outcomes, strict=True):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)


async def through_stall(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    stall_s: float | None = None,
    stream_exists: bool = False,
) -> T:
    """``op()``, tried again while the stream it writes has no leader (up to ``stall_s``).
    Only for an ``op`` that is safe to repeat (a publish with a ``Nats-Msg-Id``).
    ``stream_exists``: a JetStream publish that no stream answered (nats-py's
    ``NoStreamResponseError``) is that stream without a leader, tried again too."""
    give_up = _give_up(stall_s)
    stalled = _TRANSIENT if stream_exists else _NO_LEADER
    while True:
        try:
            return await op()
        except stalled:
            if time.monotonic() >= give_up:
                raise E.ServiceUnavailable(
                    f"{what}: the stream has no leader (a NATS node stalled?); retry"
                ) from None
            await asyncio.sleep(_STALL_PAUSE_S)


async def read(
    kv: KeyValue,
    key: str,
    *,
    known: dict[str, tuple[dict[str, Any], int]] | None = None,
    stall_s: float | None = None,
) -> KeyValue.Entry:
    """``kv.get(key)`` through a leaderless stream (up to ``stall_s``), never older than this
    process's own last write of ``key`` (``known``, as :func:`cas`'s): read your writes.

    A JetStream read is not linearizable. A stream leader paused (SIGSTOP) and continued
    still takes itself for the leader until it hears of the term elected meanwhile, and
    answers a read, direct or through the leader's API, from its state before the pause
    (seen in CI: a spend read as it was before 20 settlements acknowledged through the new
    leader). Such an answer is told by its revision, older than the one this process wrote,
    and read again."""
    at_least = known[key][1] if known is not None and key in known else None
    give_up = _give_up(stall_s)
    while True:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError as exc:
            # (a key deleted since this process's write is gone: its marker is newer)
            marker = getattr(exc, "entry", None)
            if at_least is None or (marker is not None and (marker.revision or 0) >= at_least):
                raise
        except _NO_LEADER:
            pass
        else:
            if at_least is None or (entry.revision or 0) >= at_least:
                return entry
        if time.monotonic() >= give_up:
            raise E.ServiceUnavailable(
                f"{key}: no node answered with the entry as last written (a NATS node "
                "stalled?); retry"
            )
        await asyncio.sleep(_FRESH_PAUSE_S)


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
            except (*_TRANSIENT, KeyNotFoundError):  # (not found: a stale node's answer)
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


# -- opening ----------------------------------------------------------------------------------
S = TypeVar("S")


_VISIBLE_S = 5.0  # how long a stream just made may stay unknown to the node asked


async def _open_or_create(
    open_: Callable[[], Awaitable[S]],
    make: Callable[[], Awaitable[object]],
    *,
    what: str,
    on_create: Callable[[S], Awaitable[None]] | None,
    stall_s: float | None,
) -> S:
    """``open_()``, after ``make()`` when it is missing (``BucketNotFoundError``); a
    ``make()`` refused because the stream exists (another process made it meanwhile, its
    settings maybe not these) opens that one. All of it again through a stall: opening is
    a read, and creating a stream again with the same settings is no change."""

    async def attempt() -> tuple[S, bool]:
        try:
            return await open_(), False
        except BucketNotFoundError:
            pass
        try:
            await make()
        except BadRequestError as exc:  # "stream name already in use": made meanwhile
            try:
                return await open_(), True
            except BucketNotFoundError:
                raise exc from None  # refused for another reason: that is the error
        # Made: on a cluster, the node asked may not know the new stream for a moment.
        give_up = time.monotonic() + _VISIBLE_S
        while True:
            try:
                return await open_(), True
            except BucketNotFoundError:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(0.1)

    store, made = await through_stall(attempt, what=what, stall_s=stall_s)
    if made and on_create is not None:
        await on_create(store)
    return store


async def open_kv(
    js: JetStreamContext,
    name: str,
    *,
    history: int = 1,
    ttl: float | None = None,
    max_bytes: int | None = None,
    storage: api.StorageType | None = None,
    replicas: int | None = None,
    description: str | None = None,
    discard_old: bool = False,
    max_msgs: int | None = None,
    on_create: Callable[[KeyValue], Awaitable[None]] | None = None,
    stall_s: float | None = None,
) -> KeyValue:
    """The KV bucket ``name``, created when missing with these settings (``ttl``: seconds
    an entry lives; ``replicas``: ``kv_replicas()`` when not given; ``storage``: the
    server's default, file, when not given).

    An existing bucket is opened as it is: settings that differ from it change nothing
    (nor does a process that loses the race to create it: it opens the winner's bucket).
    Through a stalled node too (503 or timeouts, up to ``stall_s``).

    ``discard_old``: a full bucket (``max_bytes``) drops its oldest entries to take a new
    one, where nats-py's buckets refuse the new one; ``max_msgs`` (with ``discard_old``
    only): at most this many entries, the oldest dropped first. ``on_create``: awaited with
    the bucket by a call that found it missing (by each of two that race to make it: it
    must be safe to repeat), e.g. to fill an index from records kept elsewhere."""
    reps = kv_replicas() if replicas is None else replicas
    if max_msgs is not None and not discard_old:
        raise ValueError("max_msgs bounds a bucket that discards its oldest entries only")

    async def make() -> object:
        if not discard_old:
            return await js.create_key_value(
                bucket=name,
                history=history,
                ttl=ttl,
                max_bytes=max_bytes,
                storage=storage,
                replicas=reps,
                description=description,
            )
        # As nats-py's create_key_value makes a bucket, but discarding the oldest entries.
        dup = 120.0 if not ttl else min(120.0, ttl)
        return await js.add_stream(
            api.StreamConfig(
                name=f"KV_{name}",
                description=description,
                subjects=[f"$KV.{name}.>"],
                allow_direct=True,
                allow_rollup_hdrs=True,
                deny_delete=True,
                discard=api.DiscardPolicy.OLD,
                duplicate_window=dup,
                max_age=ttl,
                max_bytes=max_bytes,
                max_msgs=max_msgs,
                max_msgs_per_subject=history,
                num_replicas=reps,
                storage=storage,
            )
        )

    return await _open_or_create(
        lambda: js.key_value(name), make, what=name, on_create=on_create, stall_s=stall_s
    )


async def open_objects(
    js: JetStreamContext,
    name: str,
    *,
    ttl: float | None = None,
    max_bytes: int | None = None,
    storage: api.StorageType | None = None,
    replicas: int | None = None,
    description: str | None = None,
    on_create: Callable[[ObjectStore], Awaitable[None]] | None = None,
    stall_s: float | None = None,
) -> ObjectStore:
    """The object store ``name``, created when missing with these settings; as
    :func:`open_kv` (an existing store opened as it is, the race to create it and a stalled
    node survived)."""
    config = api.ObjectStoreConfig(
        bucket=name,
        description=description,
        ttl=ttl,
        max_bytes=max_bytes,
        storage=storage,
        replicas=kv_replicas() if replicas is None else replicas,
    )
    return await _open_or_create(
        lambda: js.object_store(name),
        lambda: js.create_object_store(name, config=config),
        what=name,
        on_create=on_create,
        stall_s=stall_s,
    )


# An object store read: its bound per attempt is this plus a second per MiB of the object.
OBJECT_READ_S = 5.0
OBJECT_READ_ATTEMPTS = 3


async def get_object(store: ObjectStore, name: str) -> ObjectStore.ObjectResult:
    """``store.get(name)``, bounded. nats.py's read follows the object's chunks until the
    last one with no time limit: when the object is replaced or deleted while it reads (a
    background response's record rewritten as it ends, polled meanwhile), the chunks it
    follows are purged and it waits for ever. Each attempt is bounded by the object's size
    and the next one reads its description again (the newer version's chunks); after
    :data:`OBJECT_READ_ATTEMPTS` the store is unavailable (503). Not found is raised as
    the store raises it."""
    for attempt in range(OBJECT_READ_ATTEMPTS):
        info = await store.get_info(name)
        bound = OBJECT_READ_S + (info.size or 0) / 2**20
        try:
            return await asyncio.wait_for(store.get(name), bound)
        except TimeoutError:
            log.warning("object_read_timed_out", object=name[:200], attempt=attempt + 1)
    raise E.ServiceUnavailable("the object store did not answer in time; retry")


async def open_stream(
    js: JetStreamContext,
    config: api.StreamConfig,
    *,
    on_create: Callable[[api.StreamInfo], Awaitable[None]] | None = None,
    stall_s: float | None = None,
) -> api.StreamInfo:
    """The stream ``config.name`` (its info), made with ``config`` when missing; an existing
    one (or one another process made meanwhile) is left as it is: the caller checks what it
    needs of it. ``on_create`` as for :func:`open_kv`. Through a stalled node too."""
    name = str(config.name)

    async def attempt() -> tuple[api.StreamInfo, bool]:
        try:
            return await js.stream_info(name), False
        except NotFoundError:
            pass
        try:
            return await js.add_stream(config), True
        except BadRequestError:  # made meanwhile by another process
            return await js.stream_info(name), False

    info, made = await through_stall(attempt, what=name, stall_s=stall_s)
    if made and on_create is not None:
        await on_create(info)
    return info
