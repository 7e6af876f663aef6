"""Routing policies: each policy's choices, their composition, run-time changes over KV and
the admin API, and the expert classifier; on a real bus where requests are routed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.aio.client import Client as NATS

from auth.store import KeyStore
from engine_worker.worker import Worker
from router.expert import ExpertModel, fit, purity, read_examples, split, tokens, train
from router.policies import (
    ConcurrencyTiered,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    prompt_text,
)
from router.registry import Replica
from router.routing import ModelRoute, RoutingTable, set_override, validate_override
from services.config import ModelRouting, RouterSettings, load
from tests.support.inprocess import settings, stack
from tests.support.natsserver import NatsServer
from tests.support.procs import Procs, start_stack
from tests.support.repo import ROOT, run_cli
from tests.support.waits import wait_for
from tokenbus import Client

PROMPTS = ROOT / "tests" / "data" / "prompts.jsonl"
MSG = [{"role": "user", "content": "hi"}]


def reps(n: int, **kw: Any) -> list[Replica]:
    return [
        Replica(replica=f"r{i}", model="m", subject=f"s{i}", max_concurrency=8, **kw)
        for i in range(n)
    ]


# --- load policies -------------------------------------------------------------------------


@pytest.mark.unit
def test_round_robin_takes_each_replica_in_turn() -> None:
    rr, cands = RoundRobin(), reps(3)
    cands[0].reported_in_flight = 7  # load does not matter to it
    picks = [rr.choose(cands, RouteRequest("m")).replica for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


@pytest.mark.unit
def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    p2, cands = PowerOfTwo(), reps(2)
    cands[0].reported_in_flight = 5
    assert {p2.choose(cands, RouteRequest("m")).replica for _ in range(20)} == {"r1"}
    many = reps(8)
    for r in many:
        r.reported_in_flight = 6
    many[3].reported_in_flight = 0
    # Never the most loaded when a lighter one was drawn; the idle one wins whenever drawn.
    picks = Counter(p2.choose(many, RouteRequest("m")).replica for _ in range(400))
    assert picks["r3"] > 60


@pytest.mark.unit
def test_session_affinity_is_sticky_spread_and_bounded() -> None:
    sa, cands = SessionAffinity(bound=1.25), reps(4)
    home = {f"s{i}": sa.choose(cands, RouteRequest("m", f"s{i}")).replica for i in range(60)}
    for s, r in home.items():  # the same session always goes home
        assert sa.choose(cands, RouteRequest("m", s)).replica == r
    assert len(set(home.values())) == 4  # sessions spread over every replica
    # Home overloaded beyond 1.25x the average: the session moves on, the others stay.
    hot = home["s0"]
    for c in cands:
        c.reported_in_flight = 6 if c.replica == hot else 1
    assert sa.choose(cands, RouteRequest("m", "s0")).replica != hot
    for c in cands:
        c.reported_in_flight = 0
    # A replica leaving moves only its own sessions (consistent hashing).
    gone = "r2"
    rest = [c for c in cands if c.replica != gone]
    for s, r in home.items():
        now = sa.choose(rest, RouteRequest("m", s)).replica
        if r != gone:
            assert now == r, s
    # No session: least loaded.
    cands[1].reported_in_flight = 3
    assert sa.choose(cands, RouteRequest("m")).replica != "r1"


@pytest.mark.unit
def test_prefix_aware_prefers_the_replica_with_the_prefix_within_a_bound() -> None:
    pa, cands = PrefixAware(bound=1.5, block_chars=32), reps(3)
    by = {r.replica: r for r in cands}
    system = "You are a careful assistant for the billing team. " * 4
    first = pa.choose(cands, RouteRequest("m", prompt=system + "question one")).replica
    # The same long prefix comes back: same replica, although it is now the busiest
    # (3 in flight vs 2: within 1.5x the average).
    for r in cands:
        r.reported_in_flight = 3 if r.replica == first else 2
    again = pa.choose(cands, RouteRequest("m", prompt=system + "another question")).replica
    assert again == first
    # Too busy (8 vs 2, beyond 1.5x the average): another replica gets it and the prefix.
    by[first].reported_in_flight = 8
    moved = pa.choose(cands, RouteRequest("m", prompt=system + "a third")).replica
    assert moved != first
    by[first].reported_in_flight = 2
    assert pa.choose(cands, RouteRequest("m", prompt=system + "fourth")).replica == moved
    # A different prompt starts cold: the least loaded.
    by[moved].reported_in_flight = 4
    cold = pa.choose(cands, RouteRequest("m", prompt="x" * 200)).replica
    assert cold != moved
    # Shorter than a block: nothing to match, least loaded.
    assert pa.blocks("short") == []


@pytest.mark.unit
def test_prompt_text_reads_chat_and_completion_envelopes() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prompt_text(chat) == "system:S\nuser:U\n"
    assert prompt_text({"prompt": "P"}) == "P"


@pytest.mark.unit
def test_concurrency_tiered_switches_pools_with_hysteresis() -> None:
    t = ConcurrencyTiered(threshold=10, hysteresis=3, high_pool="big", wide_pool="small")
    cands = reps(1, pool="big") + [
        Replica(replica=f"w{i}", model="m", subject="s", pool="small") for i in range(4)
    ]

    def pools(in_flight: int) -> set[str]:
        cands[0].reported_in_flight = in_flight
        return {r.pool for r in t.select(list(cands), cands, RouteRequest("m"))}

    assert pools(0) == {"big"}
    assert pools(9) == {"big"}
    assert pools(10) == {"small"}  # at the threshold: wide
    assert pools(8) == {"small"}  # within the hysteresis: stays wide
    assert pools(6) == {"big"}  # below threshold - hysteresis: back
    only_small = cands[1:]
    assert {r.pool for r in t.select(only_small, only_small, RouteRequest("m"))} == {"small"}


@pytest.mark.unit
def test_routing_config_merges_defaults_models_and_overrides() -> None:
    s = load(router={"policy": "round_robin", "models": {"big": {"load_bound": 2.0}}})
    assert s.router.routing_for("other").policy == "round_robin"
    big = s.router.routing_for("big")
    assert big.policy == "round_robin" and big.load_bound == 2.0
    changed = s.router.routing_for("big", {"pool_policy": "concurrency_tiered"})
    assert changed.pool_policy == "concurrency_tiered" and changed.load_bound == 2.0
    with pytest.raises(ValueError, match="policy"):
        validate_override(s.router, "big", {"policy": "fastest"})
    with pytest.raises(ValueError, match="model_dir"):
        validate_override(s.router, "big", {"pool_policy": "expert"})
    with pytest.raises(ValueError):
        validate_override(s.router, "big", {"no_such_field": 1})


# --- expert classifier ---------------------------------------------------------------------


@pytest.mark.unit
def test_tokens_drop_stop_words_and_replace_numbers() -> None:
    assert tokens("What is the integral of x^2 from 0 to 12?") == ["integral"] + ["<num>"] * 3


@pytest.mark.unit
def test_expert_clusters_the_prompt_set_by_domain_and_saves_without_pickle(
    tmp_path: Path,
) -> None:
    report = train(PROMPTS, 6, tmp_path)
    assert report["held_out"] > 50
    assert report["held_out_purity"] >= 0.9, report
    assert set(report["cluster_labels"].values()) == {
        "code",
        "math",
        "cooking",
        "health",
        "law",
        "travel",
    }
    # Plain arrays and JSON: loads with pickle disabled.
    with np.load(tmp_path / "expert.npz", allow_pickle=False) as z:
        assert set(z.files) == {"idf", "components", "mean", "scale", "centroids"}
        assert all(z[k].dtype == np.float64 for k in z.files)
    meta = json.loads((tmp_path / "expert.json").read_text())
    assert meta["scaling"] == "l2" and meta["dims"] == 100 and len(meta["vocab"]) > 100
    m = ExpertModel.load(tmp_path)
    labels = m.labels()
    assert labels[m.classify("Why does my Rust code panic with an index out of range?")] == "code"
    assert labels[m.classify("Can my landlord keep the security deposit?")] == "law"
    assert labels[m.classify("How long should I bake banana bread with buttermilk?")] == "cooking"
    assert m.classify("hi") == -1  # no word it knows


@pytest.mark.unit
def test_expert_fit_rejects_bad_input_and_purity_is_computed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot make"):
        fit(["one prompt"], 3)
    with pytest.raises(ValueError, match="scaling"):
        fit(["a b", "c d"], 1, scaling="minmax")
    assert purity([0, 0, 1, 1], ["a", "a", "b", "a"]) == 0.75
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"label": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_examples(bad)
    examples = read_examples(PROMPTS)
    fit_on, held = split(examples, 0.25, 1)
    assert len(held) == 90 and not {e.prompt for e in held} & {e.prompt for e in fit_on}


@pytest.mark.stack
def test_router_train_cli_writes_the_model(tmp_path: Path) -> None:
    out = run_cli(
        "router", "train", "--data", str(PROMPTS), "--clusters", "6", "--out", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["held_out_purity"] >= 0.9
    assert report["classify_us"]["p50"] < 1000  # well under a millisecond
    assert (tmp_path / "expert.npz").exists()
    missing = run_cli("router", "train", "--data", str(tmp_path / "none.jsonl"), "--clusters", "2")
    assert missing.returncode == 1 and "error" in missing.stdout


@pytest.mark.unit
def test_expert_route_maps_clusters_to_pools_and_models(tmp_path: Path) -> None:
    train(PROMPTS, 6, tmp_path)
    spec = ModelRouting(
        pool_policy="expert",
        expert={"model_dir": str(tmp_path), "targets": {"code": "pool:coder", "math": "m-math"}},
    )
    route = ModelRoute(spec)
    assert route.needs_prompt
    code = RouteRequest("m", prompt="Write a Go function that merges two sorted arrays")
    math = RouteRequest("m", prompt="Compute the integral of x^3 - 4x from 0 to 5.")
    other = RouteRequest("m", prompt="Plan a 5-day itinerary for Kyoto in spring.")
    assert route.target(code) == ("m", "coder")
    assert route.target(math) == ("m-math", None)
    assert route.target(other) == ("m", None)


# --- on the bus ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def pooled_workers(
    url: str, model: str, pools: list[str], **over: Any
) -> AsyncIterator[list[Any]]:
    async with contextlib.AsyncExitStack() as es:
        out: list[Any] = []
        for i, pool in enumerate(pools):
            ws = settings(
                url,
                worker={
                    "model": model,
                    "replica": f"{model}-{pool}-{i}",
                    "pool": pool,
                    "heartbeat_interval_s": 0.2,
                },
                **over,
            )
            out.append(await es.enter_async_context(Worker(ws)))
        yield out


async def _served_by(c: Client, model: str, n: int, **kw: Any) -> list[str]:
    out = []
    for _ in range(n):
        s = c.chat(model, MSG, max_tokens=2, **kw)
        async for _ in s:
            pass
        assert s.replica is not None
        out.append(s.replica)
    return out


@pytest.mark.stack
async def test_policies_change_at_run_time_on_every_router(
    nats_server: NatsServer, model: str, nc: NATS, client: Client
) -> None:
    async with (
        stack(nats_server.url, model, workers=0) as svcs,
        pooled_workers(nats_server.url, model, ["a", "b", "c"]),
    ):
        await wait_for(lambda: len(svcs["router"].registry.live(model)) == 3)
        await set_override(nc, model, {"policy": "session_affinity"})
        await wait_for(lambda: model in svcs["router"].routing.overrides)
        sticky = await _served_by(client, model, 6, session="user-42")
        assert len(set(sticky)) == 1, sticky
        # The CLI changes it for every router, at once.
        env = {"TOKENBUS_NATS_URL": nats_server.url}
        out = run_cli("router", "set", model, "--policy", "round_robin", env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        await wait_for(
            lambda: svcs["router"].routing.overrides.get(model) == {"policy": "round_robin"}
        )
        spread = await _served_by(client, model, 6, session="user-42")
        assert len(set(spread)) == 3, spread
        bad = run_cli("router", "set", model, "--pool-policy", "expert", env=env)
        assert bad.returncode == 2 and "model_dir" in bad.stdout
        shown = run_cli("router", "show", "--json", env=env)
        assert json.loads(shown.stdout)[model]["policy"] == "round_robin"
        assert run_cli("router", "reset", model, env=env).returncode == 0
        await wait_for(lambda: model not in svcs["router"].routing.overrides)


@pytest.mark.bus
async def test_concurrency_tiered_uses_the_high_tp_pool_until_traffic_is_heavy(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    routing = {
        "pool_policy": "concurrency_tiered",
        "tiered": {"threshold": 3, "hysteresis": 1, "high_pool": "tp8", "wide_pool": "tp2"},
    }
    async with (
        stack(nats_server.url, model, workers=0, router=routing) as svcs,
        pooled_workers(nats_server.url, model, ["tp8", "tp2", "tp2"]),
    ):
        await wait_for(lambda: len(svcs["router"].registry.live(model)) == 3)
        light = await _served_by(client, model, 4)
        assert all("-tp8-" in r for r in light), light
        streams = [client.chat(model, MSG, max_tokens=200) for _ in range(8)]
        for s in streams:
            await s.__anext__()
        heavy = Counter("tp8" if "-tp8-" in (s.replica or "") else "tp2" for s in streams)
        assert heavy["tp8"] >= 3 and heavy["tp2"] >= 1, heavy
        for s in streams:
            await s.aclose()


@pytest.mark.bus
async def test_expert_policy_routes_prompts_to_their_pool(
    nats_server: NatsServer, model: str, tmp_path: Path, client: Client
) -> None:
    train(PROMPTS, 6, tmp_path)
    routing = {
        "pool_policy": "expert",
        "expert": {"model_dir": str(tmp_path), "targets": {"code": "pool:coder"}},
    }
    async with (
        stack(nats_server.url, model, workers=0, router=routing) as svcs,
        pooled_workers(nats_server.url, model, ["coder", "general", "general"]),
    ):
        await wait_for(lambda: len(svcs["router"].registry.live(model)) == 3)
        for _ in range(4):
            s = client.chat(
                model,
                [{"role": "user", "content": "Refactor this Python class to avoid globals"}],
                max_tokens=2,
            )
            async for _ in s:
                pass
            assert s.replica is not None and "-coder-" in s.replica
        # No word it knows: not classified, so any replica may serve it.
        others = await _served_by(client, model, 6)
        assert any("-general-" in r for r in others)


@pytest.mark.stack
async def test_http_session_header_and_admin_routing_api(
    procs: Procs, model: str, keys: KeyStore
) -> None:
    admin, _ = await keys.create("ops", admin=True)
    user, _ = await keys.create("user")
    env = {
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
        "TOKENBUS_ROUTER__POLICY": "session_affinity",
    }
    # The bridge is the only router and runs auth itself (the workers ignore both settings).
    stack = await start_stack(procs, model, workers=3, env=env, settle=0.5)
    async with stack.http(timeout=30) as h:
        await _until_every_replica_serves(h, model, 3, {"Authorization": f"Bearer {user}"})
        body = {"model": model, "messages": MSG, "max_tokens": 2}
        seen: dict[str, set[str]] = {}
        for sess in ("alice", "bob", "carol", "dave"):
            for _ in range(3):
                r = await h.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {user}", "X-Session-Id": sess},
                )
                assert r.status_code == 200, r.text
                seen.setdefault(sess, set()).add(r.headers["x-tokenbus-replica"])
        assert all(len(v) == 1 for v in seen.values()), seen
        # The routing admin API: admin keys only, validated, applied to the bridge's router.
        url = f"/v1/admin/routing/{model}"
        r = await h.put(url, json={"policy": "round_robin"}, headers={"api-key": user})
        assert r.status_code == 403
        r = await h.put(url, json={"policy": "fastest"}, headers={"api-key": admin})
        assert r.status_code == 400 and "policy" in r.json()["error"]["message"]
        r = await h.put(url, json={"policy": "round_robin"}, headers={"api-key": admin})
        assert r.status_code == 200 and r.json()["routing"]["policy"] == "round_robin"
        r = await h.get("/v1/admin/routing", headers={"api-key": admin})
        assert [m["model"] for m in r.json()["models"]] == [model]
        await _until_session_moves(h, body, {"Authorization": f"Bearer {user}"}, "alice")
        served = set()
        for _ in range(6):
            r = await h.post(
                "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {user}", "X-Session-Id": "alice"},
            )
            served.add(r.headers["x-tokenbus-replica"])
        assert len(served) == 3, served
        r = await h.delete(url, headers={"api-key": admin})
        assert r.status_code == 200 and r.json()["override"] is None


async def _until_session_moves(
    h: Any, body: dict[str, Any], headers: dict[str, str], session: str, timeout: float = 20
) -> None:
    """Until two requests of ``session`` in a row go to different replicas: the bridge's
    router has taken the routing change (from the bucket it watches) that ends affinity."""
    hdrs = {**headers, "X-Session-Id": session}
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        r = await h.post("/v1/chat/completions", json=body, headers=hdrs)
        assert r.status_code == 200, r.text
        replica = r.headers["x-tokenbus-replica"]
        if last is not None and replica != last:
            return
        last = replica
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {session!r} stayed on {last} after the routing change")


async def _until_every_replica_serves(
    h: Any, model: str, n: int, headers: dict[str, str] | None = None
) -> None:
    """Until sessions of their own have been served by all ``n`` replicas: the bridge's
    router knows every one, so a session's replica no longer changes as one joins."""
    served: set[str] = set()
    for i in range(200):
        body = {"model": model, "messages": MSG, "max_tokens": 1}
        hdrs = {**(headers or {}), "X-Session-Id": f"warm-{i}"}
        r = await h.post("/v1/chat/completions", json=body, headers=hdrs)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-tokenbus-replica"])
        if len(served) == n:
            return
    raise AssertionError(f"only {served} served")


@pytest.mark.stack
async def test_session_keys_in_the_body_pin_a_conversation(procs: Procs, model: str) -> None:
    """Chat's ``prompt_cache_key`` and the Messages API's ``metadata.user_id`` (what Codex
    and Claude Code send) key session routing as ``X-Session-Id`` does; the header wins."""
    env = {"TOKENBUS_ROUTER__POLICY": "session_affinity"}
    stack = await start_stack(procs, model, workers=3, env=env, settle=0.5)
    seen: dict[str, set[str]] = {}
    async with stack.http(timeout=30) as h:
        await _until_every_replica_serves(h, model, 3)
        # Twelve keys: all on one of three replicas by the ring's chance is 3 ** -11 (six
        # keys made it about 0.4 %, and a CI run once saw it).
        for key in [f"k{i}" for i in range(1, 13)]:
            for _ in range(3):
                chat = {"model": model, "messages": MSG, "max_tokens": 2, "prompt_cache_key": key}
                r = await h.post("/v1/chat/completions", json=chat)
                assert r.status_code == 200, r.text
                seen.setdefault(key, set()).add(r.headers["x-tokenbus-replica"])
                msg = {
                    "model": model,
                    "max_tokens": 2,
                    "messages": MSG,
                    "metadata": {"user_id": key},
                }
                r = await h.post("/v1/messages", json=msg)
                assert r.status_code == 200, r.text
                seen[key].add(r.headers["x-tokenbus-replica"])
        # The same key by either route is the same session: one replica each.
        assert all(len(v) == 1 for v in seen.values()), seen
        assert len(set().union(*seen.values())) > 1, seen
        # X-Session-Id names another session: it wins over the body's key.
        other = next(k for k in seen if seen[k] != seen["k1"])
        chat = {"model": model, "messages": MSG, "max_tokens": 2, "prompt_cache_key": "k1"}
        r = await h.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": other})
        assert {r.headers["x-tokenbus-replica"]} == seen[other]


@pytest.mark.unit
def test_routing_table_survives_a_bad_override() -> None:
    table = RoutingTable(RouterSettings())
    table.overrides["m"] = {"pool_policy": "expert"}  # no model_dir: cannot build
    assert table.route("m").spec.pool_policy == "none"
