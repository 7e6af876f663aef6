"""A bound on what one API key's large request bodies hold in the shared store
(auth/bodyquota.py, docs/large-requests.md "Who may do what"): on the locked bus with the auth
callout, two auth instances (two janitors), ingress, the router and a worker as real processes.
A key's own NATS connection writes its bodies, as tests/test_tenant_attacks.py's do. Before
the change nothing bounded them: one key could fill the 4 GiB every tenant shares."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from nats.aio.msg import Msg

from auth.bodyquota import MIN_CHARGE, STORED_OVERHEAD, Chunk, Tally, charge
from auth.store import KeyStore
from bus_schemas import subjects
from bus_schemas.errors import TokenbusError
from services import bodies
from services.natsconf import role_login
from tests.lockedbus import LockedBus, serve_when_ready
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

MODEL = "quota-model"
QUOTA = 4 << 20  # bodies.max_bytes_per_key in this stack: two 1.6 MB bodies fit, three do not
BIG = [{"role": "user", "content": "tell me " * 200_000}]  # 1.6 MB: seven chunks
OWNER_QUOTA = 6 << 20  # bodies.max_bytes_per_owner: all the keys of one owner together
ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
    "TOKENBUS_BODIES__MAX_BYTES_PER_KEY": str(QUOTA),
    "TOKENBUS_BODIES__MAX_BYTES_PER_OWNER": str(OWNER_QUOTA),
    "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "50000000",
}


class Stack:
    def __init__(self, bus: LockedBus, store: KeyStore, admin: Any, metrics: list[int]) -> None:
        self.bus = bus
        self.store = store
        self.admin = admin
        self.js = admin.jetstream()
        self.metrics = metrics  # each auth instance's scrape port

    async def key(self, name: str, **fields: Any) -> tuple[str, str]:
        key, rec = await self.store.create(name, **fields)
        await serve_when_ready(self.bus.url, key, MODEL)
        return key, rec.id

    async def metric(self, name: str) -> list[float]:
        """``name``'s value on each auth instance."""
        out = []
        async with httpx.AsyncClient() as h:
            for port in self.metrics:
                text = (await h.get(f"http://127.0.0.1:{port}/metrics")).text
                line = next(x for x in text.splitlines() if x.startswith(name + " "))
                out.append(float(line.split()[1]))
        return out

    async def held(self, key_id: str) -> set[str]:
        """The subjects of the key's chunks in the store now."""
        info = await self.js.stream_info(
            subjects.BODIES_STREAM, subjects_filter=subjects.key_bodies(key_id)
        )
        return set(info.state.subjects or {})

    async def last_seq(self) -> int:
        return int((await self.js.stream_info(subjects.BODIES_STREAM)).state.last_seq)

    async def heard(self) -> None:
        """Until both janitors have accounted for every chunk in the store now (their checks
        of a key over its quota included)."""
        last = await self.last_seq()

        async def both() -> bool:
            return min(await self.metric("tokenbus_body_quota_heard_seq")) >= last

        await wait_for(both, what="both janitors heard the store")

    async def purges(self) -> float:
        return sum(await self.metric("tokenbus_body_quota_purges_total"))


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("bodyquota")
    bus = LockedBus(tmp / "locked").start()
    ports = [free_port(), free_port()]

    def env_for(role: str, i: int) -> dict[str, str]:
        scrape = {"TOKENBUS_METRICS_PORT": str(ports[i])} if role == "auth" else {}
        return {**bus.env(role), **scrape}

    try:
        with Procs(bus.url, tmp) as procs:
            await start_stack(
                procs,
                MODEL,
                "ingress",
                "auth",
                "auth",
                "router",
                bridge=False,
                env=ENV,
                env_for=env_for,
                login=role_login(bus.users, "admin"),
            )
            admin = await bus.admin()
            store = await KeyStore(admin).open(watch=False)
            yield Stack(bus, store, admin, ports)
            await admin.drain()
    finally:
        bus.stop()


def _stored(subject: str, size: int) -> int:
    """What the janitor counts for a message of ``size`` bytes of data on ``subject``."""
    return max(MIN_CHARGE, STORED_OVERHEAD + len(subject) + size)


async def _object(c: Client) -> tuple[dict[str, Any], int]:
    """A chat body the key's connection uploaded as Stream.start does, and what it counts."""
    body = {"model": MODEL, "messages": BIG, "max_tokens": 2}
    claim = await bodies.put(c.nc, body, c.owner)
    sizes = [bodies.CHUNK] * (claim["chunks"] - 1)
    sizes.append(claim["size"] - sum(sizes))
    counts = [
        _stored(subjects.body_chunk(c.owner, claim["id"], n), size) for n, size in enumerate(sizes)
    ]
    return body, sum(counts)


@pytest.mark.stack
async def test_a_key_over_its_quota_loses_its_bodies_and_no_other_key_does(stack: Stack) -> None:
    """A key writing chunks past its quota without sending requests: both janitors hear it,
    one purge removes every chunk of that key (the other janitor's removes nothing: one
    purge counted, logged once), the request that still names one of them gets 429 naming
    the quota; another key's bodies stay and its large request is served; below the quota
    nothing is touched; and the purged key's next body, under its quota, is left alone."""
    key_h, id_h = await stack.key("hostile")
    key_v, id_v = await stack.key("victim")
    async with (
        await Client.connect(stack.bus.url, api_key=key_h) as th,
        await Client.connect(stack.bus.url, api_key=key_v) as tv,
    ):
        theirs, _ = await _object(tv)
        mine, held = await _object(th)
        # Chunks of its own, never claimed, up to just under the quota.
        js = th.nc.jetstream()
        filler, n = b"x" * bodies.CHUNK, 0

        async def write(size: int) -> int:
            nonlocal n
            subject = subjects.body_chunk(th.owner, "f" * 32, n)
            n += 1
            await js.publish(subject, filler[:size])
            return _stored(subject, size)

        while held + _stored(subjects.body_chunk(th.owner, "f" * 32, n), bodies.CHUNK) <= (
            QUOTA - 20_000
        ):
            held += await write(bodies.CHUNK)
        if QUOTA - 20_000 - held >= MIN_CHARGE:
            held += await write(QUOTA - 20_000 - held - 200)
        assert QUOTA - bodies.CHUNK < held <= QUOTA
        before = await stack.purges()
        before_chunks = sum(await stack.metric("tokenbus_body_quota_purged_chunks_total"))
        await stack.heard()
        written = await stack.held(id_h)
        assert len(written) == mine["claim"]["chunks"] + n  # under its quota: all there
        assert await stack.purges() == before

        held += await write(bodies.CHUNK)  # past it
        assert held > QUOTA
        await wait_for(lambda: _gone(stack, id_h), what="the key's bodies removed")
        await stack.heard()
        assert await stack.purges() == before + 1  # the other janitor's purge removed nothing
        purged = sum(await stack.metric("tokenbus_body_quota_purged_chunks_total"))
        assert purged == before_chunks + len(written) + 1

        # The request naming a removed body: 429, naming the quota.
        with pytest.raises(TokenbusError) as got:
            await th.submit("chat", mine, api_key=key_h).collect()
        assert got.value.status == 429
        assert "bodies.max_bytes_per_key" in got.value.message and str(QUOTA) in got.value.message

        # The other key's body is whole and served; its large requests are too.
        assert len(await stack.held(id_v)) == theirs["claim"]["chunks"]
        done = await tv.submit("chat", theirs, api_key=key_v).collect()
        assert done.usage.completion_tokens == 2
        done = await tv.chat_completion(MODEL, BIG, max_tokens=2)
        assert done.usage.completion_tokens == 2

        # The purged key's next body, under its quota: left alone by both janitors (neither
        # counts the removed chunks still).
        again, _ = await _object(th)
        await stack.heard()
        assert await stack.purges() == before + 1
        assert len(await stack.held(id_h)) == again["claim"]["chunks"]
        done = await th.submit("chat", again, api_key=key_h).collect()
        assert done.usage.completion_tokens == 2


async def _gone(stack: Stack, key_id: str) -> bool:
    return not await stack.held(key_id)


async def _chunks(c: Client, count: int) -> None:
    """``count`` chunks of 256 KiB the key's connection writes under its own owner, never
    claimed (what a tenant filling the store writes)."""
    js = c.nc.jetstream()
    oid = uuid.uuid4().hex
    for n in range(count):
        await js.publish(subjects.body_chunk(c.owner, oid, n), b"x" * bodies.CHUNK)


@pytest.mark.stack
async def test_a_janitor_counts_again_before_it_purges(stack: Stack) -> None:
    """The janitors never see a removal (another instance's purge, a delete): their sums of
    what a key holds only grow until the age limit. One that acted on its sum would purge a key
    under its quota; each counts the stream again first, and purges only a key really over."""
    key, key_id = await stack.key("recount")
    before = await stack.purges()
    async with await Client.connect(stack.bus.url, api_key=key) as c:
        await _chunks(c, 12)  # 3 MiB: under the quota
        await stack.heard()
        # Removed behind the janitors' backs (as another instance's purge would be).
        await stack.js.purge_stream(subjects.BODIES_STREAM, subject=subjects.key_bodies(key_id))
        await _chunks(c, 8)  # 2 MiB: the sums say 5 MiB, the store holds 2
        await stack.heard()
        assert len(await stack.held(key_id)) == 8
        assert await stack.purges() == before
        await _chunks(c, 7)  # 15 chunks: just under 4 MiB with what each counts beyond its data
        await stack.heard()
        assert len(await stack.held(key_id)) == 15
        assert await stack.purges() == before
        # One chunk over, and nothing written after it: each janitor's purge is bounded by
        # the count that saw it, so the second removes nothing. (Chunks written while the
        # first purge ran would be over the quota again: a second purge, rightly.)
        await _chunks(c, 1)
        await wait_for(lambda: _gone(stack, key_id), what="the key's bodies removed")
    await stack.heard()
    assert await stack.purges() == before + 1


@pytest.mark.stack
async def test_an_owner_s_keys_together_are_bound_and_its_largest_loses_its_bodies(
    stack: Stack,
) -> None:
    """A tenant with several keys, each under its own quota, cannot hold several times it:
    past ``bodies.max_bytes_per_owner`` (6 MiB here) the janitors remove the bodies of that
    owner's key holding the most, and only those; the owner's other key and another owner's
    key keep theirs; the request naming a removed body gets 429 naming the owner's quota.
    Before, only each key was bound (4 MiB each here)."""
    owner = f"acme{time.time_ns()}"
    key_a, id_a = await stack.key("acme-a", owner=owner)
    key_b, id_b = await stack.key("acme-b", owner=owner)
    key_o, id_o = await stack.key("other-c", owner=f"other{time.time_ns()}")
    before = await stack.purges()
    async with (
        await Client.connect(stack.bus.url, api_key=key_a) as ca,
        await Client.connect(stack.bus.url, api_key=key_b) as cb,
        await Client.connect(stack.bus.url, api_key=key_o) as co,
    ):
        await _chunks(ca, 12)  # 3 MiB
        body_b, _ = await _object(cb)  # 1.6 MB, seven chunks
        await _chunks(cb, 1)  # b 1.9 MiB: the owner 5 MiB, under its 6
        await _chunks(co, 12)  # another owner's 3 MiB
        await stack.heard()
        assert await stack.purges() == before
        await _chunks(cb, 6)  # b 3.4 MiB (under its key's 4 MiB): the owner 6.4 MiB, over
        await wait_for(lambda: _gone(stack, id_b), what="the owner's largest key's bodies removed")
        await stack.heard()
        assert await stack.purges() == before + 1  # one purge: the owner is under it again
        assert len(await stack.held(id_a)) == 12
        assert len(await stack.held(id_o)) == 12
        with pytest.raises(TokenbusError) as got:
            await cb.submit("chat", body_b, api_key=key_b).collect()
        assert got.value.status == 429
        assert "bodies.max_bytes_per_owner" in got.value.message
        assert str(OWNER_QUOTA) in got.value.message


@pytest.mark.stack
async def test_a_key_s_own_quota_overrides_the_default(stack: Stack) -> None:
    """``max_body_bytes`` on the key: one 1.6 MB body is over a 1 MiB quota (under the
    stack's default of 4 MiB)."""
    key, key_id = await stack.key("small", max_body_bytes=1 << 20)
    before = await stack.purges()
    async with await Client.connect(stack.bus.url, api_key=key) as c:
        body, _ = await _object(c)
    claim = body["claim"]

    async def purged() -> bool:
        return await stack.purges() > before

    await wait_for(purged, what="the key's body removed")
    # Its first chunks were written before it passed 1 MiB: in the purge (its last chunks
    # may have come after the count that decided it, and stay: under the quota).
    first = subjects.body_chunk(claim["owner"], claim["id"], 0)
    assert first not in await stack.held(key_id)


@pytest.mark.stack
async def test_a_key_s_finished_request_leaves_no_body(stack: Stack) -> None:
    """A key's connection may not delete its bodies: its client says each one is done when
    the stream ends, and the janitor deletes it (before, it stayed for 15 minutes and
    counted against the store)."""
    key, key_id = await stack.key("tidy")
    async with await Client.connect(stack.bus.url, api_key=key) as c:
        for _ in range(2):
            done = await c.chat_completion(MODEL, BIG, max_tokens=2)
            assert done.usage.completion_tokens == 2
    await wait_for(lambda: _gone(stack, key_id), what="the key's finished bodies deleted")


# -- the janitor's arithmetic -----------------------------------------------------------------


def _msg(subject: str, size: int, **headers: str) -> Msg:
    """A message as the headers-only consumer delivers it."""
    hdrs = {**headers, "Nats-Msg-Size": str(size)}
    return Msg(_client=None, subject=subject, data=b"", headers=hdrs)  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_message_counts_as_stored_and_at_least_the_minimum() -> None:
    subject = subjects.body_chunk("tbk.abc", "0" * 32, 0)
    assert charge(_msg(subject, bodies.CHUNK)) == STORED_OVERHEAD + len(subject) + bodies.CHUNK
    assert charge(_msg(subject, 1)) == MIN_CHARGE  # many tiny messages are not free
    with_headers = charge(_msg(subject, bodies.CHUNK, X="y" * 100))
    assert with_headers > charge(_msg(subject, bodies.CHUNK)) + 100


@pytest.mark.unit
def test_a_count_of_the_stream_replaces_what_was_heard_up_to_it() -> None:
    t = Tally()
    now = time.time()
    for seq in (1, 2, 3, 5):
        t.add(Chunk(seq, now, f"o{seq}", 100))
    # The stream holds only 2 and 4 up to 4 (1 and 3 removed by someone else): 5 stays.
    t.replace([Chunk(2, now, "o2", 100), Chunk(4, now, "o4", 100)], floor=4)
    assert [c.seq for c in t.chunks] == [2, 4, 5] and t.total == 300
    t.add(Chunk(3, now, "o3", 100))  # heard late: already counted (or gone)
    assert t.total == 300
    t.cut(4)  # purged up to 4
    assert [c.seq for c in t.chunks] == [5] and t.total == 100
    t.drop_object("o5")
    assert t.total == 0
    t.add(Chunk(6, now - 1000, "o6", 100))
    t.expire(now - 900)
    assert t.total == 0 and not t.chunks


@pytest.mark.unit
def test_only_key_owners_subjects_are_counted() -> None:
    assert subjects.body_subject_parts("tb.v1.body.tbk.abc.o1.0") == ("tbk.abc", "o1", "0")
    assert subjects.body_subject_parts("tb.v1.body.tbk.abc.o1.done") == ("tbk.abc", "o1", "done")
    assert subjects.body_subject_parts("tb.v1.body.tb.bridge-1.o1.0") is None
    assert subjects.body_subject_parts(subjects.body_quota_notice("abc")) is None
