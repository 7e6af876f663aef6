"""The nats-py client as tokenbus runs it (services/natsclient.py), on a real nats-server."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Awaitable
from typing import Any, cast

import pytest
from nats import errors

from bus_schemas import codec
from router.dispatch import Dispatcher
from router.registry import Registry
from services import natsclient
from services.config import RouterSettings
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.bus


async def test_a_kv_watch_answers_flow_control_only_when_the_server_asks(
    nats_server: NatsServer,
) -> None:
    """A KV watch (an ordered consumer) no longer polls for a flow-control reply four times a
    second while idle; when the server does ask, the reply still goes out once the messages
    before it were taken, and again for a later ask."""
    nc = await natsclient.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=f"fc_{uuid.uuid4().hex[:8]}")
        await kv.put("a", b"1")
        watcher: Any = await kv.watchall()
        first = await watcher.updates(timeout=5)
        assert first is not None and first.value == b"1"
        jsi = watcher._sub._sub._jsi
        fctask = jsi._fctask
        assert fctask is not None and not fctask.done()

        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_reply(msg: object) -> None:
            await replies.put(getattr(msg, "subject", "").encode())

        for n in range(2):
            inbox = nc.new_inbox()
            await nc.subscribe(inbox, cb=on_reply)
            await nc.flush()
            # Idle: nothing is owed, and the loop waits on an event, not a timer (a negative
            # check: no flow-control reply is made up over an idle span).
            await asyncio.sleep(0.3)
            assert jsi._fcr is None and not jsi._tb_fc_owed.is_set()
            # What nats-py does with a "FlowControl Request" that arrives while messages
            # before it are still queued (its sequence is one the client has taken already).
            jsi.schedule_flow_control_response(inbox)
            got = await asyncio.wait_for(replies.get(), 5)
            assert got == inbox.encode(), n
            assert jsi._fcr is None

        # The watch still follows the bucket.
        await kv.put("b", b"2")
        nxt = await watcher.updates(timeout=5)
        while nxt is None:
            nxt = await watcher.updates(timeout=5)
        assert (nxt.key, nxt.value) == ("b", b"2")
        await watcher.stop()
        assert fctask.cancelled() or fctask.done() or await _ended(fctask)
    finally:
        await nc.close()


async def _ended(task: asyncio.Task[object]) -> bool:
    """Whether ``task`` ends within a second (stopping the watch cancels it)."""
    done, _ = await asyncio.wait({task}, timeout=1)
    return bool(done)


async def test_a_direct_subscription_runs_in_the_read_loop_in_order_and_survives_errors(
    nats_server: NatsServer,
) -> None:
    """subscribe_direct calls back from the connection's read loop (no task of its own), in
    order, with headers and a working reply; a callback that raises is reported to the
    error callback and the next message still arrives; unsubscribed, nothing more comes."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc: Any = await natsclient.connect(nats_server.url, error_cb=on_error)
    pub = await natsclient.connect(nats_server.url)
    try:
        got: list[tuple[bytes, Any, bool]] = []
        arrived = asyncio.Event()

        probes: list[bytes] = []

        def fn(msg: Any) -> None:
            if msg.data == b"probe":
                probes.append(msg.data)
                return
            if msg.data == b"boom":
                raise ValueError("a callback's own failure")
            got.append((msg.data, msg.headers, asyncio.current_task() is nc._reading_task))
            if msg.data == b"last":
                arrived.set()

        subject = f"direct.{uuid.uuid4().hex[:8]}"
        sub = await natsclient.subscribe_direct(nc, subject, fn)
        await nc.flush()
        # The server routes to the new subscription (a probe round trip) before the run.
        for _ in range(50):
            await pub.publish(subject, b"probe")
            await pub.flush()
            await asyncio.sleep(0.05)
            if probes:
                break
        assert probes
        for i in range(50):
            await pub.publish(subject, str(i).encode(), headers={"K": "v"} if i == 7 else None)
        await pub.publish(subject, b"boom")
        await pub.publish(subject, b"last")
        await asyncio.wait_for(arrived.wait(), 5)
        assert [d for d, _, _ in got] == [str(i).encode() for i in range(50)] + [b"last"]
        assert got[7][1] == {"K": "v"} and got[6][1] is None
        assert all(direct for _, _, direct in got)  # called from the read loop itself
        assert any("a callback's own failure" in str(e) for e in errors)
        assert nc.is_connected

        # A request answered from a direct subscription: msg.respond works.
        def answer(msg: Any) -> None:
            asyncio.get_running_loop().create_task(msg.respond(b"pong:" + msg.data))

        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_reply(msg: Any) -> None:
            await replies.put(msg.data)

        inbox = pub.new_inbox()
        await pub.subscribe(inbox, cb=on_reply)
        await natsclient.subscribe_direct(nc, subject + ".rpc", answer, queue="q")
        await nc.flush()  # the server has both subscriptions before the message
        await pub.flush()
        await pub.publish(subject + ".rpc", b"ping", reply=inbox)
        assert await asyncio.wait_for(replies.get(), 5) == b"pong:ping"

        await sub.unsubscribe()
        await pub.publish(subject, b"after")
        await pub.flush()
        await nc.flush()
        await asyncio.sleep(0.1)  # a negative check: nothing more arrives once unsubscribed
        assert got[-1][0] == b"last"
        assert sub._id not in nc._direct
    finally:
        await pub.close()
        await nc.close()


# The connections of the tests below ping rarely. Their loops are blocked on purpose, and a
# loaded machine may starve the responder's thread. With tokenbus's 1 s pings (two may go
# unanswered), either side could take the other for a dead server and reconnect. The
# responder's subscription would then be briefly gone: the dispatcher sees no responders and
# gives the replica up (seen once in a full CI run). These tests are about when a message is
# written, not about pings.
CALM_PINGS: dict[str, Any] = {"ping_interval": 60, "max_outstanding_pings": 5}


class ThreadResponder:
    """A subscriber on its own connection and event loop, in another thread: it hears a
    message even while the test's loop is blocked, and answers with ``answer``."""

    def __init__(self, url: str, subject: str, answer: bytes | None = None) -> None:
        self.url, self.subject, self.answer = url, subject, answer
        self.seen: list[bytes] = []
        self.heard = threading.Event()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        nc = await natsclient.connect(self.url, **CALM_PINGS)

        async def on_msg(msg: Any) -> None:
            self.seen.append(msg.data)
            self.heard.set()
            if msg.reply:
                await msg.respond(self.answer if self.answer is not None else b"ack:" + msg.data)

        await nc.subscribe(self.subject, cb=on_msg)
        await nc.flush()
        self._ready.set()
        await self._stop
        await nc.close()

    def __enter__(self) -> ThreadResponder:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)

    async def heard_while_blocked(
        self, work: Awaitable[Any], count: int = 1, within: float = 1.0
    ) -> tuple[bool, Any]:
        """Start ``work`` and let it run to its first wait, then block this loop for up to
        ``within`` seconds: whether ``count`` more messages arrived meanwhile, and ``work``'s
        result."""
        target = len(self.seen) + count
        task = asyncio.ensure_future(work)
        await asyncio.sleep(0)  # the task runs up to its wait for the reply
        deadline = time.monotonic() + within
        while True:  # blocks this loop: no flusher turn
            self.heard.clear()  # before the count: a message after it sets it again
            left = deadline - time.monotonic()
            if len(self.seen) >= target or left <= 0:
                break
            self.heard.wait(left)
        return len(self.seen) >= target, await task


async def test_a_request_at_once_is_on_the_socket_before_the_loop_turns(
    nats_server: NatsServer,
) -> None:
    """request(at_once=True) writes its message at once: a responder on another thread answers it
    while this event loop is still blocked, before the flusher task could have run. A plain
    request, blocked the same way, reaches nobody until the loop turns (the control that
    shows the block really holds the flusher back). Both get their reply afterwards."""
    subject = f"now.{uuid.uuid4().hex[:8]}"
    nc: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    try:
        with ThreadResponder(nats_server.url, subject) as r:
            heard, reply = await r.heard_while_blocked(
                natsclient.request(nc, subject, b"plain", timeout=5, headers={})
            )
            assert not heard and reply.data == b"ack:plain"
            heard, reply = await r.heard_while_blocked(
                natsclient.request(nc, subject, b"now", timeout=5, headers={}, at_once=True)
            )
            assert heard and reply.data == b"ack:now"
            assert r.seen == [b"plain", b"now"]
        assert nc._pending_data_size == 0 and not nc._write_next
    finally:
        await nc.close()


async def test_a_publish_at_once_is_on_the_socket_before_the_loop_turns(
    nats_server: NatsServer,
) -> None:
    """publish_at_once (each chunk of a body sent on request, services/bodies.py) writes its
    message at once: a subscriber on another thread hears it while this event loop is still
    blocked. A plain publish, blocked the same way, reaches nobody until the loop turns."""
    subject = f"now.{uuid.uuid4().hex[:8]}"
    nc: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    try:
        with ThreadResponder(nats_server.url, subject) as r:
            heard, _ = await r.heard_while_blocked(nc.publish(subject, b"plain"))
            assert not heard
            await nc.flush()
            assert await asyncio.to_thread(r.heard.wait, 10)  # the plain one, once flushed
            heard, _ = await r.heard_while_blocked(
                natsclient.publish_at_once(nc, subject, b"now", headers={"k": "v"})
            )
            assert heard
            assert r.seen == [b"plain", b"now"]
        assert nc._pending_data_size == 0 and not nc._write_next
    finally:
        await nc.close()


async def test_large_messages_arrive_whole_as_bytes_across_reads(nats_server: NatsServer) -> None:
    """The parse buffer's slices are bytes in one copy (natsclient._Buffer): messages larger
    than one read, with and without headers, back to back, arrive whole and as bytes."""
    subject = f"big.{uuid.uuid4().hex[:8]}"
    rx: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    tx: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    got: list[Any] = []
    done = asyncio.Event()
    sizes = [1, 70_000, 900_000, 0, 65_536]

    def on_msg(msg: Any) -> None:
        got.append(msg)
        if len(got) == 2 * len(sizes):
            done.set()

    try:
        await natsclient.subscribe_direct(rx, subject, on_msg)
        await rx.flush()
        sent = [os.urandom(n) for n in sizes]
        for i, data in enumerate(sent):
            await tx.publish(subject, data)
            await tx.publish(subject, data, headers={"n": str(i)})
        await tx.flush()
        await asyncio.wait_for(done.wait(), 10)
        assert [m.data for m in got] == [d for d in sent for _ in (0, 1)]
        assert all(type(m.data) is bytes for m in got)
        assert [m.headers for m in got[1::2]] == [{"n": str(i)} for i in range(len(sizes))]
    finally:
        await tx.close()
        await rx.close()


async def test_dispatch_writes_each_request_at_once_unless_told_not_to(
    nats_server: NatsServer,
) -> None:
    """The dispatcher's request reaches the replica while the dispatching loop is blocked
    (router.write_at_once, the default); with it off, only once the loop turns. Either way
    the replica's ack places the request on it."""
    model = f"m{uuid.uuid4().hex[:6]}"
    reg = Registry()
    reg.update(
        {
            "replica": "r1",
            "model": model,
            "in_flight": 0,
            "max_concurrency": 4,
            # One heartbeat only: an interval the test cannot outlast on a loaded machine (at
            # 1 s the replica expired after three, and the dispatch gave up: CI run tt).
            "interval_s": 60.0,
            "seq": 1,
            "boot": "a",
        }
    )
    subject = reg.live(model)[0].subject
    nc: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    try:
        ack = codec.encode({"ok": True, "in_flight": 1})
        with ThreadResponder(nats_server.url, subject, ack) as r:
            for at_once in (True, False):
                # A generous ack wait: the responder thread answers once the loop turns, which
                # a loaded machine may delay past the 2 s default (seen in a full run).
                cfg = RouterSettings(write_at_once=at_once, dispatch_timeout_s=30)
                d = Dispatcher(nc, reg, cfg)
                body = codec.encode({"n": int(at_once)})
                heard, replica = await r.heard_while_blocked(
                    d.dispatch(model, body, {}, nc.new_inbox())
                )
                assert (heard, replica) == (at_once, "r1")
            assert r.seen == [codec.encode({"n": 1}), codec.encode({"n": 0})]
    finally:
        await nc.close()


async def test_a_run_published_all_at_once_goes_out_in_one_write_in_order(
    nats_server: NatsServer,
) -> None:
    """publish_all_at_once (a pulled body's chunks, services/bodies.py): every message of the
    run is on the socket before this event loop turns (a subscriber on another thread hears
    them all while it is blocked), after what was queued before them, in order and whole;
    views of one buffer go as they are. A subject that would break the command, or a payload
    past the server's limit, is refused before anything of the run is written."""
    subject = f"all.{uuid.uuid4().hex[:8]}"
    nc: Any = await natsclient.connect(nats_server.url, **CALM_PINGS)
    blob = os.urandom(200_000)
    view = memoryview(blob)
    run = [(f"{subject}.{i}", cast(bytes, view[i * 65536 : (i + 1) * 65536])) for i in range(4)]
    try:
        with ThreadResponder(nats_server.url, f"{subject}.*") as r:
            await nc.publish(f"{subject}.queued", b"first")  # for the flusher's next turn
            heard, _ = await r.heard_while_blocked(
                natsclient.publish_all_at_once(nc, run), count=5, within=10
            )
            assert heard and r.seen == [b"first", *(bytes(v) for _, v in run)]
            for bad in [("no spaces.in subjects", b"x"), (subject, b"x" * (nc.max_payload + 1))]:
                with pytest.raises((errors.BadSubjectError, errors.MaxPayloadError)):
                    await natsclient.publish_all_at_once(nc, [(f"{subject}.ok", b"y"), bad])
            await nc.flush()
            assert len(r.seen) == 5  # nothing of a refused run went out
        assert nc._pending_data_size == 0 and nc.stats["out_msgs"] >= 5
    finally:
        await nc.close()
