"""The worker's outbox on a real nats-server: a chunk sent while it is idle is written to the
socket from the sending callback; what follows in the same turn is batched; nothing overtakes
what must leave first (records, usage reports) or a frame queued before it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import frames, subjects
from engine_worker.outbox import Outbox
from services import natsclient
from tests.conftest import NatsServer, stack, wait_for
from tokenbus import Client


@pytest.fixture
async def conn(private_nats: NatsServer) -> AsyncIterator[natsclient.Client]:
    """The outbox's connection, on a server of the test's own: the message counts below see
    nothing any other test left on a shared bus."""
    nc = await natsclient.connect(private_nats.url)
    yield nc
    await nc.drain()


@pytest.fixture
async def listener(private_nats: NatsServer) -> AsyncIterator[NATS]:
    """A plain NATS client on the same private server."""
    nc = NATS()
    await nc.connect(private_nats.url)
    yield nc
    await nc.drain()


async def _listen(nc: NATS, subject: str) -> list[Msg]:
    got: list[Msg] = []

    async def cb(msg: Msg) -> None:
        got.append(msg)

    await nc.subscribe(subject, cb=cb)
    await nc.flush()
    return got


def _frames(got: list[Msg]) -> list[tuple[str, bytes]]:
    """(stream token, frame) of every frame received, batches opened, in order."""
    out: list[tuple[str, bytes]] = []
    for m in got:
        tok = m.subject.rpartition(".")[2]
        if tok == subjects.INBOX_BATCH_TOKEN:
            out.extend((str(t), f) for t, f in frames.decode(m.data)["f"])
        else:
            out.append((tok, m.data))
    return out


async def test_an_idle_outbox_writes_a_chunk_at_once_and_batches_what_follows(
    conn: natsclient.Client, listener: NATS
) -> None:
    nc = listener
    prefix = "_INBOX.tb.outboxtest"
    got = await _listen(nc, prefix + ".>")
    ob = Outbox(conn)
    one = frames.chunk("a", 1, 0)
    ob.send_chunk(f"{prefix}.s1", one)
    # Handed to the socket before this callback returns: no flush task, nothing pending.
    assert ob.messages == 1 and ob._task is None and not conn._pending
    # Later frames of the same turn wait for one flush: one batch message for both streams.
    ob.send_chunk(f"{prefix}.s1", frames.chunk("b", 1, 1))
    ob.send_chunk(f"{prefix}.s2", frames.chunk("c", 1, 0))
    assert ob._task is not None
    await ob.flush()
    await wait_for(lambda: len(got) == 2, what="two messages")
    assert ob.messages == 2 and ob.frames == 3
    assert _frames(got) == [
        ("s1", one),
        ("s1", frames.chunk("b", 1, 1)),
        ("s2", frames.chunk("c", 1, 0)),
    ]


async def test_nothing_overtakes_what_must_leave_first_or_a_frame_queued_before(
    conn: natsclient.Client, listener: NATS
) -> None:
    nc = listener
    prefix = "_INBOX.tb.outboxorder"
    # One subscription, so one order; this test's subjects only (never other traffic on the
    # shared server): the stand-in for the worker's records shares the prefix.
    records = f"{prefix}.records"
    got = await _listen(nc, prefix + ".>")
    ob = Outbox(conn)
    waiting = ["record"]

    async def before() -> None:  # the worker's records: they leave ahead of every frame
        while waiting:
            await conn.publish(records, waiting.pop().encode())

    ob.before = before
    ob.hold = lambda: bool(waiting)
    ob.send_chunk(f"{prefix}.s1", frames.chunk("a", 1, 0))
    assert ob._task is not None  # held back: the record goes first
    await ob.flush()
    # A final frame is always queued: the usage report and record queued right after it in
    # the same turn still leave ahead of it.
    ob.send(f"{prefix}.s1", frames.final("stop", 1, 1, {}))
    waiting.append("report")
    # A chunk after a queued frame waits behind it.
    ob.send_chunk(f"{prefix}.s2", frames.chunk("x", 1, 0))
    await ob.flush()
    await wait_for(lambda: len(got) == 4, what="four messages")
    subjects_seen = [m.subject for m in got]
    assert subjects_seen[0] == records and got[0].data == b"record"
    assert subjects_seen[1] == f"{prefix}.s1"
    assert subjects_seen[2] == records and got[2].data == b"report"
    assert [t for t, _ in _frames(got[3:])] == ["s1", "s2"]


async def test_without_a_connection_a_chunk_queues_until_it_is_back(
    nats_server: NatsServer,
) -> None:
    nc = await natsclient.connect(nats_server.url)
    ob = Outbox(nc)
    await nc.close()
    ob.send_chunk("_INBOX.x.s1", frames.chunk("a", 1, 0))
    assert ob._task is not None  # not written to a closed socket: the usual path
    await asyncio.wait_for(ob.flush(), 5)


async def test_a_workers_last_chunk_and_final_frame_leave_in_one_message(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    """A worker's first chunk goes at once while its outbox is idle; the later ones queue, so
    the last chunk and the final frame produced in one turn travel as one message: a caller
    never holds a whole answer without its end (a replica lost between two messages would
    be resumed past the answer's end)."""
    async with stack(nats_server.url, model, workers=1, with_ingress=True):
        got = await _listen(nc, client._prefix + ".*")
        answers = 0
        for n in (3, 6):
            s = client.chat(model, [{"role": "user", "content": "hi"}], max_tokens=n)
            assert len([c async for c in s]) >= 1
            answers += 1
        await wait_for(
            lambda: sum(frames.FINAL in _kinds(m) for m in got) == answers, what="the ends"
        )
    ends = [m for m in got if frames.FINAL in _kinds(m)]
    # The end and the last chunk of each answer in one message, the chunk first.
    assert all(_kinds(m)[-2:] == [frames.CHUNK, frames.FINAL] for m in ends), [
        _kinds(m) for m in got
    ]
    # ... while the first chunk of each went on its own, as it came.
    assert sum(_kinds(m) == [frames.CHUNK] for m in got) >= answers


def _kinds(m: Msg) -> list[str]:
    """The frame types of one message, a batch opened."""
    return [frames.decode(f)["t"] for _, f in _frames([m])]
