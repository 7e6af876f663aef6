"""The worker's outbox on a real nats-server: an answer's last chunk and its final frame,
produced in one turn of the event loop, leave in one message."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import frames, subjects
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for
from tokenbus import Client

pytestmark = pytest.mark.bus


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


async def test_a_workers_last_chunk_and_final_frame_leave_in_one_message(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    """A worker queues its chunks for the turn's flush, as it queues the final frame, so the
    last chunk and the final frame produced in one turn travel as one message: a caller
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
