"""The worker's outbox on a real nats-server: an answer's last chunk and its final frame,
produced in one turn of the event loop, leave in one message; under load a stream's text is
held for fewer, larger frames, and never overtaken by another frame of its stream."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import errors as E
from bus_schemas import frames, subjects
from engine_worker.outbox import Outbox
from tests.fakes.upstream import FakeUpstream
from tests.support.busdata import new_model
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


async def _answer_frames(
    url: str, model: str, client: Client, nc: NATS, worker: dict[str, object]
) -> tuple[str, list[dict[str, object]], list[Msg], int]:
    """One streamed answer of 24 tokens from a stack with ``worker``'s settings: its text,
    its chunk frames in order, the messages they came in, its completion tokens."""
    async with stack(url, model, workers=1, with_ingress=True, worker=worker):
        got = await _listen(nc, client._prefix + ".*")
        s = client.chat(
            model, [{"role": "user", "content": "count"}], max_tokens=24, ignore_eos=True
        )
        text = "".join([c.text async for c in s])
        assert s.usage is not None
        used = s.usage.completion_tokens
        await wait_for(lambda: any(frames.FINAL in _kinds(m) for m in got), what="the end")
    chunks = [frames.decode(f) for _, f in _frames(got)]
    return text, [c for c in chunks if c["t"] == frames.CHUNK], got, used


async def test_under_load_a_streams_text_after_its_first_chunk_travels_in_fewer_frames(
    nats_server: NatsServer, client: Client, nc: NATS
) -> None:
    """With as many requests in flight as ``stream_coalesce_streams`` (1 here), a stream's
    text after its first chunk is held up to ``stream_coalesce_ms``: frames carry the tokens
    of several engine steps. The first chunk is one step's, the last chunk still travels with
    the final frame, and the caller gets the same text and token count. Below that many
    requests in flight (the default 16, a lone stream) nothing is held."""
    sim = {"decode_ms": 4.0, "prefill_ms": 1.0}
    held = {"stream_coalesce_streams": 1, "stream_coalesce_ms": 40.0, "sim": sim}
    text, chunks, got, used = await _answer_frames(nats_server.url, new_model(), client, nc, held)
    assert used == 24
    assert "".join(str(c["d"]) for c in chunks) == text
    assert sum(int(c["n"]) for c in chunks) == used
    # A step is 4 ms and a hold 40: the answer's 24 tokens in a handful of frames, the first
    # of them one step's token alone.
    assert chunks[0]["n"] == 1 and chunks[0]["i"] == 0
    assert [c["i"] for c in chunks] == list(range(len(chunks)))
    assert len(chunks) <= 8 and max(int(c["n"]) for c in chunks) >= 4, chunks
    ends = [m for m in got if frames.FINAL in _kinds(m)]
    assert len(ends) == 1 and _kinds(ends[0])[-2:] == [frames.CHUNK, frames.FINAL]

    lone_text, lone, _, lone_used = await _answer_frames(
        nats_server.url, new_model(), client, nc, {"sim": sim}
    )
    assert lone_used == 24 and "".join(str(c["d"]) for c in lone) == lone_text
    # Not held: a frame per engine step, the sim joining only what one step made.
    assert len(lone) >= 20, [c["n"] for c in lone]


async def test_a_frame_sent_to_a_stream_goes_behind_the_text_it_holds(
    nats_server: NatsServer, nc: NATS
) -> None:
    """The outbox drains a stream's held text before any other frame to that stream (an
    error, a keepalive, its final frame): a caller never sees a frame overtake text held
    for coalescing. Another stream's held text waits for its hold to end."""
    out = Outbox(nc)
    got = await _listen(nc, "_INBOX.held.*")
    sent: list[str] = []

    def drain_of(reply: str, text: str) -> Callable[[], None]:
        def drain() -> None:
            sent.append(reply)
            out.send(reply, frames.chunk(text, 2, 1))

        return drain

    out.hold("_INBOX.held.a", drain_of("_INBOX.held.a", "held a"), 30.0)
    out.hold("_INBOX.held.b", drain_of("_INBOX.held.b", "held b"), 30.0)
    out.send("_INBOX.held.a", frames.error(E.EngineError("the engine failed")))
    assert sent == ["_INBOX.held.a"]  # b's hold has not ended
    await out.flush()  # releases b too: what is queued or held, all of it
    await wait_for(lambda: len(got) == 3, what="three frames")
    assert sent == ["_INBOX.held.a", "_INBOX.held.b"]
    kinds = [(m.subject, frames.decode(m.data)["t"]) for m in got]
    assert kinds.index(("_INBOX.held.a", frames.CHUNK)) < kinds.index(
        ("_INBOX.held.a", frames.ERROR)
    ), kinds
    # One drain each: nothing held is sent twice.
    assert sorted(k for k in kinds if k[1] == frames.CHUNK) == [
        ("_INBOX.held.a", frames.CHUNK),
        ("_INBOX.held.b", frames.CHUNK),
    ]


class Paused:
    """A stream whose reading a hold pauses: what it was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


async def test_a_hold_pauses_a_streams_reading_and_it_reads_before_it_drains(
    nats_server: NatsServer, nc: NATS
) -> None:
    """A held stream read from a socket reads nothing until its hold ends; then it reads
    again first, and drains a moment later, so what waited in the socket leaves with the
    held text. Paused once however often it holds; a frame sent to it resumes it before
    its text drains; a stream that holds while the others read what waited is not paused
    (its hold ends with theirs); a flush resumes and drains at once."""
    out = Outbox(nc)
    await _listen(nc, "_INBOX.read.*")
    readers = {k: Paused() for k in "abcdef"}
    seen: dict[str, list[str]] = {}  # each stream's calls when it drained

    def drain_of(k: str) -> Callable[[], None]:
        def drain() -> None:
            seen[k] = list(readers[k].calls)
            out.send(f"_INBOX.read.{k}", frames.chunk(k, 1, 1))

        return drain

    def hold(k: str, hold_s: float) -> None:
        out.hold(f"_INBOX.read.{k}", drain_of(k), hold_s, readers[k])

    hold("a", 0.02)
    hold("b", 0.02)
    hold("a", 0.02)
    assert readers["a"].calls == ["pause"] and readers["b"].calls == ["pause"]
    await wait_for(lambda: {"a", "b"} <= seen.keys(), what="a and b drained")
    assert seen["a"] == seen["b"] == ["pause", "resume"]

    hold("c", 30.0)
    out.send("_INBOX.read.c", frames.error(E.EngineError("the engine failed")))
    assert seen["c"] == ["pause", "resume"]

    hold("d", 30.0)
    out.release()  # the hold's end: d reads what waited; its drain follows
    assert readers["d"].calls == ["pause", "resume"] and "d" not in seen
    hold("e", 30.0)  # held while d reads: not paused (its hold ends now), drained with d
    await wait_for(lambda: {"d", "e"} <= seen.keys(), what="d and e drained")
    assert seen["d"] == ["pause", "resume"] and readers["e"].calls == []

    hold("f", 30.0)
    await out.flush()
    assert seen["f"] == ["pause", "resume"]


async def test_an_upstreams_tokens_wait_in_the_socket_while_held_and_arrive_whole(
    nats_server: NatsServer, client: Client, nc: NATS
) -> None:
    """Through a worker relaying an upstream (the ``openai`` backend) with every stream held
    and ``stream_coalesce_reads`` on, its reading paused for each hold: the answer still
    arrives whole and counted, its first chunk alone and the rest in a few frames; and the
    upstream connection goes back to the pool reading, so the next answer on it is served
    too."""
    up = FakeUpstream(chunk_delay=0.004)
    await up.start()
    model = new_model()
    try:
        worker = {
            "backend": "openai",
            "openai": {"upstream_url": up.url, "upstream_model": "upstream-model"},
            "stream_coalesce_streams": 1,
            "stream_coalesce_ms": 40.0,
            "stream_coalesce_reads": True,
        }
        async with stack(nats_server.url, model, workers=1, with_ingress=True, worker=worker) as s:
            got = await _listen(nc, client._prefix + ".*")
            for _ in range(2):
                got.clear()
                c = client.chat(
                    model, [{"role": "user", "content": "x"}], max_tokens=24, fake_words=24
                )
                text = "".join([p.text async for p in c])
                assert c.usage is not None and c.usage.completion_tokens == 24
                assert text.split() == [f"word{i}" for i in range(1, 25)]
                await wait_for(lambda: any(frames.FINAL in _kinds(m) for m in got), what="end")
                chunks = [frames.decode(f) for _, f in _frames(got)]
                chunks = [ch for ch in chunks if ch["t"] == frames.CHUNK]
                assert "".join(str(ch["d"]) for ch in chunks) == text
                # Held: fewer frames than tokens (about three of 40 ms each, unloaded).
                assert chunks[0]["n"] == 1 and len(chunks) < 24, [ch["n"] for ch in chunks]
                http = s["workers"][0].backend.http
                await wait_for(lambda http=http: len(http._idle) == 1, what="a kept connection")
                assert http._idle[0].transport.is_reading()
    finally:
        await up.stop()
