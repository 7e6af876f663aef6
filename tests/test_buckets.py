"""services.buckets: a bucket read whole, whichever way nats-py orders its end-of-values
marker (a key store that trusted an early marker refused a valid key in CI)."""

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
from tests.conftest import NatsServer


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


async def test_a_create_whose_answer_was_lost_counts_as_done(kv: Any) -> None:
    await buckets.create(_LostAnswers(kv, lose=1), "k", b"v1")
    assert (await kv.get("k")).value == b"v1"
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await buckets.create(kv, "k", b"v2")  # taken: not overwritten
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await buckets.create(_LostAnswers(kv, lose=0), "k", b"v2")
