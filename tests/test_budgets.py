"""Spend budgets (auth.budgets, docs/flow.md): prices per model, hard budgets refused exactly
at the limit across two bridges, soft thresholds alerting, owners' budgets shared by their
keys; a real nats-server and real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from auth import budgets, ratelimit
from auth.limits import Limiter
from auth.ratelimit import RateLimitCheck
from bus_schemas import codec, subjects
from bus_schemas import headers as H
from jobs.background import EVENTS_STREAM
from services.config import PriceSettings
from tests.support.busdata import key_store
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for, wait_http, wait_started
from tokenbus import Client

MSG = [{"role": "user", "content": "What does it cost?"}]
# An answer token costs $0.001 (1000 micro-dollars); prompts are free, so a request's cost
# is known before it runs: max_tokens with ignore_eos.
PRICE = json.dumps({"input": 0, "output": 1000})
ENV = {
    "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]',
    "TOKENBUS_ROUTER__PRICE": PRICE,
}
BODY: dict[str, Any] = {"messages": MSG, "max_tokens": 2, "ignore_eos": True}


@pytest.mark.unit
def test_cost_and_periods() -> None:
    price = PriceSettings(input=2.5, cached_input=1.25, output=10)
    assert budgets.cost(price, 1000, 100) == 2500 + 1000
    assert budgets.cost(price, 1000, 100, cached=400) == 600 * 2.5 + 400 * 1.25 + 1000
    assert budgets.cost(PriceSettings(input=0.1), 3, 0) == 1  # rounded up, never under
    assert budgets.cost(None, 10**6, 10**6) == 0
    t = 1795651200.0  # 2026-11-26 00:00 UTC
    assert budgets.period_id("day", t) == "d20261126"
    assert budgets.period_id("month", t) == "m202611"
    assert budgets.period_id("total", t) == "total"
    b, owner = budgets.parse_header(budgets.header("day", 1.5, None, "team a"))
    assert b is not None and b.hard == 1_500_000 and b.soft is None and owner == "team a"
    assert budgets.parse_header("week,1,2,x") == (None, "x")


async def _second_bridge(procs: Procs) -> str:
    port = free_port()
    procs.start("bridge-2", "serve", "bridge", "--port", str(port), env=ENV)
    await wait_http(f"http://127.0.0.1:{port}/ready")
    return f"http://127.0.0.1:{port}"


async def _started(procs: Procs) -> None:
    """Until the auth service answers discovery (it has started) and has beaten since."""
    nc = await nats.connect(procs.url)
    try:
        await wait_started(nc, {"auth": 1})
    finally:
        await nc.drain()


async def _settled(url: str, budget: budgets.Budget, timeout: float = 20) -> None:
    """Until nothing is held in ``budget`` for a request in flight: every usage report of
    its requests has settled."""
    nc = await nats.connect(url)
    try:
        book = await budgets.SpendBook(nc).open()
        deadline = time.monotonic() + timeout
        while (held := (await book.spent(budget))[1]) != 0:
            assert time.monotonic() < deadline, f"${held / 1e6} still held"
            await asyncio.sleep(0.05)
    finally:
        await nc.drain()


async def _post(base: str, key: str, model: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=30) as h:
        return await h.post(
            "/v1/chat/completions",
            json={"model": model, **BODY},
            headers={"Authorization": f"Bearer {key}"},
        )


@pytest.mark.stack
async def test_a_hard_budget_refuses_exactly_at_the_limit_across_two_bridges(
    procs: Procs, model: str
) -> None:
    """$0.010 of budget, $0.002 a request: five requests, sent at once through two bridges
    (each holding and settling in its own process), get answers; every other one a 429
    insufficient_quota. The key's spend is then exactly the budget."""
    async with key_store(procs.url) as store:
        key, rec = await store.create("capped", budget_usd=0.010)
    stack = await start_stack(procs, model, "auth", env=ENV)
    await _started(procs)
    other = await _second_bridge(procs)
    rs = await asyncio.gather(
        *(_post(stack.base if i % 2 else other, key, model) for i in range(9))
    )
    codes = sorted(r.status_code for r in rs)
    assert codes == [200] * 5 + [429] * 4, [r.text for r in rs]
    refused = next(r for r in rs if r.status_code == 429).json()["error"]
    assert refused["code"] == "insufficient_quota" and refused["type"] == "insufficient_quota"
    assert "budget" in refused["message"]
    # Until the last usage reports settle: nothing held for a request in flight.
    await _settled(procs.url, budgets.Budget(f"k.{rec.id}", rec.budget_period, None, None))
    show = await asyncio.to_thread(
        run_cli,
        "keys",
        "show",
        rec.id,
        "--json",
        env={**os.environ, "TOKENBUS_NATS_URL": procs.url},
    )
    shown = json.loads(show.stdout)
    assert shown["spent_usd"] == pytest.approx(0.010) and shown["held_usd"] == 0
    # Still refused, on either bridge, and nothing more is spent.
    assert (await _post(stack.base, key, model)).status_code == 429
    assert (await _post(other, key, model)).status_code == 429
    assert stack.all_alive()


@pytest.mark.stack
async def test_a_soft_threshold_alerts_once_and_owners_share_a_budget(
    procs: Procs, model: str
) -> None:
    """Two keys of one owner share the owner's budget (set over the admin API); crossing a
    key's soft threshold is an event on the bus (the telemetry service's alert metric)."""
    async with key_store(procs.url) as store:
        admin, _ = await store.create("admin", admin=True)
        a, rec_a = await store.create("a", owner="team-x", soft_budget_usd=0.003)
        b, _ = await store.create("b", owner="team-x")
    events: list[dict[str, Any]] = []
    nc = await nats.connect(procs.url)

    async def on_event(msg: Any) -> None:
        events.append(codec.decode_map(msg.data))

    await nc.subscribe(subjects.telemetry(subjects.TELEMETRY_BUDGET), cb=on_event)
    stack = await start_stack(procs, model, "auth", env=ENV)
    await _started(procs)
    try:
        async with stack.http("/v1/admin/keys", headers={"Authorization": f"Bearer {admin}"}) as h:
            r = await h.put("/owners/team-x/budget", json={"budget_usd": 0.006, "period": "day"})
            assert r.status_code == 200 and r.json()["budget_usd"] == pytest.approx(0.006)
            bad = await h.put("/owners/team-x/budget", json={"budget_usd": -1})
            assert bad.status_code == 400
        served = [await _post(stack.base, k, model) for k in (a, b, a)]
        assert [r.status_code for r in served] == [200, 200, 200]
        over = await _post(stack.base, b, model)
        assert over.status_code == 429 and "owner" in over.json()["error"]["message"]
        # Until the usage reports settle (nothing held for the owner's requests in flight)
        # and key a's alert has come.
        book = await budgets.SpendBook(nc).open()
        team = await book.owner_budget("team-x")
        assert team is not None
        await _settled(procs.url, team)
        await wait_for(
            lambda: any(e["scope"] == f"key:{rec_a.id}" for e in events),
            what=f"no alert for key a: {events}",
        )
        await asyncio.sleep(0.3)  # a negative check: no second alert follows the first
        # Key a spent $0.004 of its own: past its soft $0.003 once, with one event.
        mine = [e for e in events if e["scope"] == f"key:{rec_a.id}"]
        assert len(mine) == 1 and mine[0]["spent_usd"] == pytest.approx(0.004), events
        out = await asyncio.to_thread(
            run_cli,
            "keys",
            "owner-budget",
            "team-x",
            "--json",
            env={**os.environ, "TOKENBUS_NATS_URL": procs.url},
        )
        got = json.loads(out.stdout)
        assert got["spent_usd"] == pytest.approx(0.006) and got["period"] == "day"
    finally:
        await nc.drain()
    assert stack.all_alive()


@pytest.fixture
def own_procs(private_nats: Any, tmp_path: Any) -> Iterator[Procs]:
    """Processes on a bus of this test's own: the spend reports' stream holds only its own
    (a limiter of another test's stack, alive on a shared bus, would put back reports that
    are not its own for its grace of 5 s, and the stream might not empty in time)."""
    with Procs(private_nats.url, tmp_path) as procs:
        yield procs


@pytest.mark.fault
async def test_the_spend_of_requests_whose_limiters_died_is_settled_by_another(
    own_procs: Procs, model: str
) -> None:
    """Six requests admitted by two limiters, both killed (-9) while the requests stream:
    the workers' usage reports reach no limiter that held them. The stream keeps them
    (TOKENBUS_SPEND_REPORTS) and a limiter started afterwards settles each once: the key's
    spend is exactly what the six cost, nothing is left held, and the reports are gone."""
    procs = own_procs
    async with key_store(procs.url) as store:
        key, rec = await store.create("orphans", budget_usd=1.0)
    env = {
        **ENV,
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "route"]',
        # How long the dead limiters' reports are left to them (5 s by default).
        "TOKENBUS_RATELIMIT__OWNER_GRACE_S": "1",
    }
    slow = ("--sim-prefill-ms", "5", "--sim-decode-ms", "150")
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "auth",
        "ratelimit",
        "ratelimit",
        "router",
        worker_args=slow,
        bridge=False,
        env=env,
    )
    n, tokens = 6, 8  # $0.008 a request (prompts are free)
    async with await Client.connect(procs.url, api_key=key) as tb:
        streams = [
            tb.chat(model, MSG, max_tokens=tokens, ignore_eos=True, request_id=f"orphan-{i}")
            for i in range(n)
        ]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        assert all(c.text for c in firsts)
        for p in stack.roles["ratelimit"]:  # every request admitted: its limiter dies
            p.signal(signal.SIGKILL)
        rest = await asyncio.gather(*(s.collect() for s in streams))
    assert all(r.usage is not None and r.usage.completion_tokens == tokens for r in rest)
    budget = budgets.Budget(f"k.{rec.id}", rec.budget_period, None, None)
    nc = await nats.connect(procs.url)
    try:
        book = await budgets.SpendBook(nc).open()
        assert (await book.spent(budget))[0] == 0  # nobody settled them yet
        js = nc.jetstream()
        info = await js.stream_info(subjects.SPEND_STREAM)
        assert info.state.messages >= n  # kept for a limiter to settle
        kept = await js.get_msg(subjects.SPEND_STREAM, seq=info.state.first_seq)
        procs.start("ratelimit-late", "serve", "ratelimit", env=env)
        await _settled(procs.url, budget)
        assert (await book.spent(budget)) == (n * tokens * 1000, 0)
        await _drained(js)
        # A report settled once charges nothing again, whoever settles it (a redelivery).
        await nc.publish(kept.subject, kept.data)
        await _drained(js, at_least=info.state.last_seq + 1)
        assert (await book.spent(budget)) == (n * tokens * 1000, 0)
    finally:
        await nc.drain()


async def _drained(js: Any, at_least: int = 0, timeout: float = 20) -> None:
    """Until the spend reports' stream is empty (every report settled and acknowledged),
    having taken in the report of sequence ``at_least`` at least."""
    deadline = time.monotonic() + timeout
    while True:
        state = (await js.stream_info(subjects.SPEND_STREAM)).state
        if state.messages == 0 and state.last_seq >= at_least:
            return
        assert time.monotonic() < deadline, f"{state.messages} reports left unsettled"
        await asyncio.sleep(0.05)


@pytest.mark.bus
async def test_many_requests_of_one_owner_commit_together_and_refuse_exactly_at_the_limit(
    nats_server: Any,
) -> None:
    """128 requests at once on one owner's entry in one limiter, and 32 in a second: the
    first limiter's changes go as groups (far fewer writes than changes, where each used to
    race the others for the revision and give up after 100 tries), the hard limit still
    refuses exactly, and every hold is settled once."""
    ncs = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        books = [await budgets.SpendBook(nc).open() for nc in ncs]
        owner = budgets.Budget(f"o.group{time.time_ns()}", "day", 100 * 1000, None)
        writes = 0
        real_cas = budgets.buckets.cas

        async def counting(*a: Any, **kw: Any) -> Any:
            nonlocal writes
            writes += 1
            return await real_cas(*a, **kw)

        budgets.buckets.cas = counting  # type: ignore[assignment]
        try:

            async def request(book: budgets.SpendBook, i: int) -> bool:
                try:
                    hold = await book.reserve([owner], f"g{i}", 1000, time.time() + 60)
                except Exception as exc:
                    assert getattr(exc, "code", "") == "insufficient_quota", exc
                    return False
                await book.settle(hold, 600)
                return True

            served = await asyncio.gather(
                *(request(books[0], i) for i in range(128)),
                *(request(books[1], 1000 + i) for i in range(32)),
            )
        finally:
            budgets.buckets.cas = real_cas  # type: ignore[assignment]
        spent, held = await books[0].spent(owner)
    finally:
        for nc in ncs:
            await nc.close()
    # 1000 held each against a hard 100 000: at most 100 in flight at once, and as each
    # settles at 600 the rest fit; every one served was charged once, none is held.
    assert held == 0
    assert spent == 600 * sum(served)
    assert sum(served) >= 100
    # 2 changes (hold, settle) per request: far fewer writes when grouped.
    assert writes < 2 * len(served) // 2, (writes, len(served))


@pytest.mark.bus
async def test_a_moved_attempt_costs_what_its_worker_produced_whichever_report_comes_first(
    nats_server: Any,
) -> None:
    """A request moved to another replica mid-answer: its first attempt's hold is settled by
    the first worker's own report (prompt and all it generated) and by the next attempt's
    admission (what the caller says it got, no prompt: the next attempt pays that). In either
    order the attempt costs what its worker produced: the caller's word is a price only
    while no report came (its worker died), and never lowers one (issue 64: a second
    attempt claiming ``resume.tokens: 0`` made the first answer free)."""
    nc = await nats.connect(nats_server.url)
    try:
        book = await budgets.SpendBook(nc).open()
        key = budgets.Budget(f"k.moved{time.time_ns()}", "day", None, None)

        async def attempt(name: str) -> Any:
            """A report's view of the attempt's hold: a fresh one for each report."""
            hold = await book.reserve([key], name, 500, time.time() + 60)
            return lambda: budgets.Hold(name, 0, list(hold.budgets))

        # Worker first: charged 130 (prompt 100 + 30 generated); superseded by a caller
        # claiming 20: the 30 produced, not the 20 claimed.
        report = await attempt("r1#0")
        await book.settle(report(), 130, produced=30)
        assert (await book.spent(key)) == (130, 0)
        await book.settle(report(), 20, superseding=True)
        assert (await book.spent(key)) == (30, 0)
        # The copies from the stream (both) charge nothing again.
        await book.settle(report(), 130, produced=30)
        await book.settle(report(), 20, superseding=True)
        assert (await book.spent(key)) == (30, 0)
        # Superseded first by a caller claiming it got nothing: $0 for now, then the
        # worker's report corrects it to what was produced; its copy changes nothing.
        report = await attempt("r2#0")
        await book.settle(report(), 0, superseding=True)
        assert (await book.spent(key)) == (30, 0)
        await book.settle(report(), 130, produced=30)
        assert (await book.spent(key)) == (60, 0)
        await book.settle(report(), 130, produced=30)
        await book.settle(report(), 0, superseding=True)
        assert (await book.spent(key)) == (60, 0)
        # Another limiter's book (the one that charged it died, or was cut off) corrects it
        # too: what the report charged is noted beside the entry, not in a book's memory.
        # Once: the supersede's copy from the stream, settled by a third, changes nothing.
        other, third = budgets.SpendBook(nc), budgets.SpendBook(nc)
        await other.open()
        await third.open()
        report = await attempt("r3#0")
        await book.settle(report(), 130, produced=30)
        await other.settle(report(), 20, superseding=True)
        await third.settle(report(), 130, produced=30)
        await third.settle(report(), 20, superseding=True)
        assert (await book.spent(key)) == (90, 0)
        # Superseded first by one book, then both copies settled by others: 30 once.
        report = await attempt("r4#0")
        await other.settle(report(), 20, superseding=True)
        await third.settle(report(), 130, produced=30)
        await book.settle(report(), 20, superseding=True)
        await book.settle(report(), 130, produced=30)
        assert (await book.spent(key)) == (120, 0)
        # A worker that died reports nothing: the caller's word is all there is (the next
        # attempt resumes from it, so a lower claim is paid again there).
        report = await attempt("r5#0")
        await book.settle(report(), 20, superseding=True)
        assert (await book.spent(key)) == (140, 0)
    finally:
        await nc.close()


@pytest.mark.bus
async def test_an_attempt_admitted_again_holds_once_and_its_read_copy_settles_it(
    nats_server: Any,
) -> None:
    """A caller that sent an attempt again (no accept came) has it admitted again: the hold
    is written again under the same name, not a second one (a copy whose limiter died before
    it left never runs: a hold of its own would stay until the request's deadline). The copy
    the caller reads settles it; the one it cancelled as a duplicate reports no spend."""
    nc = await nats.connect(nats_server.url)
    try:
        book = await budgets.SpendBook(nc).open()
        key = budgets.Budget(f"k.again{time.time_ns()}", "day", None, None)
        one = await book.reserve([key], "r1#0", 100, time.time() + 60)
        two = await book.reserve([key], "r1#0", 120, time.time() + 60)
        assert one.request_id == two.request_id == "r1#0"
        assert (await book.spent(key)) == (0, 120)
        await book.settle(budgets.Hold("r1#0", 0, list(two.budgets)), 71)
        assert (await book.spent(key)) == (71, 0)
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_duplicate_leaves_a_shared_hold_to_its_read_copy_and_settles_its_own(
    nats_server: Any,
) -> None:
    """The report of a copy its caller cancelled unread (``duplicate``): where another
    admission under the same id shares its hold, it leaves the hold to that copy (once per
    replica: a redelivered report counts nothing again), which then settles it; where the
    hold is its own (ingress gives every admission an id of its own, so a NATS client's
    resend has two holds), it settles it at what it ran. Before, such a copy reported no
    spend at all, and its own hold was left until the request's deadline (the nemesis run's
    "holds of answered requests left", seed 11)."""
    nc = await nats.connect(nats_server.url)
    try:
        book = await budgets.SpendBook(nc).open()
        key = budgets.Budget(f"k.dup{time.time_ns()}", "day", None, None)
        await book.reserve([key], "r1#0", 100, time.time() + 60)
        two = await book.reserve([key], "r1#0", 120, time.time() + 60)
        copy = list(two.budgets)
        for _ in range(2):  # the same report twice (redelivered)
            await book.settle(budgets.Hold("r1#0", 0, list(copy)), 30, duplicate="w-1")
            book._settled.clear()  # as another limiter would take it
            assert (await book.spent(key)) == (0, 120)
        await book.settle(budgets.Hold("r1#0", 0, list(copy)), 71)
        assert (await book.spent(key)) == (71, 0)
        # A copy alone with its hold: settled at its price, nothing left held.
        own = await book.reserve([key], "r2#0", 90, time.time() + 60)
        await book.settle(own, 25, duplicate="w-2")
        assert (await book.spent(key)) == (96, 0)
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_copy_run_unread_under_the_same_admission_leaves_the_charge_to_the_read_one(
    nc: Any,
) -> None:
    """One admission, one hold, two runs: a router that got no acknowledgement in time sends
    the same request to another replica, and the first runs it after all, unread (the
    nemesis run's undercharge, seed 4805, a node partitioned: docs/nemesis.md finding 16).
    Whichever report comes first settles the hold; the read copy's after a duplicate's
    corrects the charge to its own price, through the same book or another, and its copies
    redelivered change nothing; a duplicate's after the read copy's changes nothing. Without
    the correction the duplicate charged 5 and the answer's 72 was dropped as settled."""
    a, b = budgets.SpendBook(nc), budgets.SpendBook(nc)
    await a.open()
    await b.open()
    key = budgets.Budget(f"k.unread{time.time_ns()}", "day", None, None)
    entry = key.entry(time.time())

    def hold(rid: str) -> budgets.Hold:
        return budgets.Hold(rid, 0, [(key, entry)])

    # The duplicate's report first, then the read copy's: through the same book, then
    # each again through the other (the stream's copies).
    await a.reserve([key], "r1#0", 100, time.time() + 60)
    await a.settle(hold("r1#0"), 5, produced=0, duplicate="w-1")
    assert (await a.spent(key)) == (5, 0)
    for book in (a, b, a, b):
        await book.settle(hold("r1#0"), 72, produced=64)
        assert (await a.spent(key)) == (72, 0)
        await book.settle(hold("r1#0"), 5, produced=0, duplicate="w-1")
        assert (await a.spent(key)) == (72, 0)
    # The read copy's report first: the duplicate's neither adds nor takes anything.
    await a.reserve([key], "r2#0", 100, time.time() + 60)
    await a.settle(hold("r2#0"), 72, produced=64)
    for book in (a, b):
        await book.settle(hold("r2#0"), 5, produced=0, duplicate="w-1")
        assert (await a.spent(key)) == (144, 0)
    # A duplicate that ran longer than the answer it shadowed: never charged less.
    await a.reserve([key], "r3#0", 100, time.time() + 60)
    await a.settle(hold("r3#0"), 90, produced=82, duplicate="w-1")
    await b.settle(hold("r3#0"), 40, produced=32)
    assert (await a.spent(key)) == (234, 0)
    # The read copy's worker died instead: its caller moved the stream, and the move's
    # supersede replaces the duplicate's charge by what the caller got (counted by the
    # gateway: the price), not by what the duplicate produced.
    await a.reserve([key], "r4#0", 100, time.time() + 60)
    await a.settle(hold("r4#0"), 5, produced=0, duplicate="w-1")
    await b.settle(hold("r4#0"), 30, superseding=True, counted=True)
    assert (await a.spent(key)) == (264, 0)


@pytest.mark.bus
async def test_a_dispatch_not_acknowledged_in_time_is_cancelled_as_a_duplicate(
    nc: Any,
) -> None:
    """The router gives up on a replica that did not acknowledge in time and sends the
    request to another under the same admission: its cancel to the first says ``dup``, so
    a copy that starts there after all reports as one its caller never read, and leaves the
    charge to the copy that answers."""
    from router.dispatch import Dispatcher
    from router.registry import Registry
    from services.config import RouterSettings

    reg = Registry()
    for name, load in (("slow", 0), ("quick", 2)):
        hb = {"replica": name, "model": "m", "in_flight": load, "max_concurrency": 4}
        reg.update({**hb, "interval_s": 5.0, "seq": 1, "boot": name})
    cancels: list[dict[str, Any]] = []

    async def quick(msg: Any) -> None:
        await msg.respond(codec.encode({"ok": True, "in_flight": 3}))

    async def cancelled(msg: Any) -> None:
        cancels.append(codec.decode_map(msg.data))

    async def silent(msg: Any) -> None:
        return None  # the dispatch arrives, no acknowledgement goes back

    by_name = {r.replica: r for r in reg.live("m")}
    await nc.subscribe(by_name["slow"].subject, cb=silent)
    await nc.subscribe(by_name["quick"].subject, cb=quick)
    await nc.subscribe(subjects.worker_cancel("slow"), cb=cancelled)
    await nc.flush()
    d = Dispatcher(nc, reg, RouterSettings(dispatch_timeout_s=0.2))
    reply = nc.new_inbox()
    hdrs = {H.REQUEST_ID: "r1"}
    assert await d.dispatch("m", codec.encode({"model": "m"}), hdrs, reply) == "quick"
    await wait_for(lambda: bool(cancels), what="the cancel to the replica given up on")
    assert cancels == [{"type": "cancel", "request_id": "r1", "reply": reply, "dup": True}]


class _ReplicaBehind(KeyValue):
    """The bucket as a client sees it when its read of ``key`` is answered, once, by a replica
    behind the stream's leader: that read gives ``stale``, an entry from before the latest
    write. A bucket's reads are direct gets, which any replica answers: one cut off from its
    cluster or catching up answers so. One nats-server cannot be made to answer late on cue,
    so this read alone is played; the writes and the leader's own reads are the server's."""

    def __init__(self, kv: KeyValue, key: str, stale: KeyValue.Entry) -> None:
        super().__init__(kv._name, kv._stream, kv._pre, kv._js, kv._direct)
        self.key, self.stale = key, stale
        self.served_stale = 0

    async def get(
        self, key: str, revision: int | None = None, validate_keys: bool = True
    ) -> KeyValue.Entry:
        if key == self.key and not self.served_stale:
            self.served_stale += 1
            return self.stale
        return await super().get(key, revision, validate_keys)


@pytest.mark.bus
async def test_a_report_read_on_an_entry_from_before_its_hold_is_still_charged(
    nats_server: Any,
) -> None:
    """A limiter settles a report on the key's entry as read; the read was answered by a
    replica behind the leader, from before the request's hold was written. The hold is not
    there: "settled already", and the report was acknowledged with nothing charged (the
    nemesis run's undercharge by one answer, seed 4805, a node partitioned: docs/nemesis.md
    finding 16). A refusal decided on a read stands only where the stream's leader holds the
    same revision; here it does not, so the charge is decided again on the entry as it is."""
    nc = await nats.connect(nats_server.url)
    try:
        a, b = budgets.SpendBook(nc), budgets.SpendBook(nc)
        await a.open()
        await b.open()
        key = budgets.Budget(f"k.behind{time.time_ns()}", "day", None, None)
        entry = key.entry(time.time())
        first = await a.reserve([key], "r0#0", 10, time.time() + 60)
        await a.settle(first, 5)
        stale = await a._kv().get(entry)  # the entry before the next hold
        await b.reserve([key], "r1#0", 100, time.time() + 60)  # another limiter admits
        behind = _ReplicaBehind(a._kv(), entry, stale)
        a.kv = behind
        await a.settle(budgets.Hold("r1#0", 0, [(key, entry)]), 71)
        assert behind.served_stale == 1  # the stale read was made, and did not decide
        assert (await b.spent(key)) == (76, 0)
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_book_that_wrote_an_entry_before_settles_a_hold_another_made_since(
    nats_server: Any,
) -> None:
    """A limiter remembers the entries it wrote last (its next write skips the read). A
    hold another limiter made since is not in that memory: settling it there (the other
    limiter died, and this one takes its report from the stream) must read the entry, not
    decide "nothing held" on the memory: the request was charged nothing (the nemesis run's
    undercharge by one request's cost). Nor is a request refused for holds that another
    limiter settled since."""
    nc = await nats.connect(nats_server.url)
    try:
        a, b = budgets.SpendBook(nc), budgets.SpendBook(nc)
        await a.open()
        await b.open()
        key = budgets.Budget(f"k.stale{time.time_ns()}", "day", 1000, None)
        first = await a.reserve([key], "r1#0", 600, time.time() + 60)  # a remembers this
        await b.settle(budgets.Hold("r1#0", 0, list(first.budgets)), 100)  # b, since
        later = await b.reserve([key], "r2#0", 200, time.time() + 60)  # b's hold
        await a.settle(budgets.Hold("r2#0", 0, list(later.budgets)), 150)  # b's, by a
        assert (await a.spent(key)) == (250, 0)
        b_mem = await b.reserve([key], "r3#0", 100, time.time() + 60)  # b remembers this
        await a.settle(b_mem, 10)
        # On b's memory 100 is held and 250 spent: 700 more would pass the budget of
        # 1000; in the entry 260 is spent and nothing held.
        fourth = await b.reserve([key], "r4#0", 700, time.time() + 60)
        await b.settle(fourth, 50)
        assert (await a.spent(key)) == (310, 0)
    finally:
        await nc.close()


async def _check(nc: Any, owner: str) -> RateLimitCheck:
    """The ratelimit stage's check of limiter ``owner``, with a spend book; 1 µ$ a token."""
    return RateLimitCheck(
        await Limiter(nc, owner=owner).open(),
        fail_open=False,
        log=structlog.get_logger(),
        spend=await budgets.SpendBook(nc).open(),
        prices=lambda model: PriceSettings(input=1, output=1),
    )


@pytest.mark.bus
async def test_a_report_kept_for_another_limiter_is_left_to_it_for_a_grace(
    private_nats: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spend stream keeps every worker report until a limiter settles it; one that names
    another limiter is left to that limiter (which heard it directly, and whose book alone
    can correct a moved attempt's charge) for ``SPEND_OWNER_GRACE_S``, then settled here:
    the report of a limiter that died is still charged."""
    monkeypatch.setattr(ratelimit, "SPEND_OWNER_GRACE_S", 1.5)
    nc = await nats.connect(private_nats.url)
    here: RateLimitCheck | None = None
    try:
        book = await budgets.SpendBook(nc).open()
        key = budgets.Budget(f"k.grace{time.time_ns()}", "day", None, None)
        hold = await book.reserve([key], "rgrace#0", 500, time.time() + 60)
        here = await _check(nc, "here")
        await here.start(nc)
        await wait_for(lambda: here._spend_pull is not None, what="the stream's consumer")
        report = {
            "principal": "p",
            "request_id": "rgrace",
            "attempt": 0,
            "prompt": 100,
            "completion": 30,
            "spend": ratelimit.spend_header("m", hold),
        }
        sent = time.monotonic()
        # To a limiter that is gone: only the stream has it.
        await nc.jetstream().publish(subjects.usage_spend("gone"), codec.encode(report))

        async def charged() -> bool:
            return await book.spent(key) == (130, 0)

        await wait_for(charged, timeout=30, interval=0.05, what="the report settled")
        assert time.monotonic() - sent >= 1.5  # not before its owner's grace
    finally:
        if here is not None:
            await here.stop()
        await nc.close()


@pytest.mark.bus
async def test_a_supersede_waits_for_the_spend_stream_and_is_kept_once(
    private_nats: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration's supersede settles what the caller got from the attempt it moved from;
    when that attempt's worker died, nothing else ever charges it. It is kept by the spend
    stream as a worker's report is: tried again (same message id) while the stream does
    not answer, so one published while the stream had no leader is not lost, and a repeat
    is dropped."""
    nc = await nats.connect(private_nats.url)
    here: RateLimitCheck | None = None
    try:
        js = nc.jetstream()
        here = await _check(nc, "here")
        await here.start(nc)
        await wait_for(lambda: here._spend_pull is not None, what="the stream's consumer")
        await here.stop()  # nobody settles: what the stream keeps is read below
        await js.delete_stream(subjects.SPEND_STREAM)  # as a stream without a leader
        tries: list[str] = []  # each publish tried (the real one, counted)
        publish = JetStreamContext.publish

        async def counted(self: Any, subject: str, *args: Any, **kwargs: Any) -> Any:
            tries.append(subject)
            return await publish(self, subject, *args, **kwargs)

        monkeypatch.setattr(JetStreamContext, "publish", counted)
        prior = ratelimit.Ticket(0, 0, "", "gone", 0, int(time.time()) + 60, "")
        hdrs = {H.BUDGET: budgets.header("day", 10.0, None, ""), H.MODEL: "m"}
        env = {"resume": {"text": "a b c", "tokens": 3, "since": 1}}
        for _ in range(2):  # the caller's admission tried twice: one supersede kept
            await here._supersede(prior, "p", "rkept", env, hdrs)
        # Refused while no stream answers, and tried again.
        await wait_for(lambda: len(tries) >= 4, timeout=30, what="the supersedes tried again")
        await js.add_stream(ratelimit.spend_stream_config())

        async def kept() -> bool:
            with contextlib.suppress(Exception):
                return (await js.stream_info(subjects.SPEND_STREAM)).state.messages >= 1
            return False

        await wait_for(kept, timeout=30, interval=0.1, what="the supersede kept")
        if here._settling:  # the second try, dropped by the stream as a repeat
            await asyncio.wait(here._settling, timeout=30)
        assert (await js.stream_info(subjects.SPEND_STREAM)).state.messages == 1
        msg = await js.get_msg(subjects.SPEND_STREAM, seq=1)
        body = codec.decode_map(msg.data)
        assert msg.subject == subjects.usage_spend("gone")
        assert body["resumed"] == 2 and body["attempt"] == 0 and "spend" in body
    finally:
        await nc.close()


def _admission(principal: str, rid: str, attempt: int = 0, ticket: str = "") -> dict[str, str]:
    """The headers auth hands the ratelimit stage for one attempt of a key with limits and a
    day's budget of $10."""
    hdrs = {
        H.PRINCIPAL: principal,
        H.LIMITS: "1000,1000000,50",
        H.BUDGET: budgets.header("day", 10.0, None, ""),
        H.MODEL: "m",
        H.REQUEST_ID: rid,
        H.DEADLINE: str(int((time.time() + 60) * 1000)),
    }
    if attempt:
        hdrs[H.MIGRATION] = str(attempt)
        hdrs[H.ADMISSION] = ticket
    return hdrs


@pytest.mark.bus
async def test_a_move_whose_ticket_an_earlier_try_claimed_still_charges_what_the_caller_got(
    private_nats: Any,
) -> None:
    """Finding 16 (docs/nemesis.md): a move's first try claimed its ticket and then failed
    (its admission stalled past the caller's wait, or refused in a partition); the caller's
    next try of the same move found the ticket used. It is a new request, as any replay is,
    but it still supersedes the attempt the ticket names: before, nothing ever charged what
    the caller got from an attempt whose worker died (its hold ran out)."""
    nc = await nats.connect(private_nats.url)
    here: RateLimitCheck | None = None
    try:
        here = await _check(nc, "here")
        await here.start(nc)
        await wait_for(lambda: here._spend_pull is not None, what="the stream's consumer")
        principal = f"p{time.time_ns()}"
        env: dict[str, Any] = {"model": "m", "messages": MSG, "params": {"max_tokens": 20}}
        first = _admission(principal, "rmoved")
        await here.apply(first, dict(env, request_id="rmoved"))
        ticket = first[H.ADMISSION]
        key = budgets.Budget(f"k.{principal}", "day", None, None)
        assert (await here.spend.spent(key))[0] == 0  # held, not spent
        # The move's first try: it claimed the ticket, then its admission failed.
        t = ratelimit.read_ticket(here.limiter.secret, ticket, principal, time.time())
        assert t is not None and await here.limiter.claim(t.sig)
        again = _admission(principal, "rmoved", 1, ticket)
        resume = {"text": "a b c d e", "tokens": 5, "since": 0}
        await here.apply(again, dict(env, request_id="rmoved", resume=resume))
        # A replay: a request of its own, never the id it names ...
        assert again[H.REQUEST_ID] != "rmoved"

        # ... and the attempt it moved from charged the 5 tokens the caller got (1 µ$ each).
        async def charged() -> bool:
            return (await here.spend.spent(key))[0] == 5

        await wait_for(charged, timeout=30, interval=0.1, what="the moved attempt charged")
        # Once: the same move tried a third time changes nothing.
        third = _admission(principal, "rmoved", 1, ticket)
        await here.apply(third, dict(env, request_id="rmoved", resume=resume))
        if here._settling:
            await asyncio.wait(here._settling, timeout=30)
        assert (await here.spend.spent(key))[0] == 5
    finally:
        if here is not None:
            await here.stop()
        await nc.close()


@pytest.mark.bus
async def test_a_supersede_reads_its_budgets_again_when_the_book_does_not_answer(
    private_nats: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supersede's budgets (the key's and its owner's) are read from the spend book; a read
    that failed for a moment (a node partitioned) sent the supersede without its spend, and
    what the caller got from the moved attempt was never charged. The read is tried again,
    off the admission's path, until the book answers."""
    nc = await nats.connect(private_nats.url)
    here: RateLimitCheck | None = None
    try:
        here = await _check(nc, "here")
        await here.start(nc)
        book = here.spend
        assert book is not None
        principal = f"p{time.time_ns()}"
        key = budgets.Budget(f"k.{principal}", "day", None, None)
        await book.reserve([key], ratelimit.hold_key("rflaky", 0), 40, time.time() + 60)
        real, failures = book.owner_budget, [3]

        async def flaky(owner: str) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise RuntimeError("nats: no response from stream")
            return await real(owner)

        monkeypatch.setattr(book, "owner_budget", flaky)
        prior = ratelimit.Ticket(0, 0, "", "here", 0, int(time.time()) + 60, "", "rflaky")
        hdrs = _admission(principal, "rflaky")
        env = {"resume": {"text": "a b c", "tokens": 3, "since": 1}}
        await here._supersede(prior, principal, "rflaky", env, hdrs)

        async def charged() -> bool:
            return (await book.spent(key))[0] == 2

        await wait_for(charged, timeout=30, interval=0.1, what="the supersede charged")
        assert failures == [0]
    finally:
        if here is not None:
            await here.stop()
        await nc.close()


@pytest.mark.stack
async def test_a_budget_for_a_model_without_a_price_is_said_not_silently_free(
    procs: Procs, model: str
) -> None:
    """Budgets exist, the model has no price: its requests count $0, and the stage that
    holds budgets says so in its log (once a minute) and counts them."""
    async with key_store(procs.url) as store:
        key, _ = await store.create("unpriced", budget_usd=0.001)
    env = {k: v for k, v in ENV.items() if k != "TOKENBUS_ROUTER__PRICE"}
    stack = await start_stack(procs, model, "auth", env=env)
    await _started(procs)
    for _ in range(3):  # past the budget if it counted anything: never refused
        assert (await _post(stack.base, key, model)).status_code == 200
    said = [
        json.loads(line)
        for line in stack.bridge.output().splitlines()
        if "budget_without_price" in line
    ]
    assert len(said) == 1 and said[0]["model"] == model, said
    assert "TOKENBUS_ROUTER__PRICE" in said[0]["hint"]


@pytest.mark.bus
async def test_a_copy_its_caller_cancelled_unread_says_so_in_its_report(
    nats_server: Any, model: str, client: Any
) -> None:
    """A caller that sent a request to another replica (no accept came in time) cancels the
    first copy if it starts after all, as a duplicate: that copy's usage report says so
    (``dup``: its replica), so a hold it shares with the copy the caller reads is left to
    that copy (the report of the cancelled copy once settled the shared hold, and the
    answering copy's report was charged nothing: the nemesis run's undercharge by a whole
    request, seed 13), and a hold of its own is settled, not left to its deadline. A plain
    cancel (the caller left) reports as ever."""
    from tests.test_bus import MSG, stack

    hold = budgets.Hold("rdup#0", 0, [(budgets.Budget("k.x", "day", None, None), "k.x.d")])
    hdrs = {H.RATELIMIT: "0,40,w,lim", H.SPEND: ratelimit.spend_header("m", hold)}
    async with stack(nats_server.url, model, workers=1) as svcs:
        w = svcs["workers"][0]
        finish = w.runner.finish
        ended: list[Any] = []

        async def spy(gen: Any) -> None:
            await finish(gen)
            ended.append(gen)

        w.runner.finish = spy  # type: ignore[method-assign]
        for dup in (True, False):
            ended.clear()
            stream = client.chat(model, MSG, max_tokens=100_000)
            async for _ in stream:
                break
            (key,) = list(w._active)
            body: dict[str, Any] = {"type": "cancel", "request_id": "rdup", "reply": key}
            if dup:
                body["dup"] = True
            await client.nc.publish(subjects.worker_cancel(w.replica), codec.encode(body))
            await wait_for(lambda: bool(ended), what="the copy cancelled")
            await stream.aclose()
            (gen,) = ended
            assert gen.duplicate is dup
            gen.headers = dict(hdrs)  # as a limiter admitted it, with a hold
            subject, data = w.accounting.report_of(gen) or ("", b"")
            body = codec.decode_map(data)
            assert "spend" in body and subject == subjects.usage_spend("lim")
            assert body.get("dup") == (w.replica if dup else None)


@pytest.mark.fault
async def test_a_background_response_whose_runner_died_is_paid_for_once(
    own_procs: Procs, model: str
) -> None:
    """A background response runs in a bridge killed (-9) mid-answer; another bridge's
    runner runs it again from the start. The key pays for the answer it gets once: the
    rerun sends the lost run's admission (kept in the response's record), and its limiter
    charges that attempt nothing, whether the lost run's worker reported first or not."""
    procs = own_procs
    async with key_store(procs.url) as store:
        key, rec = await store.create("rerun", budget_usd=1.0, rpm=10_000)
    env = {**ENV, "TOKENBUS_BATCHES__ACK_WAIT_S": "2"}
    await start_stack(
        procs,
        model,
        "ingress",
        "auth",
        "ratelimit",
        "router",
        worker_args=("--sim-prefill-ms", "5", "--sim-decode-ms", "40"),
        bridge=False,
        env=env,
    )
    ports = free_port(), free_port()
    first = procs.start("bridge-a", "serve", "bridge", "--port", str(ports[0]), env=env)
    await wait_http(f"http://127.0.0.1:{ports[0]}/ready")
    body = {
        "model": model,
        "input": "a long story",
        "background": True,
        "max_output_tokens": 80,
        "ignore_eos": True,
    }
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", timeout=30) as h:
        r = await h.post("/v1/responses", json=body, headers=auth)
        assert r.status_code == 200, r.text
    rid = r.json()["id"]
    nc = await nats.connect(procs.url)
    try:
        kv = await nc.jetstream().key_value("tokenbus_responses")

        async def admitted() -> bool:
            run = json.loads((await kv.get(rid)).value).get("run") or {}
            return bool(run.get("ticket"))

        # The only runner (bridge-a) runs it: its admission is kept, and some of it is paid.
        await wait_for(admitted, what="the run's admission kept in the record")
        budget = budgets.Budget(f"k.{rec.id}", rec.budget_period, None, None)
        book = await budgets.SpendBook(nc).open()
        js = nc.jetstream()

        async def answering() -> bool:
            # Its events as the runner publishes them: a few of the answer's deltas.
            subject = subjects.batch_events(rid)
            info = await js.stream_info(EVENTS_STREAM, subjects_filter=subject)
            return sum((info.state.subjects or {}).values()) >= 10

        await wait_for(answering, what="the first run's answer under way")
        first.signal(signal.SIGKILL)
        second = procs.start("bridge-b", "serve", "bridge", "--port", str(ports[1]), env=env)
        await wait_http(f"http://127.0.0.1:{ports[1]}/ready")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[1]}", timeout=30) as h:

            async def ended() -> bool:
                got = (await h.get(f"/v1/responses/{rid}", headers=auth)).json()
                return got["status"] not in ("queued", "in_progress")

            await wait_for(ended, timeout=90, what="the rerun's end")
            done = (await h.get(f"/v1/responses/{rid}", headers=auth)).json()
        assert done["status"] == "incomplete", done  # ended at max_output_tokens
        assert done["usage"]["output_tokens"] == 80
        # Run again (its first run was lost), with the lost run's admission.
        said = [json.loads(x) for x in second.output().splitlines() if "background_rerun" in x]
        assert said and said[0]["lost_run_admitted"] is True, second.output()[-2000:]
        await _settled(procs.url, budget, timeout=60)
        # Every report and supersede settled (those of bridge-a's own limiter, dead, are left
        # to it for the owner's grace, then settled by the ratelimit service).
        await _drained(nc.jetstream(), timeout=60)
        # Prompts are free: the answer's 80 tokens, not the lost run's as well.
        assert (await book.spent(budget)) == (80 * 1000, 0)
        assert second.alive()
    finally:
        await nc.drain()


@pytest.mark.bus
async def test_a_request_id_no_ticket_can_carry_gets_one_of_the_limiters_own(
    nats_server: Any,
) -> None:
    """A stage role that sends the ratelimit stage a request whose id a ticket cannot carry
    (``Tb-Request-Id: ,,,``, found by the NATS fuzz) has it admitted under an id the limiter
    makes, not a failed handler with a traceback."""
    nc = await nats.connect(nats_server.url)
    try:
        check = await _check(nc, f"commas{time.time_ns()}")
        hdrs = {
            H.PRINCIPAL: f"k{time.time_ns()}",
            H.LIMITS: "100,,",
            H.REQUEST_ID: ",,,",
        }
        env: dict[str, Any] = {"request_id": ",,,", "messages": [], "params": {}}
        await check.apply(hdrs, env)
        rid = hdrs[H.REQUEST_ID]
        assert rid != ",,," and "," not in rid and env["request_id"] == rid
        assert rid in hdrs[H.ADMISSION]
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_report_later_than_its_hold_still_charges_once(nats_server: Any) -> None:
    """Issue 71: a worker at a site cut off from the hub for minutes sends its report when
    the link is back, after its request's hold lapsed (deadline plus HOLD_GRACE_S). It is
    charged then, by whichever limiter settles it, and once: its copies change nothing.
    Before, a report that found no hold charged nothing (the request was free)."""
    nc = await nats.connect(nats_server.url)
    try:
        book = await budgets.SpendBook(nc).open()
        key = budgets.Budget(f"k.late{time.time_ns()}", "day", None, None)
        lapsed_at = time.time() - budgets.HOLD_GRACE_S - 1
        hold = await book.reserve([key], "late-1", 500, lapsed_at)
        assert (await book.spent(key)) == (0, 0)  # lapsed: held against nothing

        def report() -> Any:
            return budgets.Hold("late-1", 0, list(hold.budgets))

        # The limiter that admitted it is gone; others settle the report and its copies.
        other, third = budgets.SpendBook(nc), budgets.SpendBook(nc)
        await other.open()
        await third.open()
        await other.settle(report(), 130, produced=30)
        assert (await book.spent(key)) == (130, 0)
        await other.settle(report(), 130, produced=30)
        await third.settle(report(), 130, produced=30)
        assert (await book.spent(key)) == (130, 0)
        # A request of the same entry admitted and settled meanwhile keeps its own charge.
        live = await book.reserve([key], "live-1", 100, time.time() + 60)
        await book.settle(live, 40)
        assert (await book.spent(key)) == (170, 0)
        # An id whose hold lapsed, admitted again: its report settles the live hold, once
        # (the lapsed one does not make a copy of that report charge twice).
        gone = await book.reserve([key], "again-1", 500, lapsed_at)
        again = await book.reserve([key], "again-1", 100, time.time() + 60)
        await other.settle(budgets.Hold("again-1", 0, list(again.budgets)), 60)
        await third.settle(budgets.Hold("again-1", 0, list(gone.budgets)), 60)
        assert (await book.spent(key)) == (230, 0)
    finally:
        await nc.close()
