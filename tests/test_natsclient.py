"""The nats-py client as tokenbus runs it (services/natsclient.py), on a real nats-server."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from services import natsclient
from tests.conftest import NatsServer


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
            # Idle: nothing is owed, and the loop waits on an event, not a timer.
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
