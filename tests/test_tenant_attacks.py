"""A tenant holding one ordinary key, attacking its limits, its budget and the bus (issue 64),
on the locked bus with the auth callout, every stage and a price: a real nats-server on the
generated config and real processes. Each attack here worked before its fix:

- one ``X-Request-Id`` on twenty requests at once took one concurrency slot and one budget
  hold for all twenty (slots, holds and charges were keyed by the client's id);
- a malformed request whose reply subject named ``$KV.tokenbus_keys.<another key>`` or
  ``$KV.tokenbus_secrets.admission`` had ingress write its error frame over that record with
  its own rights; another key's inbox got the frame the same way;
- a second attempt sent with the first attempt's real admission ticket and ``resume.tokens:
  0`` rewrote the first attempt's charge to $0.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from auth import budgets
from auth.keys import key_id_of
from auth.limits import SECRETS_BUCKET
from auth.store import BUCKET as KEYS_BUCKET
from auth.store import KeyStore
from bus_schemas import codec, subjects
from bus_schemas import headers as H
from bus_schemas.errors import TokenbusError
from services import bodies
from services.natsconf import role_login
from tests.lockedbus import LockedBus, serve_when_ready
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

MODEL = "attack-model"
MSG = [{"role": "user", "content": "What does it cost?"}]
# An answer token costs $0.001 (1000 micro-dollars); prompts are free.
PRICE = {"input": 0, "output": 1000}
ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]',
    "TOKENBUS_ROUTER__PRICE": json.dumps(PRICE),
    # Long enough for the large requests' prompts (docs/large-requests.md).
    "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": "50000000",
}


class Stack:
    def __init__(
        self, bus: LockedBus, base: str, store: KeyStore, admin: Any, procs: Procs, stack: Any
    ) -> None:
        self.bus = bus
        self.base = base
        self.store = store
        self.admin = admin
        self.procs = procs
        self.stack = stack

    async def key(self, name: str, **fields: Any) -> tuple[str, str]:
        key, rec = await self.store.create(name, **fields)
        await serve_when_ready(self.bus.url, key, MODEL)
        return key, rec.id

    async def settled_spend(self, key_id: str) -> int:
        """What the key spent once nothing is held (the request that found it served)."""
        last = [(0, 0)]

        async def idle() -> bool:
            last[0] = await self.spent(key_id)
            return last[0][1] == 0

        await wait_for(idle, what="the key's requests settled")
        return last[0][0]

    async def spent(self, key_id: str, period: str = "total") -> tuple[int, int]:
        book = await budgets.SpendBook(self.admin).open()
        return await book.spent(budgets.Budget(f"k.{key_id}", period, None, None))


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("attacks")
    bus = LockedBus(tmp / "locked").start()
    try:
        with Procs(bus.url, tmp) as procs:
            s = await start_stack(
                procs,
                MODEL,
                "ingress",
                "auth",
                "ratelimit",
                "router",
                worker_args=("--sim-decode-ms", "20", "--sim-max-running", "64"),
                env=ENV,
                env_for=lambda role, _: bus.env(role),
                login=role_login(bus.users, "admin"),
            )
            admin = await bus.admin()
            store = await KeyStore(admin).open(watch=False)
            yield Stack(bus, s.base, store, admin, procs, s)
            await admin.drain()
    finally:
        bus.stop()


@pytest.mark.stack
async def test_one_request_id_on_twenty_requests_is_twenty_requests(stack: Stack) -> None:
    """A key allowed 2 requests at once sends 20 long streams at once, all with one
    X-Request-Id: 2 are served, 18 refused with 429, and the key is served again once they
    end. Each response still carries the client's id as its label."""
    key, _ = await stack.key("one-id-slots", max_concurrent=2)
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 2000,  # 40 s at 20 ms a token: all 20 are answered long before
        "ignore_eos": True,
        "stream": True,
    }
    hdrs = {"Authorization": f"Bearer {key}", "X-Request-Id": "same-id"}
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as h:
        streams = [h.stream("POST", "/v1/chat/completions", json=body, headers=hdrs)]
        streams += [
            h.stream("POST", "/v1/chat/completions", json=body, headers=hdrs) for _ in range(19)
        ]
        responses = await asyncio.gather(*(s.__aenter__() for s in streams))
        try:
            codes = sorted(r.status_code for r in responses)
            assert codes == [200] * 2 + [429] * 18, codes
            assert {r.headers["x-request-id"] for r in responses} == {"same-id"}
            refused = next(r for r in responses if r.status_code == 429)
            assert "concurrent" in (await refused.aread()).decode()
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)  # the served ones are cancelled

        async def served_again() -> bool:
            one = {**body, "max_tokens": 2, "stream": False}
            r = await h.post("/v1/chat/completions", json=one, headers=hdrs)
            return r.status_code == 200

        await wait_for(served_again, what="the key served once its streams were cancelled")


@pytest.mark.stack
async def test_one_request_id_cannot_share_a_budget_hold(stack: Stack) -> None:
    """$0.010 of budget, $0.002 a request, twenty sent at once with one X-Request-Id: five
    answered, fifteen refused for the budget, and the key's spend is exactly what the five
    cost (before: one hold for all, every one answered, one answer's price charged)."""
    # $0.001 of it goes on the one-token request that finds the key served.
    key, key_id = await stack.key("one-id-budget", budget_usd=0.011, budget_period="total")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2, "ignore_eos": True}
    before = await stack.settled_spend(key_id)
    hdrs = {"Authorization": f"Bearer {key}", "X-Request-Id": "same-id"}
    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as h:
        rs = await asyncio.gather(
            *(h.post("/v1/chat/completions", json=body, headers=hdrs) for _ in range(20))
        )
    codes = sorted(r.status_code for r in rs)
    assert codes == [200] * 5 + [429] * 15, codes
    served = sum(r.json()["usage"]["completion_tokens"] for r in rs if r.status_code == 200)
    assert served == 10
    cost = before + served * PRICE["output"]

    async def settled() -> bool:
        return await stack.spent(key_id) == (cost, 0)

    await wait_for(settled, what=f"the key's spend settled at {cost} micro-dollars")


@pytest.mark.stack
async def test_a_reply_subject_cannot_write_another_tenants_state(stack: Stack) -> None:
    """A key's own NATS connection sends malformed requests whose reply subjects name
    another key's record, the admission tickets' secret and another key's inbox: none of
    them is written; the request with its own inbox gets its error as always."""
    key_a, _ = await stack.key("attacker")
    key_b, id_b = await stack.key("victim")
    js = stack.admin.jetstream()
    keys_kv = await js.key_value(KEYS_BUCKET)
    secrets_kv = await js.key_value(SECRETS_BUCKET)
    before_b = (await keys_kv.get(id_b)).revision
    before_secret = (await secrets_kv.get("admission")).revision

    root_a = subjects.key_inbox_root(str(key_id_of(key_a)))
    root_b = subjects.key_inbox_root(id_b)
    a = await nats.connect(stack.bus.url, token=key_a, inbox_prefix=root_a)
    b = await nats.connect(stack.bus.url, token=key_b, inbox_prefix=root_b)
    try:
        seen_b: list[bytes] = []

        async def on_b(msg: Any) -> None:
            seen_b.append(msg.data)

        await b.subscribe(f"{root_b}.>", cb=on_b)
        await b.flush()
        bad = b"\xc1 not msgpack"
        as_a = {H.API_KEY: key_a}
        for reply in (
            f"$KV.{KEYS_BUCKET}.{id_b}",
            f"$KV.{SECRETS_BUCKET}.admission",
            f"{root_b}.spoofed",
            f"{subjects.PREFIX}.admin.keys",
            "_INBOX.*.wild",
        ):
            await a.publish(subjects.request("chat"), bad, reply=reply, headers=as_a)
        # Behind them, the same request answered in A's own inbox: once its error is back,
        # ingress has handled (and dropped) every one before it.
        own = await a.request(subjects.request("chat"), bad, timeout=10, headers=as_a)
        assert codec.decode_map(own.data).get("t") == "e", own.data  # an error frame
        await b.flush()  # B has read all the server routed to it before
        assert seen_b == []
    finally:
        await a.close()
        await b.close()
    assert (await keys_kv.get(id_b)).revision == before_b
    assert (await secrets_kv.get("admission")).revision == before_secret
    await stack.store.get(id_b)  # the record still reads as a key
    # The victim is still served.
    async with await Client.connect(stack.bus.url, api_key=key_b) as tb:
        out = await tb.chat_completion(MODEL, MSG, max_tokens=2)
        assert out.usage.completion_tokens == 2


async def _answered(tb: Client, key: str, body: dict[str, Any], **kw: Any) -> Any:
    """One chat request of ``key`` read to its end; its stream (usage, ticket, ids)."""
    stream = tb.submit("chat", body, api_key=key, **kw)
    async for _ in stream:
        pass
    return stream


async def _lowered_resume(tb: Client, key: str, body: dict[str, Any], first: Any) -> Any:
    """The attack: another attempt with ``first``'s real ticket, claiming it got nothing."""
    return await _answered(
        tb,
        key,
        {**body, "resume": {"text": "", "tokens": 0}},
        request_id=first.request_id,  # as a real migration sends it
        headers={H.MIGRATION: "1", H.ADMISSION: first._admission},
    )


@pytest.mark.stack
async def test_a_caller_cannot_lower_what_an_attempt_was_charged(stack: Stack) -> None:
    """A NATS client takes its first answer (8 tokens), then sends a second attempt with
    that attempt's real admission ticket and ``resume.tokens: 0``: the first attempt is
    still charged the 8 tokens its worker produced, so the key pays for both answers
    (before: the first was rewritten to $0)."""
    key, key_id = await stack.key("lowerer", rpm=10_000, budget_usd=1.0, budget_period="total")
    before = await stack.settled_spend(key_id)
    body = {"model": MODEL, "messages": MSG, "max_tokens": 8, "ignore_eos": True}
    async with await Client.connect(stack.bus.url, api_key=key) as tb:
        first = await _answered(tb, key, body)
        assert first._admission and first.usage is not None
        assert first.usage.completion_tokens == 8
        second = await _lowered_resume(tb, key, body, first)
        assert second.usage is not None
        total = first.usage.completion_tokens + second.usage.completion_tokens
    cost = before + total * PRICE["output"]
    last: list[tuple[int, int]] = []

    async def both_paid() -> bool:
        last[:] = [await stack.spent(key_id)]
        return last[0] == (cost, 0)

    try:
        await wait_for(both_paid, what=f"both answers paid: {cost} micro-dollars", timeout=30)
    except AssertionError:
        raise AssertionError(f"spent, held: {last}, expected ({cost}, 0)") from None


@pytest.mark.stack
async def test_a_ticket_supersedes_once(stack: Stack) -> None:
    """The same ticket sent with two more attempts: the second is a new request, counted
    and charged as one (the ticket is claimed once)."""
    key, key_id = await stack.key("replayer", rpm=10_000, budget_usd=1.0, budget_period="total")
    before = await stack.settled_spend(key_id)
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, "ignore_eos": True}
    async with await Client.connect(stack.bus.url, api_key=key) as tb:
        first = await _answered(tb, key, body)
        got = 4
        for _ in range(2):
            again = await _lowered_resume(tb, key, body, first)
            assert again.usage is not None
            got += again.usage.completion_tokens
    cost = before + got * PRICE["output"]

    async def all_paid() -> bool:
        return await stack.spent(key_id) == (cost, 0)

    await wait_for(all_paid, what=f"every answer paid: {cost}", timeout=30)


@pytest.mark.unit
def test_the_module_runs_against_a_locked_bus(tmp_path: Path) -> None:
    """The attacks above are made by a key's own connection: the generated config gives a
    key's connection no other way in than the callout (no shared client password)."""
    from services.natsconf import generate

    conf, users = generate(tmp_path, port=4222, callout=True)
    assert "client" not in json.loads(users.read_text())
    assert "callout" in conf.read_text()


@pytest.mark.stack
async def test_a_service_login_cannot_rewrite_the_keys_or_the_secret(stack: Stack) -> None:
    """Defence behind the reply check: each service role that holds the JetStream API but
    does not write the key records or the admission secret is refused by nats-server when
    it publishes to their entries (a stolen ingress login, or a service tricked into
    answering there, writes nothing)."""
    from services.natsconf import GUARDED_BUCKETS, JS_API, ROLES

    js = stack.admin.jetstream()
    _, victim = await stack.key("guarded")
    entries = {"tokenbus_keys": victim, "tokenbus_secrets": "admission"}
    before = {b: (await (await js.key_value(b)).get(k)).revision for b, k in entries.items()}
    tried = 0
    for role, (pub, _) in ROLES.items():
        if not set(JS_API) <= set(pub):
            continue
        errors: list[str] = []

        async def on_error(exc: Exception, errors: list[str] = errors) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            stack.bus.url, error_cb=on_error, **role_login(stack.bus.users, role)
        )
        try:
            denied = [b for b, writers in GUARDED_BUCKETS.items() if role not in writers]
            for bucket in denied:
                await nc.publish(f"$KV.{bucket}.{entries[bucket]}", b"{}")
                tried += 1
            await nc.flush()

            async def refused(n: int = len(denied), errors: list[str] = errors) -> bool:
                return sum("permissions violation" in e.lower() for e in errors) >= n

            await wait_for(refused, what=f"{role}'s writes refused by nats-server")
        finally:
            await nc.close()
    assert tried >= 5  # ingress, auth, ratelimit, router (bridge writes both)
    after = {b: (await (await js.key_value(b)).get(k)).revision for b, k in entries.items()}
    assert after == before


@pytest.mark.unit
def test_the_guarded_buckets_match_the_table_in_the_docs() -> None:
    """docs/safety.md's table of who may write the key records and the ticket secret is the
    generated config's (services.natsconf.GUARDED_BUCKETS)."""
    from services.natsconf import GUARDED_BUCKETS, ROLES
    from tests.support.repo import ROOT

    text = (ROOT / "docs" / "safety.md").read_text()
    table = text.split("### Who may write the key records and the ticket secret", 1)[1]
    rows: dict[str, dict[str, bool]] = {}
    for line in table.splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if cells[0] in ROLES:
            rows[cells[0]] = {
                "tokenbus_keys": cells[1] == "yes",
                "tokenbus_secrets": cells[2] == "yes",
            }
    assert set(rows) == set(ROLES)
    for role, may in rows.items():
        for bucket, writers in GUARDED_BUCKETS.items():
            assert may[bucket] == (role in writers), (role, bucket)


async def _session(stack: Stack, key: str) -> tuple[Any, asyncio.Event]:
    """A raw NATS session logged in with ``key``, and an event set when the server closes it."""
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async def on_disconnect() -> None:
        closed.set()

    nc = await nats.connect(
        stack.bus.url,
        token=key,
        inbox_prefix=subjects.key_inbox_root(str(key_id_of(key))),
        allow_reconnect=False,
        closed_cb=on_closed,
        disconnected_cb=on_disconnect,
    )
    return nc, closed


@pytest.mark.stack
async def test_a_rotated_secret_s_sessions_end_with_its_overlap(stack: Stack) -> None:
    """A key rotated with a 3 s overlap: a session made with the old secret works through the
    overlap and is closed once it ends; a session made with the new secret stays open."""
    key, key_id = await stack.key("rotated")
    old, old_closed = await _session(stack, key)
    new_key, _ = await stack.store.rotate(key_id, overlap_s=3)
    new, new_closed = await _session(stack, new_key)
    try:
        # Within the overlap the old secret still logs in.
        still, _ = await _session(stack, key)
        await still.close()
        await wait_for(old_closed.is_set, timeout=30, what="the old secret's session closed")
        assert not new_closed.is_set() and new.is_connected
        with pytest.raises(Exception, match="Authorization"):
            await nats.connect(stack.bus.url, token=key, allow_reconnect=False)
    finally:
        await old.close()
        await new.close()


@pytest.mark.fault
async def test_revoking_closes_sessions_made_before_an_auth_restart(stack: Stack) -> None:
    """A session logged in, then every auth instance restarted (kill -9): revoking the key
    still closes that session within seconds (the restarted instance never saw it log in)."""
    key, key_id = await stack.key("before-restart")
    nc, closed = await _session(stack, key)
    try:
        for p in stack.stack.roles["auth"]:
            p.signal(signal.SIGKILL)
            p.proc.wait(10)
        stack.stack.roles["auth"] = [
            stack.procs.start("auth-again", "serve", "auth", env={**ENV, **stack.bus.env("auth")})
        ]
        other, _ = await stack.key("after-restart")  # the new instance answers logins
        assert nc.is_connected
        await stack.store.revoke(key_id)
        await wait_for(closed.is_set, timeout=30, what="the revoked key's older session closed")
        assert other
    finally:
        await nc.close()


@pytest.mark.unit
def test_every_role_s_permissions_are_the_table_in_the_docs() -> None:
    """docs/safety.md's table of every role's permissions is the generated config's."""
    from services.natsconf import permissions_table
    from tests.support.repo import ROOT

    text = (ROOT / "docs" / "safety.md").read_text()
    shown = text.split("<!-- permissions:begin -->\n", 1)[1].split("<!-- permissions:end -->")[0]
    assert shown == permissions_table(), "docs/safety.md's permissions table is stale"


@pytest.mark.stack
async def test_a_key_writes_only_its_own_large_bodies_and_reads_none(stack: Stack) -> None:
    """Large requests (claim check, docs/large-requests.md) from a key's own connection: its
    body is served through every stage; another key can neither write under it, read it, nor
    name it in a request of its own."""
    key_a, id_a = await stack.key("large-a")
    key_b, id_b = await stack.key("large-b")
    big = [{"role": "user", "content": "tell me " * 200_000}]  # 1.6 MB
    async with await Client.connect(stack.bus.url, api_key=key_a) as ta:
        done = await ta.chat_completion(MODEL, big, max_tokens=2)
        assert done.usage.completion_tokens == 2
        theirs = {"model": MODEL, "messages": big, "max_tokens": 2}
        await bodies.put(ta.nc, theirs, ta.owner)
    claim = theirs["claim"]
    assert claim["owner"] == f"tbk.{id_a}"
    nc = await nats.connect(stack.bus.url, token=key_b, inbox_prefix=subjects.key_inbox_root(id_b))
    try:
        js = nc.jetstream()
        chunk = subjects.body_chunk(claim["owner"], claim["id"], 0)
        with pytest.raises(Exception):  # noqa: B017 - denied: no answer of any kind
            await js.publish(chunk, b"x" * 16, timeout=1)
        with pytest.raises(Exception):  # noqa: B017
            await asyncio.wait_for(js.get_msg(subjects.BODIES_STREAM, subject=chunk), 2)
    finally:
        await nc.close()
    async with await Client.connect(stack.bus.url, api_key=key_b) as tb:
        stolen = {"model": MODEL, "max_tokens": 2, "claim": claim}
        with pytest.raises(TokenbusError) as got:
            await tb.submit("chat", stolen, api_key=key_b).collect()
        assert got.value.status == 400 and "own body objects" in got.value.message
        # Its own large requests are served.
        done = await tb.chat_completion(MODEL, big, max_tokens=2)
        assert done.usage.completion_tokens == 2
