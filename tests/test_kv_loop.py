"""Routing that checks itself (issue 68, docs/routing.md "Checking the KV index"): the
router's predicted cached prompt tokens beside the engine's reported ones (the closed loop),
a replica whose reports disagree routed by load until it agrees again, and a replica whose
block hashes the router cannot compute refused loudly at join. On a real nats-server, with
sim workers (in-process where the test reads their state, real processes for the join)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from bus_schemas import codec, subjects
from bus_schemas import headers as H
from router.kv_index import KVIndex
from router.policies import KVAware, RouteRequest
from telemetry import records
from telemetry.metrics import Metrics
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for
from tokenbus import Client

BS = 4
SIM = {"kv_cache_blocks": 256, "block_size": BS, "prefill_ms": 1.0, "decode_ms": 1.0}
PREFIXES = [[{"role": "system", "content": f"{i} you are agent {i}. " * 12}] for i in range(4)]
# Small windows so a test sees the loop judge within a few heartbeats.
CHECK = {"window_s": 1.0, "min_tokens": 16, "tolerance": 0.25}
KV_ROUTER = {"policy": "kv_aware", "kv_check": CHECK}


def turn(system: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [*system, {"role": "user", "content": f"turn {n}"}]


@pytest.mark.bus
async def test_predicted_and_reported_cached_tokens_agree_and_a_client_cannot_set_them(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Two sim replicas on kv_aware: every request carries the router's prediction, the
    engines report exactly that many cached tokens, and a client's own Tb-Kv-Predicted
    (a skew of metrics and routing) never reaches a worker."""
    async with stack(
        nats_server.url, model, workers=2, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        index: KVIndex = svcs["router"].kv.index
        await wait_for(lambda: index.stats()["synced"] == 2, what="router not synced")
        for n in range(3):
            for p in PREFIXES:
                await client.chat_completion(model, turn(p, n), max_tokens=2)
                # The next turn is predicted from the events of this one.
                await wait_for(lambda: _in_step(svcs), what="index behind the caches")
        loops = [w.kv_loop for w in svcs["workers"]]
        assert sum(lp.requests for lp in loops) == 3 * len(PREFIXES)
        assert sum(lp.predicted for lp in loops) > 0
        for lp in loops:
            assert lp.predicted == lp.reported, (lp.predicted, lp.reported)
        before = sum(lp.predicted for lp in loops)
        # A client that writes the header itself: the router's value replaces it.
        forged = {H.KV_PREDICTED: "999999,forged"}
        body = {"model": model, "messages": turn(PREFIXES[0], 3), "max_tokens": 2}
        await client.submit(subjects.KIND_CHAT, body, headers=forged).collect()
        assert sum(lp.requests for lp in loops) == 3 * len(PREFIXES) + 1
        assert sum(lp.predicted for lp in loops) - before < 1000
        for lp in loops:
            assert lp.predicted == lp.reported
        # Heartbeats carry the totals and what makes the hashes comparable.
        r = svcs["router"].registry.get(svcs["workers"][0].replica)
        await wait_for(lambda: r.kv_check == loops[0].heartbeat(), what="totals not beaten")
        assert r.kv_hashing == {"kind": "text", "seed": "", "block_size": BS, "model": model}
        assert not svcs["router"].kv.check.disagreeing


def _in_step(svcs: dict[str, Any]) -> bool:
    index: KVIndex = svcs["router"].kv.index
    return all(
        index.held(w.replica) == len(w.backend.engine.cache.snapshot()[1]) for w in svcs["workers"]
    )


@pytest.mark.bus
async def test_a_client_header_never_reaches_a_worker_without_kv_routing(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    async with stack(nats_server.url, model, workers=1, worker={"sim": SIM}) as svcs:
        body = {"model": model, "messages": turn(PREFIXES[0], 0), "max_tokens": 2}
        for _ in range(2):
            forged = {H.KV_PREDICTED: "999999,forged"}
            await client.submit(subjects.KIND_CHAT, body, headers=forged).collect()
        assert svcs["workers"][0].kv_loop.heartbeat() == {
            "requests": 0,
            "predicted": 0,
            "reported": 0,
        }


@pytest.mark.bus
async def test_the_router_replaces_whatever_prediction_a_request_came_with(
    nats_server: NatsServer, nc: Any
) -> None:
    """Ingress keeps only client headers, and the router never trusts what reaches it either:
    a request handed to it with a Tb-Kv-Predicted goes to the worker without one (no KV
    prediction on this policy)."""
    from router.dispatch import Dispatcher
    from router.registry import Registry
    from services.config import RouterSettings

    reg = Registry()
    hb = {"replica": "r1", "model": "m", "in_flight": 0, "max_concurrency": 4}
    reg.update({**hb, "interval_s": 5.0, "seq": 1, "boot": "a"})
    seen: list[dict[str, str]] = []

    async def worker(msg: Any) -> None:
        seen.append(dict(msg.headers or {}))
        await msg.respond(codec.encode({"ok": True, "in_flight": 1}))

    await nc.subscribe(reg.live("m")[0].subject, cb=worker)
    await nc.flush()
    d = Dispatcher(nc, reg, RouterSettings(dispatch_timeout_s=30))
    hdrs = {H.KV_PREDICTED: "999999,forged", H.PREFILL_TOKENS: "99999999", H.REQUEST_ID: "x"}
    assert await d.dispatch("m", codec.encode({"model": "m"}), hdrs, nc.new_inbox()) == "r1"
    assert seen and H.KV_PREDICTED not in seen[0]
    # Nor the prompt tokens a replica counts in its prefill backlog (engine_worker/backlog.py).
    assert H.PREFILL_TOKENS not in seen[0]


@pytest.mark.unit
def test_telemetry_counts_predicted_and_reported_tokens_per_replica_and_router() -> None:
    m = Metrics()
    common = {"source": "worker", "model": "m", "timings": {}, "outcome": "stop"}
    m.observe(
        records.build(
            request_id="a",
            replica="m-0",
            cached_tokens=48,
            kv_predicted_tokens=64,
            kv_router="r1",
            **common,
        )
    )
    m.observe(records.build(request_id="b", replica="m-0", cached_tokens=32, **common))
    got = {
        (s.name, s.labels.get("replica"), s.labels.get("router")): s.value
        for fam in m.registry.collect()
        for s in fam.samples
        if s.name.startswith("tokenbus_kv_")
    }
    # Only requests with both numbers count: the second had no prediction.
    assert got[("tokenbus_kv_predicted_tokens_total", "m-0", "r1")] == 64
    assert got[("tokenbus_kv_reported_tokens_total", "m-0", "r1")] == 48


@pytest.mark.bus
async def test_a_replica_whose_reports_disagree_is_routed_by_load_until_it_agrees(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """Replica 1's engine reports no cached tokens while its events say it holds them (a
    sim fault): the router marks it disagreeing once, with the numbers, and routes it by
    load; fixed, it agrees again and is trusted."""
    sim = {**SIM, "kv_cache_blocks": 8192}
    liar = {**sim, "fault_cached_scale": 0.0}
    async with stack(
        nats_server.url, model, workers=0, worker={"sim": SIM}, router=KV_ROUTER
    ) as svcs:
        from engine_worker.worker import Worker
        from tests.support.inprocess import settings

        router = svcs["router"]
        check = router.kv.check
        index: KVIndex = router.kv.index
        w: dict[str, Any] = {"model": model, "heartbeat_interval_s": 0.2}
        good = Worker(settings(nats_server.url, worker={**w, "replica": f"{model}-g", "sim": sim}))
        bad = Worker(settings(nats_server.url, worker={**w, "replica": f"{model}-b", "sim": liar}))
        async with good, bad:
            await wait_for(lambda: index.stats()["synced"] == 2, what="router not synced")
            svcs["workers"] = [good, bad]

            used: list[list[dict[str, Any]]] = []

            async def talk() -> None:
                # Fresh conversations of two turns: each first turn lands by load, and its
                # second where the cost says (so a distrusted replica still gets repeats).
                fresh = [
                    [{"role": "system", "content": f"{len(used) + i} you are {i}. " * 12}]
                    for i in range(4)
                ]
                used.extend(fresh)
                for n in (0, 1):
                    for p in fresh:
                        await client.chat_completion(model, turn(p, n), max_tokens=2)
                        await wait_for(lambda: _in_step(svcs), what="index behind the caches")

            async def judged() -> bool:
                await talk()
                return bad.replica in check.disagreeing

            await wait_for(judged, timeout=60, what="disagreement never seen")
            assert good.replica not in check.disagreeing
            assert "reported 0 cached prompt tokens" in check.disagreeing[bad.replica]
            assert not index.trusted(bad.replica)

            # Its cache holds the prompt, yet a request goes to the less loaded replica:
            # without the check, the hit would outweigh one request of load.
            policy = router.routing.route(model).policy
            assert isinstance(policy, KVAware)
            p = next(p for p in used if _holds(index, policy, bad.replica, p))
            live = {r.replica: r for r in router.registry.live(model)}
            g = dataclasses.replace(live[good.replica], reported_in_flight=0, unacked=0)
            b = dataclasses.replace(live[bad.replica], reported_in_flight=1, unacked=0)
            b.max_concurrency = g.max_concurrency = 256
            assert policy.choose([g, b], _req(model, p)).replica == good.replica

            # Fixed: its reports agree with the predictions again, and it is trusted.
            bad.backend.engine.cfg.fault_cached_scale = 1.0

            async def agrees() -> bool:
                await talk()
                return bad.replica not in check.disagreeing

            await wait_for(agrees, timeout=60, what="never trusted again")
            assert index.trusted(bad.replica)


def _req(model: str, system: list[dict[str, Any]]) -> RouteRequest:
    from bus_schemas.messages import render_prompt

    messages = turn(system, 0)
    return RouteRequest(model, rendered=render_prompt(messages), env={"messages": messages})


def _holds(index: KVIndex, policy: KVAware, replica: str, system: list[dict[str, Any]]) -> bool:
    from bus_schemas import kv_events as K

    return index.lookup(K.text_block_hashes(_req("m", system).rendered, BS)).get(replica, 0) > 0


@pytest.mark.unit
def test_what_a_router_refuses_at_join() -> None:
    from router.kv_check import KVCheck
    from services.config import KVCheckSettings

    check = KVCheck(KVCheckSettings(), log=None)
    vllm = {"kind": "vllm", "algo": "sha256", "seed": "s", "block_size": 16, "model": "m"}
    assert check.why_incompatible(None) is None  # an older worker says nothing: not judged
    assert check.why_incompatible({"kind": "text", "block_size": 32, "seed": ""}) is None
    assert check.why_incompatible(vllm) is None
    assert "random" in str(check.why_incompatible({**vllm, "seed": None}))
    assert "xxhash" in str(check.why_incompatible({**vllm, "algo": "xxhash"}))
    assert "'lmcache'" in str(check.why_incompatible({"kind": "lmcache"}))
    pinned = KVCheck(KVCheckSettings(block_size=16, hash_seed="s1"), log=None)
    assert "block size 32" in str(pinned.why_incompatible({"kind": "text", "block_size": 32}))
    assert "hash seed ''" in str(pinned.why_incompatible({"kind": "text", "block_size": 16}))
    assert pinned.why_incompatible({"kind": "text", "block_size": 16, "seed": "s1"}) is None
    # What a heartbeat made up carries (the NATS fuzz: an empty map, a kind that is no
    # string, lists for values) is not judged and breaks nothing; a kind never heard of is
    # refused with a warning, not logged as the operator's fault an error says.
    assert check.why_incompatible({}) is None
    assert check.why_incompatible({"kind": ["text"], "block_size": {}}) is None
    said: list[tuple[str, str]] = []

    class Log:
        def error(self, event: str, **kw: Any) -> None:
            said.append(("error", event))

        def warning(self, event: str, **kw: Any) -> None:
            said.append(("warning", event))

        def info(self, event: str, **kw: Any) -> None:
            said.append(("info", event))

    from router.registry import Replica

    odd = KVCheck(KVCheckSettings(), log=Log())
    r = Replica("m-0", "m", "tb.v1.engine.m.m-0")
    for hashing in ({}, {"kind": "made-up", "x": [1]}, {"kind": "text", "seed": "other"}):
        r.kv_hashing = hashing
        odd.admit(r)
    assert said == [("warning", "kv_hashing_mismatch"), ("error", "kv_hashing_mismatch")]


# -- mismatch at join: real processes -------------------------------------------------------
async def _metric(port: int, name: str) -> float | None:
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"http://127.0.0.1:{port}/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _refused_at_join(procs: Procs, model: str, odd: dict[str, str], expect: str) -> None:
    """A router (kv_aware, blocks of 4) and two sim workers, the second with ``odd`` env:
    the router names the second and both sides in one error, counts it, refuses its events,
    and never sends it a predicted hit, while the first is routed on its cache."""
    port = free_port()
    base = {
        "TOKENBUS_ROUTER__POLICY": "kv_aware",
        "TOKENBUS_ROUTER__KV_CHECK__BLOCK_SIZE": str(BS),
        "TOKENBUS_WORKER__SIM__BLOCK_SIZE": str(BS),
        "TOKENBUS_WORKER__SIM__KV_CACHE_BLOCKS": "256",
        "TOKENBUS_WORKER__SIM__PREFILL_MS": "1",
        "TOKENBUS_WORKER__SIM__DECODE_MS": "1",
    }

    def env_for(role: str, i: int) -> dict[str, str]:
        if role == "router":
            return {"TOKENBUS_METRICS_PORT": str(port)}
        return odd if role == "worker" and i == 1 else {}

    st = await start_stack(
        procs, model, "ingress", "router", workers=2, bridge=False, env=base, env_for=env_for
    )
    router = st.roles["router"][0]
    odd_replica = f"{model}-1"
    await wait_for(
        lambda: "kv_hashing_mismatch" in router.output(), timeout=30, what="no error logged"
    )
    line = next(ln for ln in router.output().splitlines() if "kv_hashing_mismatch" in ln)
    assert odd_replica in line and expect in line, line
    assert "router_hashing" in line and "replica_hashing" in line

    async def counted() -> bool:
        return await _metric(port, "tokenbus_kv_incompatible_replicas") == 1.0

    await wait_for(counted, timeout=30, what="not counted")
    nc = await nats.connect(procs.url)
    beats: dict[str, dict[str, Any]] = {}

    async def on_beat(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        if hb.get("model") == model:
            beats[hb["replica"]] = hb

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_beat)
    async with await Client.connect(procs.url) as tb:
        for n in range(3):
            for p in PREFIXES:
                await tb.chat_completion(model, turn(p, n), max_tokens=2)
    ok = f"{model}-0"

    def settled() -> bool:
        return all(
            beats.get(r, {}).get("kv_check", {}).get("requests", -1) >= 0 for r in (ok, odd_replica)
        ) and (beats[ok]["kv_check"]["requests"] > 0)

    await wait_for(settled, timeout=30, what="no heartbeats with totals")
    # Never routed as if it hit: no prediction ever reached it.
    assert beats[odd_replica]["kv_check"]["predicted"] == 0
    assert beats[odd_replica]["kv_check"]["requests"] == 0
    await nc.drain()
    assert router.output().count("kv_hashing_mismatch") == 1  # logged once


@pytest.mark.stack
async def test_a_worker_with_another_block_size_is_refused_loudly(
    nats_server: NatsServer, model: str, tmp_path: Path
) -> None:
    with Procs(nats_server.url, tmp_path) as procs:
        odd = {"TOKENBUS_WORKER__SIM__BLOCK_SIZE": "8"}
        await _refused_at_join(procs, model, odd, "block size 8")


@pytest.mark.stack
async def test_a_worker_with_another_hash_seed_is_refused_loudly(
    nats_server: NatsServer, model: str, tmp_path: Path
) -> None:
    with Procs(nats_server.url, tmp_path) as procs:
        odd = {"TOKENBUS_WORKER__SIM__HASH_SEED": "other"}
        await _refused_at_join(procs, model, odd, "hash seed 'other'")
