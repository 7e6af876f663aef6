"""The caller's in-process sender (the bridge's own stages and router) on a real bus: what a
sender raises after its request was given up on is not left for nobody to read."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from bus_schemas import errors as E
from services import natsclient
from services.caller import Caller
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for

pytestmark = pytest.mark.bus


async def test_a_request_given_up_while_its_sender_fails_leaves_no_unread_error(
    nats_server: NatsServer,
) -> None:
    """A request whose in-process sender ends in an error just as its caller gives it up (a
    replica's refusal arriving as the request is cancelled: a multi-prompt completion whose
    other prompt failed, a client gone) logged "Task exception was never retrieved" with a
    traceback in the bridge's log; the fuzzer's check for tracebacks failed a CI run on it.
    The error is the request's, whose caller has gone: read and dropped, nothing logged."""
    nc: Any = await natsclient.connect(nats_server.url)
    caller = Caller(nc, owner=f"t-{uuid.uuid4().hex[:8]}")
    await caller.start()
    tasks: list[asyncio.Task[Any]] = []

    async def sender(data: bytes, h: dict[str, str], reply: str) -> str | None:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # the replica's refusal came as it was cancelled
            raise E.InvalidRequest("prompt: token id 629393610 is past the vocabulary") from None
        return None

    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        s = caller.submit("chat", body, sender=sender, timeout=30)
        first = asyncio.ensure_future(s.__anext__())
        await wait_for(lambda: bool(tasks), what="the sender running")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        await nc.close()
    (task,) = tasks
    assert task.done() and not task.cancelled()
    # asyncio logs "Task exception was never retrieved" when such a task is collected with
    # this flag still set (its error read by no one).
    assert not task._log_traceback, "the sender's error was left for no one to read"
