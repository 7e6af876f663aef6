"""Exact KV-cache routing: the router's index of the replicas' caches (router/kv_index.py),
fed by their KV events on a real nats-server (router/kv_follow.py), and the ``kv_aware``
policy that routes on it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from bus_schemas import codec, subjects
from bus_schemas import kv_events as K
from bus_schemas.messages import render_prompt
from router.kv_index import KVIndex
from router.policies import KVAware, RouteRequest
from router.registry import Replica
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.waits import wait_for
from tokenbus import Client

BS = 4
SIM = {"kv_cache_blocks": 256, "block_size": BS, "prefill_ms": 1.0, "decode_ms": 1.0}
KV_ROUTER = {"policy": "kv_aware"}


def batch(
    replica: str, first: int, events: list[dict[str, Any]], boot: str = "b"
) -> dict[str, Any]:
    return {
        "type": K.BATCH,
        "replica": replica,
        "model": "m",
        "boot": boot,
        "block_size": BS,
        "seq_first": first,
        "seq_last": first + len(events) - 1,
        "ts_ms": 1,
        "events": events,
    }


def snap(replica: str, seq: int, blocks: list[tuple[int, int | None]]) -> dict[str, Any]:
    return {
        "replica": replica,
        "boot": "b",
        "block_size": BS,
        "capacity_blocks": 100,
        "seq": seq,
        "blocks": blocks,
    }


def synced(index: KVIndex, *names: str) -> None:
    for n in names:
        index.load(snap(n, 0, []))


# -- the index ------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_lookup_gives_each_replicas_exact_cached_prefix() -> None:
    idx = KVIndex()
    synced(idx, "a", "b")
    chain = K.chain_hashes(list(range(40)), BS)  # 10 blocks
    assert idx.apply(batch("a", 1, [K.stored(chain[:6], None, BS)]))
    assert idx.apply(batch("b", 1, [K.stored(chain[:3], None, BS)]))
    assert idx.lookup(chain) == {"a": 6, "b": 3}
    # a's 4th block evicted: its chain can no longer be matched past block 3
    assert idx.apply(batch("a", 2, [K.removed([chain[3]])]))
    assert idx.lookup(chain) == {"a": 3, "b": 3}
    assert idx.lookup(chain, ["b"]) == {"b": 3}
    assert idx.lookup(K.chain_hashes(list(range(100, 140)), BS)) == {}
    assert idx.apply(batch("b", 2, [K.all_cleared()]))
    assert idx.lookup(chain) == {"a": 3}
    idx.drop("a")
    assert idx.lookup(chain) == {} and idx.stats()["entries"] == 0


@pytest.mark.unit
def test_a_gap_marks_the_replica_stale_until_a_snapshot_repairs_it() -> None:
    idx = KVIndex(resync_s=0)
    synced(idx, "a")
    chain = K.chain_hashes(list(range(20)), BS)
    assert idx.apply(batch("a", 1, [K.stored(chain[:2], None, BS)]))
    # events 2..3 lost; 4 arrives
    assert not idx.apply(batch("a", 4, [K.stored(chain[4:5], chain[3], BS)]))
    assert idx.stats()["gaps"] == 1
    assert not idx.synced("a") and idx.lookup(chain) == {}
    assert idx.wants_snapshot() == ["a"]
    # the snapshot is current to event 3; the kept batch (event 4) is applied after it
    idx.load(
        snap(
            "a",
            3,
            [(chain[0], None), (chain[1], chain[0]), (chain[2], chain[1]), (chain[3], chain[2])],
        )
    )
    assert idx.synced("a") and idx.stats()["repairs"] == 2
    assert idx.lookup(chain) == {"a": 5}
    # a redelivered old batch changes nothing
    assert idx.apply(batch("a", 1, [K.stored(chain[:2], None, BS)]))
    assert idx.lookup(chain) == {"a": 5}
    # a new boot (the replica restarted) needs a snapshot again
    assert not idx.apply(batch("a", 1, [K.all_cleared()], boot="b2"))


@pytest.mark.unit
def test_a_replica_reporting_more_than_the_index_bound_is_resynchronised() -> None:
    idx = KVIndex(max_blocks_per_replica=8)
    idx.load({**snap("a", 0, []), "capacity_blocks": 4})
    chain = K.chain_hashes(list(range(40)), BS)
    # Over its capacity for a while (an overcommitted pool) is no reason to distrust it...
    assert idx.apply(batch("a", 1, [K.stored(chain[:6], None, BS)]))
    assert idx.lookup(chain) == {"a": 6}
    # ...past the index's own bound is: cleared, resynchronised from a snapshot.
    assert not idx.apply(batch("a", 2, [K.stored(chain[6:9], chain[5], BS)]))
    assert idx.stats()["entries"] == 0 and not idx.synced("a")


def _replica(name: str, load: int = 0, cap: int = 16) -> Replica:
    return Replica(name, "m", f"s.{name}", max_concurrency=cap, reported_in_flight=load)


@pytest.mark.unit
def test_kv_aware_weighs_the_cached_prefix_against_load() -> None:
    idx = KVIndex()
    synced(idx, "a", "b")
    text = render_prompt([{"role": "user", "content": "x" * 200}])
    chain = K.text_block_hashes(text, BS)
    idx.apply(batch("a", 1, [K.stored(chain, None, BS)]))
    policy = KVAware(idx)
    req = RouteRequest("m", rendered=text)
    a, b = _replica("a", load=4), _replica("b", load=0)
    assert policy.choose([a, b], req) is a  # whole prefix cached: 0.25 against 1.0
    assert policy.last == {"a": len(chain)}
    a.reported_in_flight = 15  # 0.9375 against 1.0: still a
    assert policy.choose([a, b], req) is a
    b.reported_in_flight = 0
    a.unacked = 1  # 1.0 against 1.0: either; one more and b
    a.unacked = 2
    assert policy.choose([a, b], req) is b
    # half the prompt cached on b: 0.5 + its load against a's 1.0 + 0.25 load
    idx.apply(batch("b", 1, [K.stored(chain[: len(chain) // 2], None, BS)]))
    a.reported_in_flight, a.unacked, b.reported_in_flight = 0, 0, 4
    del a  # the cost of a without its cache
    c = _replica("c", load=4)
    assert policy.choose([b, c], req) is b
    other = RouteRequest("m", rendered=render_prompt([{"role": "user", "content": "y" * 200}]))
    assert policy.choose([b, c, _replica("d", load=1)], other).replica == "d"  # least loaded


@pytest.mark.unit
def test_kv_aware_matches_each_scheme_and_falls_back_where_it_cannot() -> None:
    """Sim and vLLM replicas of one model: the sim's are matched on its text hashes; a vLLM
    replica whose hashes this router cannot compute (here: no tokenizer where it says) is
    treated as holding nothing, and the reason is kept. With only such replicas the
    policy falls back to prompt affinity, consistently."""
    idx = KVIndex()
    synced(idx, "a")
    vllm = K.vllm_scheme(
        algo="sha256", seed="s", int_hashes=True, tokenizer="/nowhere/at/all", block_size=BS
    )
    idx.load({**snap("v", 0, []), "hashing": vllm})
    text = render_prompt([{"role": "user", "content": "x" * 600}])
    idx.apply(batch("a", 1, [K.stored(K.text_block_hashes(text, BS), None, BS)]))
    policy = KVAware(idx)
    env = {"messages": [{"role": "user", "content": "x" * 600}]}
    req = RouteRequest("m", rendered=text, env=env)
    a, v = _replica("a", load=2), _replica("v", load=0)
    assert policy.choose([a, v], req) is a
    assert policy.last == {"a": len(K.text_block_hashes(text, BS))}
    (reason,) = policy.hashers.unavailable.values()
    assert "transformers" in reason or "not found" in reason
    # Only the replica it cannot match: prompt affinity, the same replica every time.
    w = _replica("w")
    idx.load({**snap("w", 0, []), "hashing": vllm})
    picks = {policy.choose([v, w], req).replica for _ in range(5)}
    assert len(picks) == 1
    # A seed nobody outside the engine knows (xxhash without PYTHONHASHSEED).
    secret = {**vllm, "seed": None, "tokenizer": "/elsewhere"}
    idx.load({**snap("x", 0, []), "hashing": secret})
    policy.choose([_replica("x")], req)
    assert any("random" in r for r in policy.hashers.unavailable.values())


# -- on the bus -----------------------------------------------------------------------------
PREFIXES = [[{"role": "system", "content": f"{i} you are agent {i}. " * 12}] for i in range(6)]


async def _turn(client: Client, model: str, system: list[dict[str, Any]], n: int) -> str:
    messages = [*system, {"role": "user", "content": f"turn {n}"}]
    out = await client.chat_completion(model, messages, max_tokens=2)
    return str(out.replica)


@pytest.mark.bus
async def test_events_reach_the_router_and_each_conversation_lands_where_its_prefix_is(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Four sim replicas, the router on kv_aware: the router's index matches each worker's
    cache exactly, and every later turn of a conversation goes where its first turn left
    its prefix (by chance: 4^-12 for twelve turns)."""
    async with stack(
        nats_server.url, model, workers=4, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        router = svcs["router"]
        index: KVIndex = router.kv.index
        await wait_for(lambda: index.stats()["synced"] == 4, what="router not synced")
        first = [await _turn(client, model, p, 0) for p in PREFIXES]
        for w in svcs["workers"]:
            cache = w.backend.engine.cache

            def same(w: Any = w, cache: Any = cache) -> bool:
                return index.held(w.replica) == len(cache.snapshot()[1])

            await wait_for(same, what="index differs from the cache")
        for n in (1, 2):
            again = [await _turn(client, model, p, n) for p in PREFIXES]
            assert again == first
        assert index.hit_decisions >= 12
        # The same on /metrics (this process's registry: the router runs in it).
        from prometheus_client import REGISTRY, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        got = {
            (s.name, s.labels.get("replica", "")): s.value
            for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode())
            for s in fam.samples
        }
        assert got[("tokenbus_kv_route_hit_decisions_total", "")] >= 12
        assert got[("tokenbus_kv_route_cached_blocks_total", "")] > 0
        for w in svcs["workers"]:
            assert got[("tokenbus_kv_index_entries", w.replica)] == index.held(w.replica)
        assert got[("tokenbus_kv_index_synced_replicas", "")] >= 4


@pytest.mark.bus
async def test_a_late_router_starts_warm_and_a_dropped_event_is_repaired(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    from router.service import Router
    from tests.support.inprocess import settings

    async with stack(
        nats_server.url, model, workers=2, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        w0 = svcs["workers"][0]
        served = [await _turn(client, model, p, 0) for p in PREFIXES]
        # Until the events' batches went out: the running router's index holds what each
        # worker's cache does.
        index0: KVIndex = svcs["router"].kv.index
        for w in svcs["workers"]:
            cache = w.backend.engine.cache

            def same(w: Any = w, cache: Any = cache) -> bool:
                return index0.held(w.replica) == len(cache.snapshot()[1])

            await wait_for(same, what="the events never reached the router")
        late = Router(settings(nats_server.url, router=KV_ROUTER))
        async with late:
            index: KVIndex = late.kv.index
            await wait_for(lambda: index.stats()["synced"] == 2, what="late router not warm")
            for p, replica in zip(PREFIXES, served, strict=True):
                text = render_prompt([*p, {"role": "user", "content": "turn 0"}])
                depth = index.lookup(K.text_block_hashes(text, BS))
                assert max(depth, key=lambda k: depth[k]) == replica
            # A batch numbered past what the router applied: events were lost. The router
            # marks the replica stale, asks it for a snapshot and is whole again.
            seq = w0.backend.engine.cache.snapshot()[0]
            forged = batch(w0.replica, seq + 5, [K.all_cleared()], boot=w0.boot)
            forged["model"] = model
            await nc.publish(subjects.kv_events(model, w0.replica), codec.encode(forged))
            await wait_for(lambda: index.stats()["gaps"] >= 1, what="gap not seen")
            await wait_for(lambda: index.synced(w0.replica), what="not repaired")
            assert index.stats()["repairs"] >= 3


@pytest.mark.bus
async def test_a_dead_replicas_entries_go_with_it(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(
        nats_server.url, model, workers=2, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        index: KVIndex = svcs["router"].kv.index
        for p in PREFIXES:
            await _turn(client, model, p, 0)
        await wait_for(lambda: index.stats()["entries"] > 0, what="no entries")
        gone = max(svcs["workers"], key=lambda w: index.held(w.replica))
        assert index.held(gone.replica) > 0
        # Its connection gone, as a crashed process's would be: no all_cleared, its
        # heartbeats stop, the registry forgets it, and the index with it.
        await gone.nc.close()
        await wait_for(lambda: gone.replica not in index.replicas(), timeout=15, what="kept")
        assert index.held(gone.replica) == 0


@pytest.mark.bus
async def test_replicas_without_events_are_routed_by_the_fallback_and_not_asked_again(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Workers whose engine keeps no cache (as an openai backend) have no snapshot subject:
    the router learns that from nats-server's no-responders answer, stops asking, and
    routes a session's turns to one replica by consistent hashing."""
    no_cache = {**SIM, "kv_cache_blocks": 0}
    async with stack(
        nats_server.url, model, workers=3, worker={"sim": no_cache}, router=KV_ROUTER
    ) as svcs:
        follower = svcs["router"].kv
        await wait_for(lambda: len(follower._no_events) == 3, what="still asking")
        assert follower.index.stats()["synced"] == 0
        served = set()
        for n in range(4):
            messages = [*PREFIXES[0], {"role": "user", "content": f"turn {n}"}]
            out = await client.chat_completion(model, messages, max_tokens=2, session="s1")
            served.add(out.replica)
        assert len(served) == 1
        await asyncio.sleep(0.6)  # a negative check: two more ticks, nobody asked again
        assert len(follower._no_events) == 3 and not follower._asking


@pytest.mark.bus
async def test_a_batch_naming_another_replica_than_its_subject_is_refused(
    nats_server: NatsServer, model: str, client: Client, nc: NATS
) -> None:
    """A host may publish only its own replicas' KV subjects, but the batch names its
    replica itself: one published on w1's subject naming w0 (clearing w0's cache) is
    refused, and w0's entries stay as its cache is."""
    async with stack(
        nats_server.url, model, workers=2, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        w0, w1 = svcs["workers"]
        follower = svcs["router"].kv
        index: KVIndex = follower.index
        for p in PREFIXES:
            await _turn(client, model, p, 0)
        cache = w0.backend.engine.cache
        await wait_for(lambda: index.held(w0.replica) > 0, what="w0 has no entries")
        await wait_for(
            lambda: index.held(w0.replica) == len(cache.snapshot()[1]),
            what="index differs from w0's cache",
        )
        held = index.held(w0.replica)
        seq = cache.snapshot()[0]
        forged = batch(w0.replica, seq + 1, [K.all_cleared()], boot=w0.boot)
        forged["model"] = model
        await nc.publish(subjects.kv_events(model, w1.replica), codec.encode(forged))
        await wait_for(lambda: follower.bad_batches >= 1, what="the forged batch not refused")
        assert index.held(w0.replica) == held
        assert index.synced(w0.replica)


@pytest.mark.bus
async def test_a_router_at_a_site_follows_only_its_sites_replicas(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Issue 71: a router at site a (``TOKENBUS_SITE=a``) subscribes to the KV events of
    site a's replicas only, one subscription each, so no other site's events cross a leaf
    link to it; the hub's router follows both sites."""
    from engine_worker.worker import Worker
    from router.service import Router
    from tests.support.inprocess import settings

    async with stack(
        nats_server.url, model, workers=0, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        hub: KVIndex = svcs["router"].kv.index
        w = {"model": model, "heartbeat_interval_s": 0.2, "sim": SIM}
        b = Worker(settings(nats_server.url, worker={**w, "replica": "at-b"}, site="b"))
        async with b:
            await wait_for(lambda: hub.synced("at-b"), what="the hub not following b")
            for p in PREFIXES:
                await _turn(client, model, p, 0)
            await wait_for(lambda: hub.held("at-b") > 0, what="b's events never came")
            a = Worker(settings(nats_server.url, worker={**w, "replica": "at-a"}, site="a"))
            sited = Router(settings(nats_server.url, router=KV_ROUTER, site="a"))
            async with a, sited:
                follower = sited.kv
                index: KVIndex = follower.index
                await wait_for(lambda: sited.registry.live(model), what="no replica heard")
                await wait_for(
                    lambda: hub.synced("at-a") and index.synced("at-a"), what="a not followed"
                )
                await wait_for(
                    lambda: {r.replica for r in sited.registry.live(model)} == {"at-a", "at-b"},
                    what="the sited router not hearing both sites' heartbeats",
                )
                # It knows b is there (to spill to) but neither indexes nor listens to it.
                assert index.replicas() == ["at-a"]
                assert set(follower._site_subs) == {"at-a"}
                assert follower._sub is None
                # Its own site's events do reach it (a turn sent each try: the two routers
                # share the route stage, and the sited one keeps its requests at a).
                turns = iter(range(1, 1000))

                async def a_indexed() -> bool:
                    await _turn(client, model, PREFIXES[0], next(turns))
                    return index.held("at-a") > 0

                await wait_for(a_indexed, what="site a's events never reached its router")
                assert index.replicas() == ["at-a"] and index.held("at-b") == 0
