"""A site that serves its own users (issue 71, item 3): ``deploy init --site a=... --site-bridge
a`` gives site a a bridge of its own, on the site's node, which runs the stages and the router
in-process and prefers the site's replicas. Its users' requests stay at the site (what crosses
the link per request is measured), and with the link cut the site goes on serving them: keys
cached, its own replica, its usage records kept until the link is back and stored once. Real
nats-servers (a hub and two sites on the generated configs), real processes, HTTP (httpx)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from auth import budgets
from auth.store import KeyStore
from bus_schemas import subjects
from tests.support.ports import free_port
from tests.support.procs import Procs
from tests.support.waits import wait_for, wait_http
from tests.test_sites import MODEL, SITES, Bus, _all_records, _eq, _live, ask_at_site
from tokenbus.evaluation.wanlink import WanLink

pytestmark = pytest.mark.stack

PIPELINE = '["auth", "ratelimit", "filter", "route"]'


async def _ask(h: httpx.AsyncClient, base: str, key: str, rid: str) -> dict[str, Any]:
    """One chat request to the site's bridge (three tokens asked): what came back."""
    return await ask_at_site(h, base, key, rid, [{"role": "user", "content": "local?"}], 3)


async def _kv_crossing(bus: Bus, link: WanLink, url: str, admin: dict[str, Any], b0: str) -> int:
    """The bytes that came down site a's link while the hub carried 400 KB of KV event
    batches of site b's replica ``b0`` (see the caller)."""
    env = bus.site_worker_env("a", "bridge")
    at_a = await nats.connect(
        bus.url("a"), user=env["TOKENBUS_NATS_USER"], password=env["TOKENBUS_NATS_PASSWORD"]
    )
    hub = await nats.connect(url, **admin)
    try:
        marker = at_a.new_inbox()
        got: list[bytes] = []

        async def on_marker(msg: Any) -> None:
            got.append(msg.data)

        await at_a.subscribe(marker, cb=on_marker)
        await at_a.flush()

        async def marked(tag: bytes) -> bool:
            """``tag`` sent again; whether one of its copies arrived (the delivery may take
            longer than one try: any copy counts)."""
            await hub.publish(marker, tag)
            await hub.flush()
            return tag in got

        await wait_for(
            lambda: marked(b"warm"), timeout=30, interval=0.1, what="the marker's interest"
        )
        down = link.down
        for _ in range(200):
            await hub.publish(subjects.kv_events(MODEL, b0), bytes(2048))
        await wait_for(lambda: marked(b"after"), timeout=30, interval=0.1, what="the marker")
        return link.down - down
    finally:
        await hub.close()
        await at_a.close()


def _p50_ms(got: list[dict[str, Any]]) -> float:
    return round(sorted(g["s"] for g in got)[len(got) // 2] * 1000, 1)


async def _js_info(bus: Bus, site: str, role: str) -> bool:
    """Whether ``role``'s login at ``site`` gets the hub's JetStream account info (the
    link up: until it is, the site has no interest to send the request to)."""
    env = bus.site_worker_env(site, role)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(
        bus.url(site),
        user=env["TOKENBUS_NATS_USER"],
        password=env["TOKENBUS_NATS_PASSWORD"],
        error_cb=on_error,
    )
    verdict: list[bool] = []

    async def tried() -> bool:
        try:
            await nc.request("$JS.API.INFO", b"", timeout=2)
            verdict.append(True)
        except nats.errors.NoRespondersError:
            if not errors:
                return False  # the link not up yet: asked again
            verdict.append(False)  # the site's node refused the publish (its permissions)
        except nats.errors.TimeoutError:
            verdict.append(False)
        return True

    try:
        await wait_for(tried, timeout=10, interval=0.1, what="an answer or a refusal")
        return verdict[0]
    finally:
        await nc.close()


async def test_a_site_with_a_bridge_serves_its_users_locally_and_through_a_cut(
    tmp_path: Path,
) -> None:
    leaf = free_port()
    async with WanLink(leaf) as link:
        bus = Bus(
            tmp_path / "bus", ["a", "b"], leaf_port=leaf, dial={"a": link.port}, bridges=["a"]
        )
        url, admin = bus.url(), bus.admin()
        a0, b0 = SITES["a"][0], SITES["b"][0]
        # The site's bridge logs in on the site's node only: the site's folder has its login.
        assert (tmp_path / "bus" / "sites" / "a" / "roles" / "bridge.json").exists()
        assert not (tmp_path / "bus" / "sites" / "b" / "roles" / "bridge.json").exists()
        try:
            from telemetry import records

            hub = await nats.connect(url, **admin)
            try:
                await hub.jetstream().add_stream(records.stream_config())
                store = await KeyStore(hub).open(watch=False)
                key, _ = await store.create("site-a-user")
                # Keys with limits: served through the cut from the site's share of them
                # (ratelimit.cut_off_share 0.5), the share then written into the counters.
                limited, _ = await store.create(
                    "site-a-limited", rpm=10_000, tpm=10**9, max_concurrent=50
                )
                tight, _ = await store.create("site-a-tight", rpm=4)
                # A spend budget (the model priced): through the cut, held in the bridge's
                # book from half of what the budget has left, written into the store once
                # healed, and each request charged there once (its report settles it).
                budget, budget_rec = await store.create(
                    "site-a-budget", budget_usd=100.0, budget_period="total"
                )
            finally:
                await hub.close()
            # What a site may ask of the hub's JetStream: site a's bridge login its account
            # info; site b's workers (a GPU-only site) nothing but a stored body's chunks.
            assert await _js_info(bus, "a", "bridge")
            assert not await _js_info(bus, "b", "worker")
            with Procs(url, tmp_path) as procs:
                workers = {}
                for site, (replica,) in SITES.items():
                    workers[site] = procs.start(
                        f"worker-{site}",
                        *("serve", "worker", "--model", MODEL, "--replica", replica),
                        env=bus.site_worker_env(site),
                    )
                await wait_for(
                    lambda: _eq(_live(url, admin), {a0, b0}),
                    timeout=60,
                    what="both sites' replicas beating at the hub",
                )
                port = free_port()
                procs.start(
                    "bridge-a",
                    *("serve", "bridge", "--port", str(port)),
                    env=bus.site_worker_env("a", "bridge")
                    | {
                        "TOKENBUS_INGRESS__PIPELINE": PIPELINE,
                        "TOKENBUS_RATELIMIT__CUT_OFF_SHARE": "0.5",
                        "TOKENBUS_RATELIMIT__CUT_OFF_AFTER_S": "0.5",
                        "TOKENBUS_ROUTER__PRICE__INPUT": "1",
                        "TOKENBUS_ROUTER__PRICE__OUTPUT": "2",
                        # Routing on the KV index: the bridge follows its own site's
                        # replicas' events, not the other sites'.
                        "TOKENBUS_ROUTER__POLICY": "kv_aware",
                    },
                )
                base = f"http://127.0.0.1:{port}"
                await wait_http(f"{base}/ready", timeout=60)
                async with httpx.AsyncClient() as h:

                    async def served_at_a() -> bool:
                        got = await _ask(h, base, key, "warm")
                        return got["status"] == 200 and got["replica"] == a0

                    await wait_for(served_at_a, timeout=60, what="the site's bridge serving")
                    # Local: every request to the site's replica; what crossed the link.
                    before = link.up + link.down
                    local = [await _ask(h, base, key, f"local-{i}") for i in range(40)]
                    crossed = link.up + link.down - before
                    assert all(g["status"] == 200 and g["replica"] == a0 for g in local), local
                    # Another site's KV events do not cross to this one: 200 batches of 2 KB
                    # on site b's replica's subject (as its engine's would be), then a marker
                    # to a subscriber at site a (one link, in order: once it is there, what
                    # would have crossed before it has); what came down site a's link
                    # meanwhile is its heartbeats' share, not 400 KB.
                    kv_down = await _kv_crossing(bus, link, url, admin, b0)
                    assert kv_down < 40_000, kv_down
                    window = int(time.time() // 60)
                    first = [
                        await _ask(h, base, k, f"pre-{n}")
                        for n, k in (("l", limited), ("t", tight), ("b", budget))
                    ]
                    assert all(g["status"] == 200 for g in first), first
                    # The link cut: the site's users still served, by its own replica, the
                    # keys with limits from the site's share of them.
                    link.cut()
                    cut = [await _ask(h, base, key, f"cut-{i}") for i in range(30)]
                    cut += [await _ask(h, base, limited, f"cut-l{i}") for i in range(10)]
                    served = [g for g in cut if g["status"] == 200]
                    assert all(g["replica"] == a0 for g in served), served
                    # rpm 4, half of it while cut off: two more, then 429 naming the cut.
                    over = [await _ask(h, base, tight, f"cut-t{i}") for i in range(3)]
                    assert [g["status"] for g in over] == [200, 200, 429], over
                    assert "cut off" in over[2]["error"], over[2]
                    spent_cut = [await _ask(h, base, budget, f"cut-b{i}") for i in range(3)]
                    assert all(g["status"] == 200 for g in spent_cut), spent_cut
                    assert max(g["s"] for g in spent_cut) < 5  # not the store's 20 s stall
                    link.heal()
                    # Healed: once the limiter asks its store again (ratelimit's
                    # CUT_OFF_PROBE_S), the two taken while cut off count in the key's window:
                    # 1 + 2 + the next make 4, and the one after is over. Only if the minute
                    # did not turn meanwhile (a new window starts at 0).
                    after: list[dict[str, Any]] = []
                    polls = iter(range(10**6))

                    async def store_asked() -> bool:
                        got = await _ask(h, base, tight, f"healed-poll{next(polls)}")
                        if "cut off" in got["error"]:
                            return False
                        after.append(got)
                        return True

                    await wait_for(store_asked, timeout=30, interval=0.5, what="the store asked")
                    after.append(await _ask(h, base, tight, f"healed-t{len(after)}"))
                    same_window = int(time.time() // 60) == window
                    print(f"after the cut, rpm 4: {[g['status'] for g in after]}", same_window)
                    if same_window:
                        assert [g["status"] for g in after] == [200, 429], after
                        assert "rate limit reached" in after[1]["error"], after[1]
                    served_in_cut = len(served)
                    served += first + over[:2] + [g for g in after if g["status"] == 200]
                    served += spent_cut
                print(
                    json.dumps(
                        {
                            "link_bytes_per_local_request": crossed / len(local),
                            "link_bytes_down_for_400KB_of_site_b_kv_events": kv_down,
                            "served_during_cut": f"{served_in_cut}/{len(cut)}",
                            "errors": [g for g in cut if g["status"] != 200][:3],
                        }
                    )
                )
                assert served_in_cut >= 0.99 * len(cut), cut
                # Every answered request's usage records (the worker's and the bridge's)
                # reach the hub once the link is back, each stored once.
                answered = {g["rid"] for g in local + served}
                want = {(rid, src) for rid in answered for src in ("worker", "http")}

                async def mine() -> list[dict[str, Any]]:
                    recs = await _all_records(url, admin)
                    return [r for r in recs if r.get("client_request_id") in answered]

                async def every_record() -> bool:
                    got = {(r.get("client_request_id"), r.get("source")) for r in await mine()}
                    return want <= got

                await wait_for(
                    every_record,
                    timeout=60,
                    interval=0.5,
                    what="every answered request's records at the hub",
                )
                recs = await mine()
                assert len(recs) == len(want), len(recs)  # none twice
                # The budget's spend: what its answered requests cost (1 µ$ a prompt token, 2
                # a generated one), charged once, the ones served through the cut included;
                # no hold left.
                cost = sum(
                    int(r["prompt_tokens"]) + 2 * int(r["completion_tokens"])
                    for r in recs
                    if r.get("source") == "worker"
                    and str(r.get("client_request_id", ""))
                    in ("pre-b", "cut-b0", "cut-b1", "cut-b2")
                )
                print(f"the budget key: {cost} µ$ for its 4 answered requests")
                scope = budgets.Budget(f"k.{budget_rec.id}", "total", 100_000_000, None, "key")
                hub = await nats.connect(url, **admin)
                try:
                    book = await budgets.SpendBook(hub).open()

                    async def charged() -> bool:
                        return await book.spent(scope) == (cost, 0)

                    await wait_for(charged, timeout=30, interval=0.5, what="the spend settled")
                finally:
                    await hub.close()
                # The site's own replica gone: its users are served by site b's, over the link.
                workers["a"].stop()
                async with httpx.AsyncClient() as h:

                    async def served_at_b() -> bool:
                        got = await _ask(h, base, key, "spill")
                        return got["status"] == 200 and got["replica"] == b0

                    await wait_for(served_at_b, timeout=30, what="site a's users served at b")
                    # Spilled over a link with 25 ms each way (the request and its answer
                    # cross site a's link and the hub), beside the local requests above.
                    link.delay_s = 0.025
                    spilled = [await _ask(h, base, key, f"spill-{i}") for i in range(20)]
                    assert all(g["status"] == 200 and g["replica"] == b0 for g in spilled)
                print(
                    json.dumps(
                        {
                            "local_p50_ms": _p50_ms(local),
                            "spilled_p50_ms_over_25ms_each_way": _p50_ms(spilled),
                        }
                    )
                )
        finally:
            bus.stop()


async def test_a_site_bridge_killed_while_cut_off_leaves_its_counts_and_holds_to_the_next(
    tmp_path: Path,
) -> None:
    """``ratelimit.cut_off_dir``: what a site's bridge admitted while cut off (its window
    counts and spend holds) is on the site's disk until written into the hub's store. The
    bridge killed (SIGKILL) during the cut, the link healed, a new bridge started on the same
    folder takes it over: the budget is charged for every request served through the cut,
    once, and (within one minute window) the key's count includes the ones admitted locally.
    Without the folder the killed bridge's holds are lost and their requests never charged."""
    leaf = free_port()
    folder = tmp_path / "cut-off"
    async with WanLink(leaf) as link:
        bus = Bus(
            tmp_path / "bus", ["a", "b"], leaf_port=leaf, dial={"a": link.port}, bridges=["a"]
        )
        url, admin = bus.url(), bus.admin()
        a0 = SITES["a"][0]
        try:
            from telemetry import records

            hub = await nats.connect(url, **admin)
            try:
                await hub.jetstream().add_stream(records.stream_config())
                store = await KeyStore(hub).open(watch=False)
                tight, _ = await store.create("site-a-tight", rpm=4)
                budget, budget_rec = await store.create(
                    "site-a-budget", budget_usd=100.0, budget_period="total"
                )
            finally:
                await hub.close()
            with Procs(url, tmp_path) as procs:
                procs.start(
                    "worker-a",
                    *("serve", "worker", "--model", MODEL, "--replica", a0),
                    env=bus.site_worker_env("a"),
                )
                await wait_for(
                    lambda: _eq(_live(url, admin), {a0}), timeout=60, what="site a's replica"
                )
                env = bus.site_worker_env("a", "bridge") | {
                    "TOKENBUS_INGRESS__PIPELINE": PIPELINE,
                    "TOKENBUS_RATELIMIT__CUT_OFF_SHARE": "0.5",
                    "TOKENBUS_RATELIMIT__CUT_OFF_AFTER_S": "0.5",
                    "TOKENBUS_RATELIMIT__CUT_OFF_DIR": str(folder),
                    "TOKENBUS_ROUTER__PRICE__INPUT": "1",
                    "TOKENBUS_ROUTER__PRICE__OUTPUT": "2",
                }
                port = free_port()
                first = procs.start("bridge-a", *("serve", "bridge", "--port", str(port)), env=env)
                base = f"http://127.0.0.1:{port}"
                await wait_http(f"{base}/ready", timeout=60)
                async with httpx.AsyncClient() as h:

                    async def served(k: str, rid: str) -> bool:
                        return (await _ask(h, base, k, rid))["status"] == 200

                    await wait_for(
                        lambda: served(budget, "pre-b"), timeout=60, what="the bridge serving"
                    )
                    window = int(time.time() // 60)
                    assert await served(tight, "pre-t")
                    link.cut()
                    cut_b = [await _ask(h, base, budget, f"cut-b{i}") for i in range(3)]
                    assert all(g["status"] == 200 for g in cut_b), cut_b
                    assert (await _ask(h, base, tight, "cut-t0"))["status"] == 200

                    def kept() -> bool:
                        files = [json.loads(p.read_text()) for p in folder.glob("*.json")]
                        holds = {n for f in files for n in f["holds"]}
                        counts = [f["windows"] for f in files if f["windows"]]
                        return len(holds) == 3 and len(counts) == 1

                    await wait_for(kept, timeout=10, what="the cut-off state on disk")
                first.kill()
                link.heal()
                procs.start("bridge-a2", *("serve", "bridge", "--port", str(port)), env=env)
                await wait_http(f"{base}/ready", timeout=60)
                async with httpx.AsyncClient() as h:
                    after = [await _ask(h, base, tight, f"after-t{i}") for i in range(3)]
                same_window = int(time.time() // 60) == window
                print(f"rpm 4 after the restart: {[g['status'] for g in after]}", same_window)
                if same_window:
                    # 1 before the cut, 1 through it (taken over), so two more, then over.
                    assert [g["status"] for g in after] == [200, 200, 429], after
                answered = {"pre-b", "cut-b0", "cut-b1", "cut-b2"}

                async def budget_records() -> list[dict[str, Any]]:
                    recs = await _all_records(url, admin)
                    return [
                        r
                        for r in recs
                        if r.get("client_request_id") in answered and r.get("source") == "worker"
                    ]

                await wait_for(
                    lambda: _has_all(budget_records(), answered),
                    timeout=60,
                    interval=0.5,
                    what="the worker's records of the budget's requests",
                )
                cost = sum(
                    int(r["prompt_tokens"]) + 2 * int(r["completion_tokens"])
                    for r in await budget_records()
                )
                scope = budgets.Budget(f"k.{budget_rec.id}", "total", 100_000_000, None, "key")
                hub = await nats.connect(url, **admin)
                try:
                    book = await budgets.SpendBook(hub).open()
                    seen: list[tuple[int, int]] = []

                    async def charged() -> bool:
                        seen.append(await book.spent(scope))
                        return seen[-1] == (cost, 0)

                    try:
                        await wait_for(charged, timeout=30, interval=0.5, what="the spend")
                    except AssertionError:
                        raise AssertionError(f"spent {seen[-3:]}, want {(cost, 0)}") from None
                finally:
                    await hub.close()
                print(f"charged {cost} µ$ for the 4 requests, 3 of them through the cut")
                # Written into the store: nothing is left on disk.
                await wait_for(
                    lambda: not list(folder.glob("*.json")), timeout=10, what="the state kept"
                )
        finally:
            bus.stop()


async def _has_all(recs: Any, ids: set[str]) -> bool:
    return {r.get("client_request_id") for r in await recs} >= ids
