"""A key the locked bus refuses: the NATS client says so at once with a typed error.

nats-py retries a refused login for ever (a traceback every couple of seconds), so before
this a client with a wrong, empty or revoked key never came back from ``connect``, and one
whose key was revoked while connected reconnected in a loop. A real nats-server on the
generated config with the auth callout, answered by the auth service's responder."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from auth.callout import CalloutCredentials, CalloutResponder
from auth.keys import key_id_of
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import frames, subjects
from bus_schemas import headers as H
from services import logging as tlog
from services import natsclient
from tests.lockedbus import LockedBus
from tests.support.waits import wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "tell me a story"}]
# The hang guard: a refusal comes back in well under a second; a hang fails the test.
HANG_GUARD_S = 5.0


class Callout:
    """A locked bus whose logins are answered by a responder in this process."""

    def __init__(self, bus: LockedBus, store: KeyStore, responder: CalloutResponder) -> None:
        self.bus = bus
        self.store = store
        self.responder = responder

    async def revoked(self, key: str) -> None:
        """Revoke ``key`` and wait until the responder's store knows it."""
        key_id = key_id_of(key) or ""
        await self.store.revoke(key_id)
        deadline = time.monotonic() + HANG_GUARD_S
        while (rec := self.store.record(key_id)) is not None and rec.enabled:
            assert time.monotonic() < deadline, "the key store never saw the revocation"
            await asyncio.sleep(0.05)


@pytest.fixture
async def callout(tmp_path: Path) -> AsyncIterator[Callout]:
    bus = LockedBus(tmp_path / "locked").start()
    admin = await bus.admin()
    store = await KeyStore(admin).open()
    creds = CalloutCredentials.load(bus.conf.parent / "callout.json")
    responder = CalloutResponder(store, bus.url, creds, tlog.get("test-callout"))
    await responder.start()
    try:
        yield Callout(bus, store, responder)
    finally:
        await responder.stop()
        await store.close()
        await admin.drain()
        bus.stop()


class Output:
    """What the test printed and logged (every level), to be searched for the refusal."""

    def __init__(self, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
        self.caplog = caplog
        self.capfd = capfd
        caplog.set_level(logging.DEBUG)

    def texts(self) -> tuple[str, str, str]:
        """(stdout, stderr, the log records with their exceptions)."""
        out, err = self.capfd.readouterr()
        logged = "\n".join(
            f"{r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in self.caplog.records
        )
        return out, err, logged

    def quiet(self) -> None:
        """Nothing printed or logged about the refusal: it is the exception, said once."""
        for text in self.texts():
            assert "Authorization Violation" not in text, text[-2000:]
            assert "Traceback" not in text, text[-2000:]


@pytest.fixture
def output(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> Output:
    return Output(caplog, capfd)


async def _refused(url: str, api_key: str | None) -> E.Unauthorized:
    with pytest.raises(E.Unauthorized) as info:
        await asyncio.wait_for(Client.connect(url, api_key=api_key), HANG_GUARD_S)
    return info.value


async def test_a_wrong_key_is_refused_at_connect_with_a_typed_error(
    callout: Callout, output: Output
) -> None:
    good, _ = await callout.store.create("good")
    wrong = good[:-4] + ("aaaa" if not good.endswith("aaaa") else "bbbb")  # its id, not its key
    for bad in (wrong, "tb-000000000000_nope", "not a key"):
        err = await _refused(callout.bus.url, bad)
        assert err.code == "invalid_api_key" and err.status == 401
        assert "unknown, revoked, disabled or expired" in err.message
        assert bad not in err.message  # never the key itself
    assert f"API key {key_id_of(good)}:" in str(await _refused(callout.bus.url, wrong))
    # The right key still gets in (the refusals were the keys', not the bus's).
    async with await asyncio.wait_for(
        Client.connect(callout.bus.url, api_key=good), HANG_GUARD_S
    ) as tb:
        assert tb.nc.is_connected
    output.quiet()


async def test_an_empty_key_is_refused_at_connect(callout: Callout, output: Output) -> None:
    for empty in ("", None):
        err = await _refused(callout.bus.url, empty)
        assert "api_key=" in err.message
    output.quiet()


async def test_a_revoked_key_is_refused_at_connect(callout: Callout, output: Output) -> None:
    key, _ = await callout.store.create("soon revoked")
    await callout.revoked(key)
    err = await _refused(callout.bus.url, key)
    assert f"API key {key_id_of(key)}:" in err.message and key not in err.message
    # Without reconnects too (nats-py raises its own error there): the same typed error.
    with pytest.raises(E.Unauthorized):
        await asyncio.wait_for(
            Client.connect(
                callout.bus.url, api_key=key, allow_reconnect=False, max_reconnect_attempts=0
            ),
            HANG_GUARD_S,
        )
    output.quiet()


async def test_a_key_revoked_while_connected_closes_the_client_with_the_typed_error(
    callout: Callout, output: Output
) -> None:
    key, _ = await callout.store.create("revoked while connected")
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    # Reconnects 0.1 s apart (2 s by default): a client that did reconnect would do so
    # several times within the negative check's span below.
    async with await Client.connect(
        callout.bus.url, api_key=key, closed_cb=on_closed, reconnect_time_wait=0.1
    ) as tb:
        await callout.revoked(key)
        # The server kicks the connection; its reconnect is refused: closed, not looping.
        await asyncio.wait_for(closed.wait(), HANG_GUARD_S)
        assert tb.nc.is_closed and not tb.nc.is_reconnecting
        assert isinstance(tb.refused, E.Unauthorized)
        with pytest.raises(E.Unauthorized, match=key_id_of(key) or "?"):
            await asyncio.wait_for(tb.chat_completion("any-model", MSG), HANG_GUARD_S)
        with pytest.raises(E.Unauthorized):
            await asyncio.wait_for(tb.get_response("resp_x"), HANG_GUARD_S)
        reconnects = tb.nc.stats["reconnects"]
        # A negative check: no reconnect within a span of several reconnect waits.
        await asyncio.sleep(0.5)
        assert tb.nc.stats["reconnects"] == reconnects == 0
    # Leaving the block (closing a client whose connection the server ended) raises nothing.
    out, err, logged = output.texts()
    # The kick itself may be reported once (an unexpected EOF); the refusal never.
    for text in (out, err, logged):
        assert "Authorization Violation" not in text, text[-2000:]
    assert logged.count("encountered error") <= 1, logged


async def test_a_refusal_right_after_a_server_restart_is_not_final(callout: Callout) -> None:
    """A server restart is no revocation: while the auth service that answers its logins
    comes back (its key store still loading), a login may be refused; the key's client keeps
    trying within the grace, then serves again. (A chaos run lost a whole load this way: the
    client took such a refusal for its key and ended.)"""
    key, _ = await callout.store.create("outlives a restart")
    key_id = key_id_of(key) or ""
    async with await Client.connect(callout.bus.url, api_key=key, reconnect_time_wait=0.2) as tb:
        # The grace (natsclient.REFUSAL_GRACE_S, 10 s from the server's return) is set far
        # longer than a loaded machine needs for the steps below: the test waits for the
        # refusals it needs, not for a time.
        tb.nc.refusal_grace_s = 120
        await callout.responder.stop()  # the auth service is away (no kick) ...
        await callout.revoked(key)  # ... and, back, it will refuse the key for a while
        callout.bus.stop()
        callout.bus.start()
        await callout.responder.start()
        # The client's reconnects are refused meanwhile (every 0.2 s), and tried again.
        await wait_for(
            lambda: tb.nc.refusals_forgiven >= 3 or tb.nc.is_closed,
            timeout=60,
            what="no reconnect was refused",
        )
        assert not tb.nc.is_closed and tb.refused is None
        await callout.store.update(key_id, enabled=True)
        deadline = time.monotonic() + 3 * HANG_GUARD_S
        while not tb.nc.is_connected:
            assert not tb.nc.is_closed and time.monotonic() < deadline, "not reconnected"
            await asyncio.sleep(0.1)
        assert tb.refused is None and tb.nc.stats["reconnects"] >= 1


def test_the_refusal_of_a_login_is_recognised() -> None:
    for text in (
        "nats: 'Authorization Violation'",
        "'User Authentication Expired'",
        "'User Authentication Revoked'",
    ):
        assert natsclient.is_login_refusal(text)
        assert natsclient.is_login_refusal(Exception(text))
    assert not natsclient.is_login_refusal("nats: unexpected EOF")
    assert not natsclient.is_login_refusal("'Permissions Violation for Publish to x'")


async def test_an_open_stream_ends_with_the_typed_error_when_its_key_is_revoked(
    callout: Callout,
) -> None:
    # A replica (here, one in this process) streams a long answer to the key's inbox; the
    # key is revoked after the third chunk.
    replica = await callout.bus.admin()
    streaming: list[asyncio.Task[None]] = []

    async def serve(reply: str, request_id: str) -> None:
        await replica.publish(reply, frames.accept("fake-0", request_id, 0.25))
        for i in range(2000):
            await replica.publish(reply, frames.chunk("x", 1, i))
            await asyncio.sleep(0.02)

    async def on_request(msg: Msg) -> None:
        rid = (msg.headers or {}).get(H.REQUEST_ID, "")
        streaming.append(asyncio.get_running_loop().create_task(serve(msg.reply, rid)))

    await replica.subscribe(subjects.request(subjects.KIND_CHAT), cb=on_request)
    await replica.flush()
    key, _ = await callout.store.create("streaming")
    try:
        async with await Client.connect(callout.bus.url, api_key=key) as tb:
            s = tb.chat("fake-model", MSG, max_tokens=2000)
            got = 0
            with pytest.raises(E.Unauthorized):
                async with asyncio.timeout(HANG_GUARD_S):
                    async for _ in s:
                        got += 1
                        if got == 3:
                            await callout.store.revoke(key_id_of(key) or "")
            assert 3 <= got < 2000 and s.done and s.migrations == 0
            assert tb.nc.is_closed
            with pytest.raises(E.Unauthorized):
                await tb.chat_completion("fake-model", MSG, max_tokens=1)
    finally:
        for t in streaming:
            t.cancel()
        await replica.close()


async def test_a_login_the_server_ends_when_the_key_expires_closes_the_client(
    callout: Callout, output: Output
) -> None:
    # The responder kicks an expired key's connection (as a revoked one's, above); without
    # it watching, the server ends the login itself when the user JWT the callout gave it
    # expires with the key ('User Authentication Expired').
    if callout.responder._checker is not None:
        callout.responder._checker.cancel()
    key, _ = await callout.store.create("expiring", expires_at=time.time() + 1.5)
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    tb = await Client.connect(callout.bus.url, api_key=key, closed_cb=on_closed)
    try:
        await asyncio.wait_for(closed.wait(), HANG_GUARD_S)
        said = str(getattr(tb.nc, "refused", ""))
        assert "authentication expired" in said.lower(), said
        assert isinstance(tb.refused, E.Unauthorized) and tb.nc.stats["reconnects"] == 0
        with pytest.raises(E.Unauthorized):
            await tb.chat_completion("any-model", MSG)
    finally:
        await tb.close()
    output.quiet()
