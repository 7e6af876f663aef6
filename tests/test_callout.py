"""One identity per API key on NATS: the locked bus with nats-server's auth callout answered
by the auth service (a real nats-server on the generated config, real processes)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from auth.keys import key_id_of
from auth.store import KeyStore
from bus_schemas import subjects
from engine_worker.backends.sim import expected_text
from services.natsconf import role_login
from tests.lockedbus import LockedBus, serve_when_ready
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client, TokenbusError

MSG = [{"role": "user", "content": "tell me a story"}]


class Tenants:
    def __init__(self, bus: LockedBus, model: str, a: str, b: str, admin: Any) -> None:
        self.bus = bus
        self.model = model
        self.a = a
        self.b = b
        self.admin = admin


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[LockedBus]:
    b = LockedBus(tmp_path / "locked").start()
    yield b
    b.stop()


@pytest.fixture
async def tenants(bus: LockedBus, tmp_path: Path) -> AsyncIterator[Tenants]:
    model = "tenant-model"
    with Procs(bus.url, tmp_path) as procs:
        await start_stack(
            procs,
            model,
            "ingress",
            "auth",
            "router",
            bridge=False,
            worker_args=("--sim-decode-ms", "20"),
            env={"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'},
            env_for=lambda role, _: bus.env(role),
            login=role_login(bus.users, "admin"),
        )
        admin = await bus.admin()
        store = await KeyStore(admin).open(watch=False)
        a, _ = await store.create("tenant-a")
        b, _ = await store.create("tenant-b")
        # The auth service's watched store learns of the keys, then the replica beats.
        await serve_when_ready(bus.url, a, model)
        yield Tenants(bus, model, a, b, store)
        await admin.drain()


@pytest.mark.stack
async def test_an_unknown_key_is_refused_at_connect(tenants: Tenants) -> None:
    for token in ("tb-000000000000_nope", "not a key", ""):
        with pytest.raises(Exception, match="Authorization"):
            await nats.connect(
                tenants.bus.url, token=token, allow_reconnect=False, max_reconnect_attempts=0
            )
    # Without a key and without a role login: refused too.
    with pytest.raises(Exception, match="Authorization"):
        await nats.connect(tenants.bus.url, allow_reconnect=False, max_reconnect_attempts=0)


@pytest.mark.stack
async def test_a_key_cannot_read_or_cut_another_keys_stream(tenants: Tenants) -> None:
    errors: list[str] = []
    got: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def spy_cb(msg: Any) -> None:
        got.append(msg.subject)

    spy = await nats.connect(tenants.bus.url, token=tenants.a, error_cb=on_error)
    others = (
        "_INBOX.>",
        ">",
        f"{subjects.key_inbox_root('x')}.>",
        "tb.v1.>",
        subjects.heartbeat_wildcard(),
    )
    for subject in others:
        await spy.subscribe(subject, cb=spy_cb)
    # What key A may subscribe to: its own inbox root (nothing of B's arrives there).
    await spy.subscribe(f"{subjects.key_inbox_root(key_id_of(tenants.a) or '')}.>", cb=spy_cb)
    await spy.flush()
    # The server has refused the five subscriptions it does not allow (and so has taken
    # all six) before B's stream runs.
    await wait_for(
        lambda: _violations(errors, "subscription") >= 5,
        timeout=10,
        what="the server did not refuse the five subscriptions",
    )
    async with await Client.connect(tenants.bus.url, api_key=tenants.b) as tb:
        out = await tb.chat_completion(tenants.model, MSG, max_tokens=12)
    assert out.usage.completion_tokens == 12
    await asyncio.sleep(0.3)  # a negative check: nothing of B's reaches the spy meanwhile
    assert got == []  # not one frame of B's stream, not one of anybody's
    assert _violations(errors, "subscription") == 5
    # Nor may A publish where only services do: workers, stages, heartbeats, usage, telemetry.
    errors.clear()
    for subject in (
        subjects.engine_generate(tenants.model, "r"),
        subjects.stage(subjects.STAGE_ROUTE),
        subjects.heartbeat(tenants.model, "spy"),
        subjects.usage(None),
        "tb.v1.telemetry.request",
        "$KV.tokenbus_keys.x",
    ):
        await spy.publish(subject, b"x")
    await spy.flush()
    await wait_for(
        lambda: _violations(errors, "publish") >= 6,
        timeout=10,
        what="the server did not refuse the six publishes",
    )
    assert _violations(errors, "publish") == 6
    await spy.close()


def _violations(errors: list[str], what: str) -> int:
    """How many of ``errors`` are the server's permissions violations for ``what``
    (``subscription`` or ``publish``)."""
    return sum(f"permissions violation for {what}" in e.lower() for e in errors)


@pytest.mark.stack
async def test_revoking_a_key_closes_its_connections(tenants: Tenants) -> None:
    gone = asyncio.Event()

    async def on_disconnect() -> None:
        gone.set()

    nc = await nats.connect(
        tenants.bus.url, token=tenants.a, disconnected_cb=on_disconnect, max_reconnect_attempts=1
    )
    key_id = key_id_of(tenants.a) or ""
    await tenants.admin.revoke(key_id)
    await asyncio.wait_for(gone.wait(), 10)  # at once (a bound for a loaded machine)
    # And it cannot come back.
    with pytest.raises(Exception, match="Authorization"):
        await nats.connect(
            tenants.bus.url, token=tenants.a, allow_reconnect=False, max_reconnect_attempts=0
        )
    with pytest.raises((TokenbusError, Exception)):
        async with await Client.connect(
            tenants.bus.url, api_key=tenants.a, allow_reconnect=False, max_reconnect_attempts=0
        ) as tb:
            await tb.chat_completion(tenants.model, MSG, max_tokens=1)
    await nc.close()


@pytest.mark.fault
async def test_a_keys_client_follows_its_replica_by_keepalives(
    bus: LockedBus, tmp_path: Path
) -> None:
    # A key's connection cannot see heartbeats: its streams carry keepalive frames instead.
    # A prefill far longer than the watchdog's patience (3 beats of 0.25 s) is not taken
    # for a dead replica; a frozen replica is, and the stream moves on to the other one.
    model = "keepalive-model"
    with Procs(bus.url, tmp_path) as procs:
        stack = await start_stack(
            procs,
            model,
            "ingress",
            "auth",
            "router",
            workers=2,
            bridge=False,
            worker_args=("--sim-prefill-ms", "1500", "--sim-decode-ms", "40"),
            env={
                "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
                "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25",
            },
            env_for=lambda role, _: bus.env(role),
            login=role_login(bus.users, "admin"),
        )
        admin = await bus.admin()
        store = await KeyStore(admin).open(watch=False)
        key, _ = await store.create("keepalive")
        await serve_when_ready(bus.url, key, model)
        want = expected_text("<|user|>tell me a story\n", 30)[0]
        async with await Client.connect(bus.url, api_key=key) as tb:
            assert tb._hb_sub is None  # not subscribed to heartbeats at all
            s = tb.chat(model, MSG, max_tokens=30)
            text = "".join([c.text async for c in s])
            assert text == want and s.migrations == 0
            s = tb.chat(model, MSG, max_tokens=30)
            got = []
            async for c in s:
                got.append(c.text)
                if len(got) == 5:
                    serving = next(w for w in stack.workers if w.name.endswith(s.replica[-1:]))
                    serving.signal(signal.SIGSTOP)
            serving.signal(signal.SIGCONT)
            assert "".join(got) == want and s.migrations == 1
        await admin.drain()
