"""A claim by pull (services/bodies.py, docs/large-requests.md): a caller that routes its
requests itself holds a large body and sends it to the replica that asks for it. Both sides
on a real nats-server: the caller's stream and a replica's :func:`bodies.pull`; the test
plays the other side and the hostile senders."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from services import bodies
from tests.support.waits import wait_for
from tokenbus import Client

BIG = "every tenant is an attacker " * 60_000  # 1.68 MB: seven chunks
MODEL = "pull-model"


def _body() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": BIG}], "max_tokens": 2}


async def _heard(c: Client, nc: NATS, replica: str) -> None:
    """Until ``c`` hears ``replica`` beat: a heartbeat as a worker sends it, again until
    heard (the caller's subscription may not be in effect at the server yet)."""
    beat = codec.encode({"replica": replica, "model": MODEL, "interval_s": 60.0})

    async def heard() -> bool:
        await nc.publish(subjects.heartbeat(MODEL, replica), beat)
        await nc.flush()
        return replica in c._beats

    await wait_for(heard, timeout=10, what=f"{replica}'s heartbeat heard")


class _Placed:
    """An in-process sender that places every request on ``replica`` (the bridge's router,
    in this test's hands): what it was sent, kept."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.sent: list[tuple[bytes, dict[str, str], str]] = []

    async def __call__(self, data: bytes, hdrs: dict[str, str], reply: str) -> str:
        self.sent.append((data, dict(hdrs), reply))
        return self.replica


async def _chunks(nc: NATS, replica: str, oid: str) -> list[Any]:
    got: list[Any] = []

    async def keep(msg: Any) -> None:
        got.append(msg)

    await nc.subscribe(f"{subjects.engine_body(replica, oid)}.*", cb=keep)
    await nc.flush()
    return got


async def _held_stream(c: Client, placed: _Placed) -> tuple[Any, dict[str, Any], str]:
    s = c.submit("chat", _body(), sender=placed)
    s.pull_bodies = True
    await s.start()
    data, _, reply = placed.sent[0]
    env = codec.decode_map(data)
    return s, env["claim"], reply


@pytest.mark.bus
async def test_the_replica_that_asks_gets_the_body_whole(nats_server: Any, nc: NATS) -> None:
    """The envelope carries a claim by pull and no messages; the replica that asks gets
    them whole, checked, and nothing goes into the store."""
    async with await Client.connect(nats_server.url) as c:
        placed = _Placed("pull-r1")
        await _heard(c, nc, "pull-r1")
        s, claim, reply = await _held_stream(c, placed)
        env = codec.decode_map(placed.sent[0][0])
        assert "messages" not in env and claim["pull"] is True and "sha256" not in claim
        assert len(placed.sent[0][0]) < 4096  # the envelope on the bus stays small

        async def ask() -> None:
            await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-r1"})

        parts = await bodies.pull(nc, claim, "pull-r1", ask, timeout=10)
        assert parts == {"messages": _body()["messages"]}
        # A second replica (a migration's) asks again, and gets it again.
        parts = await bodies.pull(nc, claim, "pull-r1", ask, timeout=10)
        assert parts["messages"][0]["content"] == BIG
        await s.aclose()


@pytest.mark.bus
async def test_a_pull_naming_a_replica_nobody_hears_sends_nothing(
    nats_server: Any, nc: NATS
) -> None:
    """Hostile: a frame to the caller's inbox that names a replica the caller does not hear
    beat (a tenant steering a body to a subject of its choosing) gets nothing sent; the
    real replica's pull after it is answered. A stream that ended sends nothing either."""
    async with await Client.connect(nats_server.url) as c:
        placed = _Placed("pull-r2")
        await _heard(c, nc, "pull-r2")
        s, claim, reply = await _held_stream(c, placed)
        forged = await _chunks(nc, "pull-ghost", claim["id"])
        real = await _chunks(nc, "pull-r2", claim["id"])
        await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-ghost"})
        await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-r2"})
        await wait_for(lambda: len(real) == claim["chunks"], timeout=10, what="the real pull")
        await nc.flush()
        assert forged == []  # sent before the real one's chunks, had it been sent
        await s.aclose()
        # Ended: its body is forgotten, a pull after it gets nothing.
        assert bodies.held(claim["id"]) is None
        got = len(real)
        await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-r2"})
        sentinel = await _chunks(nc, "pull-r2", "0" * 32)
        await nc.publish(f"{subjects.engine_body('pull-r2', '0' * 32)}.0", b"x")
        await wait_for(lambda: sentinel, timeout=10)
        assert len(real) == got


@pytest.mark.bus
async def test_a_held_body_is_sent_a_bounded_number_of_times(nats_server: Any, nc: NATS) -> None:
    """A runaway or forged sender asking again and again gets the body MAX_PULLS times."""
    async with await Client.connect(nats_server.url) as c:
        placed = _Placed("pull-r3")
        await _heard(c, nc, "pull-r3")
        s, claim, reply = await _held_stream(c, placed)
        real = await _chunks(nc, "pull-r3", claim["id"])
        for _ in range(bodies.MAX_PULLS + 5):
            await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-r3"})
        want = bodies.MAX_PULLS * claim["chunks"]
        await wait_for(lambda: len(real) >= want, timeout=20, what="the pulls answered")
        held = bodies.held(claim["id"])
        assert held is not None and held.sent == bodies.MAX_PULLS
        await s.aclose()
        assert len(real) == want


@pytest.mark.bus
async def test_a_tampered_short_or_missing_body_is_refused(nc: NATS) -> None:
    """What a replica receives is checked: a chunk of another size than its place in the
    body (cut, padded) or a body that is not an envelope's parts is a 400; a body that stops
    short, or never comes (a caller gone), a 503 with Retry-After."""
    blob = codec.encode({"messages": _body()["messages"]})
    n = -(-len(blob) // bodies.PULL_CHUNK)
    claim = {"owner": "tb.pulltest", "id": "a" * 32, "size": len(blob), "chunks": n, "pull": True}

    def sender(body: bytes, upto: int, cut: int | None = None) -> Any:
        # Each case its own object (as each request has): a case's chunks still on their
        # way once it failed are no part of the next.
        claim["id"] = secrets.token_hex(16)

        async def ask() -> None:
            prefix = subjects.engine_body("pull-r4", claim["id"])
            for i in range(upto):
                chunk = body[i * bodies.PULL_CHUNK : (i + 1) * bodies.PULL_CHUNK]
                await nc.publish(f"{prefix}.{i}", chunk[:-1] if i == cut else chunk)

        return ask

    ask = sender(blob, n)
    assert await bodies.pull(nc, claim, "pull-r4", ask, timeout=5) == {
        "messages": _body()["messages"]
    }
    ask = sender(blob, n, cut=2)
    with pytest.raises(E.InvalidRequest, match="chunk 2 of the wrong size"):
        await bodies.pull(nc, claim, "pull-r4", ask, timeout=5)
    garbage = b"\xc1" * len(blob)  # msgpack's one unused byte: no body decodes from it
    ask = sender(garbage, n)
    with pytest.raises(E.InvalidRequest, match="not an encoded body"):
        await bodies.pull(nc, claim, "pull-r4", ask, timeout=5)
    for upto in (n - 1, 0):
        ask = sender(blob, upto)
        with pytest.raises(E.ServiceUnavailable) as got:
            await bodies.pull(nc, claim, "pull-r4", ask, timeout=0.3)
        assert got.value.headers["Retry-After"] and f"{upto} of {n}" in got.value.message


@pytest.mark.unit
def test_a_claim_by_pull_is_refused_where_it_cannot_be_pulled() -> None:
    """Only a replica pulls: ingress, the filter and the router refuse such a claim (a NATS
    client's request may not carry one), and a claim by pull may not carry a digest."""
    claim = {"owner": "tb.x", "id": "b" * 32, "size": 10, "chunks": 1, "pull": True}
    with pytest.raises(E.InvalidRequest, match=r"claim\.pull"):
        bodies.check_claim(claim)
    assert bodies.check_claim(claim, pull_ok=True) is claim
    with pytest.raises(E.InvalidRequest, match=r"claim\.sha256"):
        bodies.check_claim({**claim, "sha256": "c" * 64}, pull_ok=True)
    with pytest.raises(E.InvalidRequest, match=r"claim\.pull"):
        bodies.check_claim({**claim, "pull": "yes"}, pull_ok=True)


@pytest.mark.bus
async def test_the_choices_of_one_request_share_one_encoding_of_its_body(
    nats_server: Any, nc: NATS
) -> None:
    """A request's ``n`` choices are ``n`` requests on the bus with one ``messages`` list
    (gateway/validation.py per_choice): each holds its own claim (its id, its pulls) over one
    encoding of the body, not ``n`` copies. A request with other messages gets its own."""
    async with await Client.connect(nats_server.url) as c:
        placed = _Placed("pull-r5")
        await _heard(c, nc, "pull-r5")
        body = _body()
        streams = []
        for i in range(3):
            s = c.submit("chat", {**body, "seed": i}, sender=placed)
            s.pull_bodies = True
            await s.start()
            streams.append(s)
        claims = [codec.decode_map(data)["claim"] for data, _, _ in placed.sent]
        held = [bodies.held(cl["id"]) for cl in claims]
        assert len({cl["id"] for cl in claims}) == 3 and all(h is not None for h in held)
        assert held[0].blob is held[1].blob is held[2].blob  # type: ignore[union-attr]
        # Held as a view of the encoder's own buffer, not a copy of it (codec.encode_view).
        blob = held[0].blob  # type: ignore[union-attr]
        assert isinstance(blob, memoryview)
        assert bytes(blob) == codec.encode({"messages": body["messages"]})
        other = c.submit("chat", _body(), sender=placed)  # equal messages, another list
        other.pull_bodies = True
        await other.start()
        mine = bodies.held(codec.decode_map(placed.sent[-1][0])["claim"]["id"])
        assert mine is not None and mine.blob is not held[0].blob  # type: ignore[union-attr]
        # Each choice's replica pulls its own claim and gets the body whole.
        for (_, _, reply), claim in zip(placed.sent[1:3], claims[1:3], strict=True):

            async def ask(reply: str = reply) -> None:
                await nc.publish(reply, b"", headers={H.BODY_PULL: "pull-r5"})

            parts = await bodies.pull(nc, claim, "pull-r5", ask, timeout=10)
            assert parts == {"messages": body["messages"]}
        for s in [*streams, other]:
            await s.aclose()


@pytest.mark.bus
async def test_a_replica_pulls_every_body_through_one_standing_subscription(nc: NATS) -> None:
    """A replica subscribes to its bodies once (at its first pull) and asks each caller at
    once after that: two bodies pulled at the same time on one replica each get their own
    chunks, chunks of an object nobody waits for are dropped, and later pulls subscribe to
    nothing more."""
    bodies_of = {
        oid: codec.encode({"messages": [{"role": "user", "content": f"{oid} " * 200_000}]})
        for oid in (secrets.token_hex(16), secrets.token_hex(16))
    }

    def claim_of(oid: str) -> dict[str, Any]:
        size = len(bodies_of[oid])
        chunks = -(-size // bodies.PULL_CHUNK)
        return {"owner": "tb.pulltest", "id": oid, "size": size, "chunks": chunks, "pull": True}

    during: list[int] = []  # the connection's subscriptions while each pull waits

    def sender(oid: str) -> Any:
        async def ask() -> None:
            during.append(len(nc._subs))
            prefix = subjects.engine_body("pull-r6", oid)
            stray = subjects.engine_body("pull-r6", secrets.token_hex(16))
            await nc.publish(f"{stray}.0", b"nobody asked for this")
            blob = bodies_of[oid]
            for i in range(claim_of(oid)["chunks"]):
                await nc.publish(
                    f"{prefix}.{i}", blob[i * bodies.PULL_CHUNK :][: bodies.PULL_CHUNK]
                )

        return ask

    first = next(iter(bodies_of))
    got = await bodies.pull(nc, claim_of(first), "pull-r6", sender(first), timeout=5)
    assert got == codec.decode_map(bodies_of[first])
    subs = len(nc._subs)
    both = await asyncio.gather(
        *(bodies.pull(nc, claim_of(oid), "pull-r6", sender(oid), timeout=5) for oid in bodies_of)
    )
    assert both == [codec.decode_map(bodies_of[oid]) for oid in bodies_of]
    assert during[1:] == [subs, subs]  # no subscription of its own per body
    # One object pulled twice at once on one replica (a resend): each pull gets it whole.
    twice = await asyncio.gather(
        *(bodies.pull(nc, claim_of(first), "pull-r6", sender(first), timeout=5) for _ in "ab")
    )
    assert twice == [codec.decode_map(bodies_of[first])] * 2


@pytest.mark.unit
def test_an_encoding_as_a_view_is_the_encoding_and_refuses_what_the_bus_cannot_carry() -> None:
    """codec.encode_view: the same bytes as codec.encode, as a view; a value msgpack cannot
    hold (an integer past 64 bits, from a client's JSON) is the same 400."""
    parts = {"messages": [{"role": "user", "content": "x" * 100_000, "n": [1, 2.5, None]}]}
    view = codec.encode_view(parts)
    assert isinstance(view, memoryview) and bytes(view) == codec.encode(parts)
    for encode in (codec.encode, codec.encode_view):
        with pytest.raises(E.InvalidRequest, match="64 bits"):
            encode({"messages": [{"role": "user", "content": "x", "big": 2**70}]})
