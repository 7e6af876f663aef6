"""services.buckets: a bucket read whole, whichever way nats-py orders its end-of-values
marker (a key store that trusted an early marker refused a valid key in CI); writes through
a stalled stream leader; a read never older than its reader's own write; buckets and object
stores opened or made by processes at once, an existing one kept as it is, on a real
nats-server."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest

from bus_schemas import errors as E
from services import buckets
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.bus


@pytest.fixture
async def kv(nats_server: NatsServer) -> AsyncIterator[Any]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    name = f"t_{uuid.uuid4().hex[:10]}"
    yield await js.create_key_value(bucket=name, history=1)
    await js.delete_key_value(name)
    await nc.close()


async def test_keys_lists_live_and_deleted_keys_and_an_empty_bucket(kv: Any) -> None:
    assert await buckets.keys(kv) == []
    for k in ("a.1", "a.2", "b.1"):
        await kv.put(k, b"v")
    await kv.delete("a.2")
    assert await buckets.keys(kv) == ["a.1", "a.2", "b.1"]
    assert await buckets.keys(kv, live=True) == ["a.1", "b.1"]
    assert await buckets.keys(kv, "a.>", live=True) == ["a.1"]
    assert await buckets.keys(kv, "c.>") == []


async def test_follow_syncs_on_an_empty_bucket_and_on_a_full_one(kv: Any) -> None:
    seen: dict[str, bytes] = {}
    later = asyncio.Event()

    def apply(e: Any) -> None:
        seen[e.key] = e.value
        if e.key == "later":
            later.set()

    empty = await buckets.Follow(kv, apply).start()
    await asyncio.wait_for(empty.synced.wait(), 10)
    await empty.close()
    for i in range(300):
        await kv.put(f"k{i}", str(i).encode())
    full = await buckets.Follow(kv, apply).start()
    await asyncio.wait_for(full.synced.wait(), 10)
    assert len(seen) == 300 and seen["k299"] == b"299"  # all in before synced
    await kv.put("later", b"x")
    await asyncio.wait_for(later.wait(), 10)
    await full.close()


class _EarlyMarker:
    """nats-py's watcher as it behaves when the consumer's info overtakes the pushed values:
    the end marker first, then the values (the last with nothing pending after it)."""

    def __init__(self, kv: Any, n: int) -> None:
        self.kv, self.n = kv, n

    async def watchall(self) -> Any:
        return self

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._values()

    async def _values(self) -> AsyncIterator[Any]:
        yield None
        for i in range(self.n):
            await asyncio.sleep(0)
            yield SimpleNamespace(key=f"k{i}", value=b"v", delta=self.n - 1 - i)

    async def stop(self) -> None:
        return None

    async def status(self) -> Any:
        return await self.kv.status()


async def test_an_early_end_marker_does_not_sync_before_the_values(kv: Any) -> None:
    await kv.put("x", b"1")  # the bucket holds something: the marker cannot be the end
    seen: list[str] = []
    follow = await buckets.Follow(_EarlyMarker(kv, 50), lambda e: seen.append(e.key)).start()  # type: ignore[arg-type]
    await asyncio.wait_for(follow.synced.wait(), 10)
    assert len(seen) == 50
    await follow.close()


class _CatchingUp:
    """A bucket on the real bus whose first ``watchall`` calls are answered as a node just
    back from a stall answers them (503, JetStream temporarily unavailable)."""

    def __init__(self, kv: Any, refusals: int) -> None:
        self.kv, self.refusals, self.calls = kv, refusals, 0

    async def watchall(self) -> Any:
        self.calls += 1
        if self.calls <= self.refusals:
            raise nats.js.errors.ServiceUnavailableError(
                code=503, err_code=10008, description="JetStream system temporarily unavailable"
            )
        return await self.kv.watchall()

    async def status(self) -> Any:
        return await self.kv.status()


async def test_following_a_bucket_rides_out_a_node_catching_up(kv: Any) -> None:
    await kv.put("y", b"2")
    seen: list[str] = []
    bucket = _CatchingUp(kv, 2)
    follow = await buckets.Follow(bucket, lambda e: seen.append(e.key)).start()  # type: ignore[arg-type]
    await asyncio.wait_for(follow.synced.wait(), 10)
    assert bucket.calls == 3 and "y" in seen
    await follow.close()
    # Past the stall's span, the 503 is the caller's (a retryable ServiceUnavailable).
    with pytest.raises(E.ServiceUnavailable, match="retry"):
        await buckets.through_stall(_CatchingUp(kv, 10**6).watchall, what="w", stall_s=0.3)


async def test_a_publish_no_stream_answered_is_tried_again_with_its_id(kv: Any) -> None:
    # nats-py says "no response from stream" when no stream answers a JetStream publish: on a
    # stream that exists, its leader is gone for the moment. The same message (its id) goes
    # again until the stream takes it, once; where the stream may not exist, it is raised.
    js = kv._js
    name = f"STALLED_{uuid.uuid4().hex[:8]}"
    tries = 0

    async def publish() -> Any:
        nonlocal tries
        tries += 1
        if tries <= 2:  # the stream's first two answers lost: as nats-py reports them
            raise nats.js.errors.NoStreamResponseError
        return await js.publish(f"{name}.x", b"e", headers={"Nats-Msg-Id": "e1"})

    await js.add_stream(name=name, subjects=[f"{name}.>"])
    try:
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await buckets.through_stall(publish, what="event", stall_s=10)
        ack = await buckets.through_stall(publish, what="event", stall_s=10, stream_exists=True)
        assert tries == 3 and ack.seq == 1
        assert (await js.stream_info(name)).state.messages == 1
    finally:
        await js.delete_stream(name)


class _LostAnswers:
    """A bucket on the real bus whose next ``lose`` writes are made but their answers lost
    (raised as a timeout), as when the stream's leader stalls after storing them."""

    def __init__(self, kv: Any, lose: int) -> None:
        self.kv, self.lose = kv, lose

    async def get(self, key: str) -> Any:
        return await self.kv.get(key)

    async def _lost(self) -> None:
        if self.lose:
            self.lose -= 1
            raise nats.errors.TimeoutError

    async def create(self, key: str, data: bytes) -> int:
        seq = await self.kv.create(key, data)
        await self._lost()
        return int(seq)

    async def update(self, key: str, data: bytes, last: int) -> int:
        seq = await self.kv.update(key, data, last=last)
        await self._lost()
        return int(seq)


class _NoLeader:
    """A bucket whose stream has no leader: every read times out."""

    async def get(self, key: str) -> Any:
        raise nats.errors.TimeoutError


async def test_a_compare_and_set_whose_answer_was_lost_is_not_applied_twice(kv: Any) -> None:
    def add(state: dict[str, Any]) -> dict[str, Any]:
        return {"n": int(state.get("n", 0)) + 1}

    lossy = _LostAnswers(kv, lose=1)
    assert await buckets.cas(lossy, "c", add) == ({}, {"n": 1})  # a create
    assert await buckets.cas(lossy, "c", add) == ({"n": 1}, {"n": 2})
    lossy.lose = 1
    assert await buckets.cas(lossy, "c", add) == ({"n": 2}, {"n": 3})  # an update
    # Another writer between: still applied once, the marks of both kept.
    lossy.lose = 2
    assert (await buckets.cas(lossy, "c", add))[1] == {"n": 4}
    assert await buckets.cas(kv, "c", add) == ({"n": 4}, {"n": 5})
    entry = await kv.get("c")
    assert len(json.loads(entry.value)[buckets.MARK]) == 5
    # A leaderless stream for longer than the bound: a clear, retryable error.
    with pytest.raises(E.ServiceUnavailable):
        await buckets.cas(_NoLeader(), "c", add, stall_s=0.5)


class _CountedReads:
    """A real bucket that counts its reads."""

    def __init__(self, kv: Any) -> None:
        self.kv, self.reads = kv, 0

    async def get(self, key: str) -> Any:
        self.reads += 1
        return await self.kv.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)


async def test_a_compare_and_set_writes_on_what_it_remembers_and_reads_when_stale(
    kv: Any,
) -> None:
    def add(state: dict[str, Any]) -> dict[str, Any]:
        return {"n": int(state.get("n", 0)) + 1}

    counted, known = _CountedReads(kv), {}
    assert await buckets.cas(counted, "r", add, known=known) == ({}, {"n": 1})
    assert counted.reads == 1 and "r" in known
    assert await buckets.cas(counted, "r", add, known=known) == ({"n": 1}, {"n": 2})
    assert counted.reads == 1  # written on the remembered entry, no read
    await buckets.cas(kv, "r", add)  # someone else writes: the memory is stale
    assert await buckets.cas(counted, "r", add, known=known) == ({"n": 3}, {"n": 4})
    assert counted.reads == 2  # the stale write clashed; it read and applied once
    assert json.loads((await kv.get("r")).value)["n"] == 4


async def test_a_create_whose_answer_was_lost_counts_as_done(kv: Any) -> None:
    await buckets.create(_LostAnswers(kv, lose=1), "k", b"v1")
    assert (await kv.get("k")).value == b"v1"
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await buckets.create(kv, "k", b"v2")  # taken: not overwritten
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await buckets.create(_LostAnswers(kv, lose=0), "k", b"v2")


class _StaleFirst:
    """A real bucket whose next ``stale`` reads are answered as a stream leader paused
    before the last writes answers once continued: ``then`` (the entry as it was read
    before them), or not found when it had not been made by then (``then`` None)."""

    def __init__(self, kv: Any, stale: int, then: Any) -> None:
        self.kv, self.stale, self.then, self.reads = kv, stale, then, 0

    async def get(self, key: str) -> Any:
        self.reads += 1
        if self.stale:
            self.stale -= 1
            if self.then is None:
                raise nats.js.errors.KeyNotFoundError
            return self.then
        return await self.kv.get(key)


async def test_a_read_is_never_older_than_this_process_own_write(kv: Any) -> None:
    def add(state: dict[str, Any]) -> dict[str, Any]:
        return {"n": int(state.get("n", 0)) + 1}

    known: dict[str, tuple[dict[str, Any], int]] = {}
    await buckets.cas(kv, "s", add, known=known)
    first = await kv.get("s")
    await buckets.cas(kv, "s", add, known=known)
    # An answer from before this process's last write is read again, until a node that
    # has it answers; one from before the entry was made too.
    for then in (first, None):
        stale = _StaleFirst(kv, stale=3, then=then)
        entry = await buckets.read(stale, "s", known=known)  # type: ignore[arg-type]
        assert json.loads(entry.value)["n"] == 2 and stale.reads == 4
    # Without a write of its own to go by, a read takes what it is given.
    entry = await buckets.read(_StaleFirst(kv, stale=1, then=first), "s")  # type: ignore[arg-type]
    assert json.loads(entry.value)["n"] == 1
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await buckets.read(kv, "never", known=known)
    await kv.put("gone", b"{}")
    known["gone"] = ({}, (await kv.get("gone")).revision)
    await kv.delete("gone")  # deleted since this process's write: gone, not stale
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await buckets.read(kv, "gone", known=known, stall_s=30)
    # Stale for longer than the bound, or no leader at all: a clear, retryable error.
    forever = _StaleFirst(kv, stale=10**6, then=first)
    with pytest.raises(E.ServiceUnavailable, match="retry"):
        await buckets.read(forever, "s", known=known, stall_s=0.3)  # type: ignore[arg-type]
    with pytest.raises(E.ServiceUnavailable, match="retry"):
        await buckets.read(_NoLeader(), "s", stall_s=0.3)  # type: ignore[arg-type]


# -- opening a bucket: buckets.open_kv / open_objects ------------------------------------------


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Any]:
    nc = await nats.connect(nats_server.url)
    yield nc.jetstream()
    await nc.close()


def _name() -> str:
    return f"t_{uuid.uuid4().hex[:10]}"


async def test_processes_opening_a_new_bucket_at_once_all_get_the_one_bucket(js: Any) -> None:
    name, made = _name(), []

    async def on_create(kv: Any) -> None:
        made.append(kv)

    kvs = await asyncio.gather(
        *(
            buckets.open_kv(js, name, ttl=90.0, history=3, max_bytes=1 << 20, on_create=on_create)
            for _ in range(8)
        )
    )
    cfg = (await kvs[0].status()).stream_info.config
    assert (cfg.max_age, cfg.max_msgs_per_subject, cfg.max_bytes) == (90.0, 3, 1 << 20)
    assert cfg.discard == nats.js.api.DiscardPolicy.NEW and cfg.num_replicas == 1
    assert 1 <= len(made) <= 8  # each call that found it missing (repeating is its job)
    await kvs[3].put("k", b"v")
    assert all([(await kv.get("k")).value == b"v" for kv in kvs])
    await js.delete_key_value(name)


async def test_the_loser_of_a_race_with_other_settings_opens_the_winners_bucket(js: Any) -> None:
    # nats-py alone: each create but the first is refused ("stream name already in use").
    name = _name()
    kvs = await asyncio.gather(*(buckets.open_kv(js, name, ttl=60.0 + i) for i in range(8)))
    ttls = {(await kv.status()).stream_info.config.max_age for kv in kvs}
    assert len(ttls) == 1 and ttls <= {60.0 + i for i in range(8)}
    await js.delete_key_value(name)


async def test_an_existing_bucket_is_opened_as_it_is(js: Any) -> None:
    # Settings that differ from the bucket's change nothing (as every site did before).
    name, made = _name(), []
    old = await js.create_key_value(bucket=name, history=2, ttl=30.0)
    await old.put("k", b"kept")
    before = (await old.status()).stream_info

    async def on_create(kv: Any) -> None:
        made.append(kv)

    kv = await buckets.open_kv(
        js, name, history=5, ttl=90.0, max_bytes=1 << 20, discard_old=True, on_create=on_create
    )
    after = (await kv.status()).stream_info
    assert after.config == before.config and after.created == before.created
    assert (await kv.get("k")).value == b"kept" and made == []
    await js.delete_key_value(name)


async def test_a_bucket_that_drops_its_oldest_entries_when_full(js: Any) -> None:
    name = _name()
    kv = await buckets.open_kv(
        js, name, ttl=60.0, max_bytes=4096, storage=nats.js.api.StorageType.FILE, discard_old=True
    )
    cfg = (await kv.status()).stream_info.config
    assert cfg.discard == nats.js.api.DiscardPolicy.OLD and cfg.allow_direct
    assert (cfg.max_age, cfg.max_bytes, cfg.duplicate_window) == (60.0, 4096, 60.0)
    for i in range(40):  # far more than 4 KiB: taken, the oldest dropped
        await kv.put(f"k{i}", b"x" * 200)
    assert (await kv.get("k39")).value == b"x" * 200
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("k0")
    await js.delete_key_value(name)


async def test_object_stores_opened_at_once_are_one_store_and_an_existing_one_is_kept(
    js: Any,
) -> None:
    name = _name()
    stores = await asyncio.gather(
        *(buckets.open_objects(js, name, ttl=60.0 + i, max_bytes=1 << 20) for i in range(8))
    )
    infos = [(await s.status()).stream_info for s in stores]
    assert len({i.config.max_age for i in infos}) == 1 and infos[0].config.max_bytes == 1 << 20
    await stores[5].put("f", b"data")
    assert all([(await s.get("f")).data == b"data" for s in stores])
    again = await buckets.open_objects(js, name, ttl=999.0, max_bytes=1 << 10)
    assert (await again.status()).stream_info.config == infos[0].config
    assert (await again.get("f")).data == b"data"
    await js.delete_object_store(name)


class _Stalled:
    """The bus's JetStream as a node just back from a stall answers its first ``refusals``
    API calls (503, JetStream temporarily unavailable)."""

    def __init__(self, js: Any, refusals: int) -> None:
        self.js, self.refusals, self.calls = js, refusals, 0

    def __getattr__(self, op: str) -> Any:
        async def call(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.calls <= self.refusals:
                raise nats.js.errors.ServiceUnavailableError(
                    code=503, err_code=10008, description="JetStream system temporarily unavailable"
                )
            return await getattr(self.js, op)(*args, **kw)

        return call


async def test_a_bucket_is_opened_and_made_through_a_stalled_node(js: Any) -> None:
    name = _name()
    kv = await buckets.open_kv(_Stalled(js, 2), name)  # type: ignore[arg-type]
    await kv.put("k", b"v")
    assert (await (await js.key_value(name)).get("k")).value == b"v"
    stores = await buckets.open_objects(_Stalled(js, 3), name)  # type: ignore[arg-type]
    assert (await stores.status()).stream_info.config.name == f"OBJ_{name}"
    with pytest.raises(E.ServiceUnavailable, match="retry"):
        await buckets.open_kv(_Stalled(js, 10**6), name, stall_s=0.3)  # type: ignore[arg-type]
    await js.delete_key_value(name)
    await js.delete_object_store(name)


async def test_a_bucket_refused_for_another_reason_says_why(js: Any) -> None:
    # A stream of another name already takes the bucket's subjects: the server's refusal is
    # the error, not "no such bucket".
    name = _name()
    await js.add_stream(name=f"X_{name}", subjects=[f"$KV.{name}.>"])
    with pytest.raises(nats.js.errors.BadRequestError, match="overlap"):
        await buckets.open_kv(js, name)
    await js.delete_stream(f"X_{name}")


async def test_a_stream_opened_at_once_is_one_stream_and_an_existing_one_is_kept(js: Any) -> None:
    name, made = _name(), []

    async def on_create(info: Any) -> None:
        made.append(info)

    def config(max_age: float) -> Any:
        return nats.js.api.StreamConfig(
            name=name,
            subjects=[f"{name}.>"],
            retention=nats.js.api.RetentionPolicy.WORK_QUEUE,
            max_age=max_age,
        )

    infos = await asyncio.gather(
        *(buckets.open_stream(js, config(60.0 + i), on_create=on_create) for i in range(8))
    )
    assert len({i.config.max_age for i in infos}) == 1  # one stream, one winner's settings
    assert 1 <= len(made) <= 8 and {m.config.max_age for m in made} <= {
        i.config.max_age for i in infos
    }
    await js.publish(f"{name}.a", b"x", stream=name)
    again = await buckets.open_stream(_Stalled(js, 2), config(999.0))  # type: ignore[arg-type]
    assert again.config.max_age == infos[0].config.max_age and again.state.messages == 1
    with pytest.raises(E.ServiceUnavailable, match="retry"):
        await buckets.open_stream(_Stalled(js, 10**6), config(1.0), stall_s=0.3)  # type: ignore[arg-type]
    await js.delete_stream(name)


async def test_an_object_read_whose_chunks_vanish_is_bounded_and_read_again(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats.py's object read follows the chunks its description names until the last one,
    with no time limit: when they are purged under it (the object replaced or deleted as it
    reads: a background response's record rewritten while it is polled) it waits for ever.
    buckets.get_object bounds each attempt, reads the description again (a replaced
    object's new chunks), and answers 503 when no attempt can finish. Here the chunks are
    purged and the description left, as a replace caught half-way leaves them."""
    monkeypatch.setattr(buckets, "OBJECT_READ_S", 0.3)  # the bound, small for the test
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    name = f"t_{uuid.uuid4().hex[:10]}"
    store = await js.create_object_store(name)
    try:
        data = uuid.uuid4().bytes * 40_000  # 640 kB: several chunks
        await store.put("rec", data)
        assert (await buckets.get_object(store, "rec")).data == data
        info = await store.get_info("rec")
        await js.purge_stream(f"OBJ_{name}", subject=f"$O.{name}.C.{info.nuid}")
        with pytest.raises(E.ServiceUnavailable):
            await asyncio.wait_for(buckets.get_object(store, "rec"), 30)
        # Replaced while a read hangs on the purged chunks: the next attempt reads the new.
        reading = asyncio.ensure_future(buckets.get_object(store, "rec"))
        await store.put("rec", data[::-1])
        assert (await asyncio.wait_for(reading, 30)).data == data[::-1]
    finally:
        await js.delete_object_store(name)
        await nc.close()
