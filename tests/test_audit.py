"""The audit trail: key and routing changes over HTTP and from the CLI, read back with
``tokenbus audit``, and what the locked bus lets each role do with it."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import StreamConfig

from auth.keys import key_id_of
from auth.store import KeyStore
from bus_schemas import subjects
from services import audit, buckets
from tests.support.busdata import key_store
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for
from tests.test_locked_bus import Locked

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "hi"}]
PIPELINE = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'}


def audit_cli(url: str, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``tokenbus audit --json`` (and ``args``) on the bus at ``url``: the events."""
    r = run_cli("--nats-url", url, "audit", "--json", *args, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    events: list[dict[str, Any]] = json.loads(r.stdout)
    return events


def cli(url: str, *args: str) -> str:
    r = run_cli("--nats-url", url, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def of(events: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    return [e for e in events if e["target"] == target]


# -- the kit --------------------------------------------------------------------------------
def test_subjects_and_secret_scrubbing() -> None:
    assert subjects.audit(audit.KEY_CREATED) == "tb.v1.audit.key.created"
    assert subjects.audit("routing.changed") == "tb.v1.audit.routing.changed"
    assert subjects.audit_wildcard() == "tb.v1.audit.>"
    key = "tb-0123456789ab_" + "A" * 43
    assert audit.scrub(f'{{"k": "{key}"}}') == '{"k": "tb-0123456789ab_[REDACTED]"}'
    assert audit.key_actor("0123456789ab") == "key:0123456789ab"
    assert audit.cli_actor().startswith("cli:") and "@" in audit.cli_actor()


async def test_record_creates_the_stream_and_read_returns_oldest_first(
    private_nats: NatsServer,
) -> None:
    nc = await nats.connect(private_nats.url)
    try:
        assert await audit.read(nc) == []  # no stream yet: nothing, and nothing created
        secret = "tb-0123456789ab_" + "B" * 43
        first = await audit.record(
            nc, audit.KEY_CREATED, "0123456789ab", "key:fedcba987654", {"leak": secret}
        )
        assert first.seq == 1
        info = await nc.jetstream().stream_info(audit.STREAM)
        cfg = info.config
        assert cfg.subjects == ["tb.v1.audit.>"] and cfg.deny_delete and cfg.deny_purge
        assert cfg.max_age == audit.MAX_AGE_S and cfg.max_bytes == audit.MAX_BYTES
        for i in range(5):
            await audit.record(
                nc, audit.ROUTING_CHANGED, f"m{i}", "cli:u@h", {"i": i}, request_id=f"r{i}"
            )
        events = await audit.read(nc)
        assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
        assert events[0].details == {"leak": "tb-0123456789ab_[REDACTED]"}
        assert events[0].action == "key.created" and events[0].actor == "key:fedcba987654"
        when = dt.datetime.fromisoformat(events[0].ts)
        assert abs(when.timestamp() - time.time()) < 60
        assert abs(events[0].ts_unix - when.timestamp()) < 0.01
        newest = await audit.read(nc, limit=2)
        assert [e.target for e in newest] == ["m3", "m4"]
        assert newest[1].request_id == "r4"
        # ``since`` is by the time the stream stored an event: once the clock is past the
        # newest one's, a ``since`` from now on leaves every earlier event out.
        stored = (await nc.jetstream().get_msg(audit.STREAM, newest[1].seq)).time
        assert stored is not None
        stored_at = stored.timestamp()
        await wait_for(
            lambda: time.time() > stored_at + 0.1,
            timeout=10,
            what="the clock never passed the newest event",
        )
        mark = time.time()
        await audit.record(nc, audit.KEY_REVOKED, "0123456789ab", "cli:u@h")
        assert [e.action for e in await audit.read(nc, since=mark - 0.05)] == ["key.revoked"]
        assert len(await audit.read(nc, limit=None)) == 7
        # Not even the admin may erase entries: the stream refuses deletes and purges.
        with pytest.raises(Exception, match="not permitted"):
            await nc.jetstream().delete_msg(audit.STREAM, 1)
        with pytest.raises(Exception, match="not permitted"):
            await nc.jetstream().purge_stream(audit.STREAM)
        # What does not parse is shown, not hidden.
        await nc.jetstream().publish(subjects.audit("key.created"), b"not json")
        odd = (await audit.read(nc, limit=1))[0]
        assert odd.action == "unreadable" and odd.details == {"raw": "not json"}
    finally:
        await nc.drain()


async def test_a_change_is_refused_when_the_trail_cannot_be_written(
    private_nats: NatsServer,
) -> None:
    nc = await nats.connect(private_nats.url)
    try:
        # A stream on the audit subjects that lets entries be deleted is not the trail.
        await nc.jetstream().add_stream(
            StreamConfig(name=audit.STREAM, subjects=[subjects.audit_wildcard()])
        )
        store = await KeyStore(nc).open(watch=False)
        before = {r.id for r in await store.list()}
        with pytest.raises(audit.AuditUnavailable, match="nothing was changed"):
            await store.create("refused", actor="cli:u@h")
        assert {r.id for r in await store.list()} == before
        # Without an actor (internal callers) nothing is recorded, nothing is refused.
        _, rec = await store.create("internal")
        with pytest.raises(audit.AuditUnavailable):
            await store.revoke(rec.id, actor="cli:u@h")
        assert (await store.get(rec.id)).enabled
    finally:
        await nc.drain()


# -- HTTP and CLI ---------------------------------------------------------------------------
async def test_http_admin_changes_are_audited_with_the_admin_key_id(
    procs: Procs, model: str
) -> None:
    async with key_store(procs.url) as keys:
        admin, admin_rec = await keys.create("audit-admin", admin=True)
    stack = await start_stack(procs, model, "auth", "router", env=PIPELINE)
    adm = {"Authorization": f"Bearer {admin}"}
    async with stack.http("/v1") as h:
        r = await h.post(
            "/admin/keys",
            headers={**adm, "X-Request-Id": "audit-req-1"},
            json={"name": "audited", "rpm": 7, "models": [model]},
        )
        assert r.status_code == 201, r.text
        assert r.headers["x-request-id"] == "audit-req-1"
        made = r.json()
        new_key = made["key"]
        r = await h.patch(f"/admin/keys/{made['id']}", headers=adm, json={"rpm": 9, "tpm": 500})
        assert r.status_code == 200, r.text
        patch_rid = r.headers["x-request-id"]
        r = await h.delete(f"/admin/keys/{made['id']}", headers=adm)
        assert r.status_code == 200 and r.json()["enabled"] is False
        url = f"/admin/routing/{model}"
        r = await h.put(url, headers=adm, json={"policy": "round_robin"})
        assert r.status_code == 200, r.text
        r = await h.delete(url, headers=adm)
        assert r.status_code == 200, r.text
        # Reading is not a change: nothing recorded.
        assert (await h.get(f"/admin/keys/{made['id']}", headers=adm)).status_code == 200
    out = run_cli("--nats-url", procs.url, "audit", "--json", "--limit", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert admin not in out.stdout and new_key not in out.stdout
    assert admin_rec.hash not in out.stdout
    events = json.loads(out.stdout)
    actor = f"key:{admin_rec.id}"
    keyed = of(events, made["id"])
    assert [e["action"] for e in keyed] == ["key.created", "key.updated", "key.revoked"]
    assert all(e["actor"] == actor for e in keyed)
    created, updated, revoked = keyed
    assert created["request_id"] == "audit-req-1"
    assert created["details"]["rpm"] == 7 and created["details"]["models"] == [model]
    assert created["details"]["name"] == "audited" and "hash" not in created["details"]
    assert updated["request_id"] == patch_rid
    assert updated["details"] == {
        "changes": {"rpm": 9, "tpm": 500},
        "previous": {"rpm": 7, "tpm": None},
    }
    assert revoked["details"] == {"name": "audited", "was_enabled": True}
    routed = of(events, model)
    assert [e["action"] for e in routed] == ["routing.changed", "routing.changed"]
    assert all(e["actor"] == actor for e in routed)
    assert routed[0]["details"] == {"override": {"policy": "round_robin"}, "previous": None}
    assert routed[1]["details"] == {
        "override": None,
        "reset": True,
        "previous": {"policy": "round_robin"},
    }
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    text = cli(procs.url, "audit", "--limit", "0")
    assert made["id"] in text and actor in text and "key.revoked" in text


def test_cli_changes_are_audited_with_the_os_user(nats_server: NatsServer, model: str) -> None:
    url = nats_server.url
    made = cli(url, "keys", "create", "--name", "cli-audited", "--rpm", "5")
    key = made.strip().splitlines()[-1]
    key_id = key_id_of(key)
    assert key_id
    cli(url, "keys", "update", key_id, "--tpm", "1000")
    cli(url, "keys", "revoke", key_id)
    cli(url, "router", "set", model, "--policy", "power_of_two")
    cli(url, "router", "reset", model)
    out = run_cli("--nats-url", url, "audit", "--json", "--limit", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert key not in out.stdout
    events = json.loads(out.stdout)
    me = audit.cli_actor()
    keyed = of(events, key_id)
    assert [e["action"] for e in keyed] == ["key.created", "key.updated", "key.revoked"]
    assert all(e["actor"] == me and e["request_id"] is None for e in keyed)
    assert keyed[0]["details"]["rpm"] == 5
    assert keyed[1]["details"] == {"changes": {"tpm": 1000}, "previous": {"tpm": None}}
    routed = of(events, model)
    assert [e["details"]["override"] for e in routed] == [{"policy": "power_of_two"}, None]
    assert all(e["actor"] == me and e["action"] == "routing.changed" for e in routed)
    # --since and --limit
    assert audit_cli(url, "--since", "1h", "--limit", "2") == events[-2:]
    assert of(audit_cli(url, "--since", "1h", "--limit", "0"), key_id) == keyed
    bad = run_cli("--nats-url", url, "audit", "--since", "yesterday")
    assert bad.returncode == 2 and "not a duration" in bad.stdout


# -- the locked bus -------------------------------------------------------------------------
@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Locked]:
    lk = Locked(tmp_path)
    yield lk
    lk.proc.terminate()
    lk.proc.wait(10)


async def test_locked_bus_only_the_bridge_and_admin_reach_the_trail(
    locked: Locked, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def ignore(exc: Exception) -> None:
        return None

    # The bridge role writes the trail (creating the stream) as its admin API does.
    bridge = await locked.connect("bridge", error_cb=ignore)
    try:
        store = await KeyStore(bridge).open(watch=False)
        key, rec = await store.create("locked", actor="key:0123456789ab")
        # ... but may not delete the stream or change its limits.
        js = bridge.jetstream(timeout=1)
        with pytest.raises(Exception):  # noqa: B017 - a refusal or a timeout
            await js.delete_stream(audit.STREAM)
        with pytest.raises(Exception):  # noqa: B017
            await js.purge_stream(audit.STREAM)
        info = await js.stream_info(audit.STREAM)
        assert info.state.messages == 1
    finally:
        await bridge.close()
    # A client may neither publish to the audit subjects nor read the stream.
    client = await locked.connect("client", error_cb=on_error)
    try:
        await client.publish(subjects.audit(audit.KEY_CREATED), b'{"forged": true}')
        await client.subscribe(subjects.audit_wildcard())
        await client.flush()
        with pytest.raises(Exception):  # noqa: B017 - the API request is refused
            await client.jetstream(timeout=1).stream_info(audit.STREAM)
        # The server says so asynchronously: until the three refusals have come back.
        with contextlib.suppress(AssertionError):
            await wait_for(
                lambda: sum("permissions violation" in e.lower() for e in errors) >= 3,
                timeout=10,
            )
        assert sum("permissions violation" in e.lower() for e in errors) >= 3, errors
    finally:
        await client.close()
    # A service role with the JetStream API but not the audit subjects (auth) cannot make
    # audited changes: a new key is taken back, a revocation stands and says so.
    monkeypatch.setattr(audit, "TIMEOUT_S", 1.0)
    # A refused publish has no answer, like a stalled stream leader's: retried that long.
    monkeypatch.setattr(buckets, "STALL_RETRY_S", 1.0)
    auth = await locked.connect("auth", error_cb=ignore)
    try:
        store = await KeyStore(auth).open(watch=False)
        with pytest.raises(audit.AuditUnavailable, match="nothing was created"):
            await store.create("unaudited", actor="cli:u@h")
        assert [r.id for r in await store.list()] == [rec.id]
        with pytest.raises(audit.AuditIncomplete, match="was done"):
            await store.revoke(rec.id, actor="cli:u@h")
        assert not (await store.get(rec.id)).enabled
    finally:
        await auth.close()
    as_client = run_cli("--nats-url", locked.url, "audit", "--json", env=_env(locked, "client"))
    assert as_client.returncode == 1 and "cannot read the audit trail" in as_client.stdout
    # The admin reads it: one event, the forged one never got in.
    events = audit_cli(locked.url, env=_env(locked, "admin"))
    assert [(e["action"], e["target"], e["actor"]) for e in events] == [
        ("key.created", rec.id, "key:0123456789ab")
    ]
    assert key not in json.dumps(events)


def _env(locked: Locked, role: str) -> dict[str, str]:
    return {**os.environ, **locked.env(role)}
