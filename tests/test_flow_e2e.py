"""Flow control end to end (engine_worker/flow.py, docs/flow.md): real nats-server, real
processes, two routers (NATS clients' requests) beside a bridge that routes in-process (HTTP
clients'): every path meets in the replica's worker, where the schedule is kept.

Orders of service are asserted, never durations: a newcomer's first token comes before the
flooding tenant's backlog, and with flow control off (the engine's own first come, first
served) it comes after it — so each fairness test shows it can fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime
from typing import Any

import httpx
import nats
import openai
import pytest

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from tests.support.busdata import key_store
from tests.support.procs import Proc, Procs, start_stack, start_worker
from tests.support.repo import run_cli
from tests.support.waits import live_replicas, wait_for
from tokenbus import Client

pytestmark = pytest.mark.stack

MSG = [{"role": "user", "content": "Tell me about fair queues."}]
PIPELINE = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]'}


async def _keys(url: str, **specs: dict[str, Any]) -> dict[str, str]:
    """Keys by name, with the given fields."""
    out = {}
    async with key_store(url) as store:
        for name, fields in specs.items():
            out[name], _ = await store.create(name, **fields)
    return out


async def _until_flow(url: str, model: str, cond: Any) -> dict[str, Any]:
    """The replica's flow stats once ``cond`` holds of them."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for hb in (await live_replicas(url, model, wait=0.25)).values():
            if hb.get("flow") and cond(hb["flow"]):
                return dict(hb["flow"])
    raise AssertionError("the replica's flow control never got there")


class _InFlight:
    """The most requests in flight any replica of ``model`` said in a heartbeat since the
    watch began, heard on one connection that stays subscribed: a count that holds only for
    a moment (a backlog draining two at a time) is not missed between looks."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.most = 0
        self.nc: Any = None

    async def __aenter__(self) -> _InFlight:
        self.nc = await nats.connect(self.url)

        async def cb(msg: Any) -> None:
            hb = codec.decode_map(msg.data)
            if hb.get("model") == self.model:
                self.most = max(self.most, int(hb.get("in_flight", 0)))

        await self.nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.drain()

    async def until(self, n: int) -> None:
        await wait_for(
            lambda: self.most >= n, timeout=60, what=f"the replica never had {n} requests in flight"
        )


async def _until_in_flight(url: str, model: str, n: int) -> None:
    async with _InFlight(url, model) as watch:
        await watch.until(n)


async def _http_stream(
    base: str,
    key: str,
    body: dict[str, Any],
    firsts: list[float],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A streamed chat request through the bridge; appends its first token's time."""
    hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
    last: dict[str, Any] = {}
    text: list[str] = []
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as h,
        h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=hdrs) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            piece = ev["choices"][0]["delta"].get("content") if ev["choices"] else None
            if piece:
                if not text:
                    firsts.append(time.monotonic())
                text.append(piece)
            last = ev
    return {"text": "".join(text), "last": last}


def _served(worker: Proc) -> dict[str, tuple[float, float]]:
    """When the worker gave each request it logged to its engine and when the engine made
    its first token (wall clock), by the client's id where it gave one, else the gateway's."""
    out: dict[str, tuple[float, float]] = {}
    for line in worker.output().splitlines():
        if '"event": "request"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("ttft_ms") is None:
            continue
        end = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
        start = end - ev["duration_ms"] / 1000
        rid = ev.get("client_request_id") or ev["request_id"]
        out[str(rid)] = (start, start + ev["ttft_ms"] / 1000)
    return out


def _flow_env(on: bool, **extra: str) -> dict[str, str]:
    return {**PIPELINE, "TOKENBUS_WORKER__FLOW__ENABLED": "true" if on else "false", **extra}


FLOOD = {"messages": MSG, "max_tokens": 30, "ignore_eos": True}


@pytest.mark.parametrize("flow", [True, False], ids=["flow-on", "flow-off"])
async def test_a_newcomer_is_served_before_a_flooding_tenants_backlog(
    procs: Procs, model: str, flow: bool
) -> None:
    """Tenant A floods over HTTP (the bridge routes in-process); tenant B's one request comes
    over NATS through two router instances. With flow control B's first token comes before
    A's queued requests start; without it (FIFO in the engine) after them."""
    keys = await _keys(procs.url, a={}, b={})
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "auth",
        "router",
        "router",
        worker_args=("--sim-max-running", "2", "--max-concurrency", "64"),
        env=_flow_env(flow),
        settle=0.5,
    )
    # 100 tokens each, two at a time: the flood takes about 6 s to drain, so all 12 are in
    # flight together however slowly a loaded machine sends them (30 tokens drained in 2 s,
    # and the 12 were not always in flight at once).
    flood_body = {"model": model, **FLOOD, "max_tokens": 100}
    async with _InFlight(procs.url, model) as watch:  # listening before the flood starts
        flood = [
            asyncio.ensure_future(_http_stream(stack.base, keys["a"], flood_body, []))
            for _ in range(12)
        ]
        await watch.until(12)
    async with await Client.connect(procs.url) as client:
        stream = client.chat(
            model, MSG, max_tokens=4, ignore_eos=True, api_key=keys["b"], request_id="newcomer-b"
        )
        await stream.collect()
    results = await asyncio.gather(*flood)
    assert all(len(r["last"]["choices"]) or r["text"] for r in results)
    # The order is the worker's (its log), from when B was sent on to it (the router's
    # mark): not when this loaded client got round to reading A's tokens, nor while B still
    # crossed the stages.
    [worker] = stack.workers
    await wait_for(lambda: len(_served(worker)) >= 13, timeout=30, what="13 requests logged")
    served = _served(worker)
    b_started, b_first = served.pop("newcomer-b")
    b_routed = stream.timings["route"] / 1e9
    if flow:
        # The flow control holds A's queued requests back from the engine: B is given to it
        # before them, but for the slot that was already being handed over when B came.
        a_before_b = sum(1 for start, _ in served.values() if b_routed <= start <= b_started)
        assert a_before_b <= 1, a_before_b
        # And the engine did not queue B behind them either: of A's first tokens after B was
        # routed, at most that one's and one that had just started when B came.
        a_first = sum(1 for _, first in served.values() if b_routed <= first <= b_first)
        assert a_first <= 2, a_first
    else:
        # Without it every request goes to the engine at once, and its queue (FIFO) makes
        # A's first tokens before B's.
        a_before_b = sum(1 for _, first in served.values() if b_routed <= first <= b_first)
        assert a_before_b >= 6, a_before_b
    assert stack.all_alive()


async def test_fairness_ids_share_a_key(procs: Procs, model: str) -> None:
    """One key, two agents: the second agent's request goes before the first agent's queue."""
    keys = await _keys(procs.url, k={})
    # One at a time, 3 s each: all 8 are in flight at once even when a loaded machine
    # spreads their arrival over seconds (1 s each once let the first end before the last
    # came, and 8 were never in flight together).
    stack = await start_stack(
        procs,
        model,
        "auth",
        worker_args=("--sim-max-running", "1", "--max-concurrency", "64", "--sim-decode-ms", "30"),
        env=_flow_env(True),
        settle=0.5,
    )
    firsts: list[float] = []
    body = {"model": model, **FLOOD, "max_tokens": 100}
    async with _InFlight(procs.url, model) as watch:  # listening before the first is sent
        agent1 = [
            asyncio.ensure_future(
                _http_stream(stack.base, keys["k"], body, firsts, {"X-Fairness-Id": "agent-1"})
            )
            for _ in range(8)
        ]
        await watch.until(8)
    sent = time.monotonic()
    mine: list[float] = []
    await _http_stream(
        stack.base, keys["k"], {**body, "max_tokens": 2}, mine, {"X-Fairness-Id": "agent-2"}
    )
    await asyncio.gather(*agent1)
    assert sum(1 for t in firsts if sent <= t <= mine[0]) <= 1


async def test_service_tier_is_settled_by_the_key_and_carried_back(
    procs: Procs, model: str
) -> None:
    """``service_tier`` over HTTP (body and header) and over NATS: the key's default for
    none or ``auto``, never above its ceiling; every answer says which class served it."""
    keys = await _keys(
        procs.url,
        vip={"max_service_tier": "priority"},
        std={},
        batchy={"service_tier": "flex"},
    )
    stack = await start_stack(
        procs, model, "ingress", "auth", "router", env=_flow_env(True), settle=0.5
    )
    body: Any = {"model": model, "messages": MSG, "max_tokens": 3}
    cases: list[tuple[str, Any, dict[str, str], str]] = [
        ("vip", {"service_tier": "priority"}, {}, "priority"),
        ("std", {"service_tier": "priority"}, {}, "default"),  # above its ceiling
        ("std", {"service_tier": "flex"}, {}, "flex"),
        ("batchy", {}, {}, "flex"),
        ("batchy", {"service_tier": "auto"}, {}, "flex"),
        ("std", {}, {"X-Tokenbus-Service-Tier": "flex"}, "flex"),
        ("vip", {}, {}, "default"),
    ]
    for name, extra, hdrs, want in cases:
        oa = openai.AsyncOpenAI(
            base_url=f"{stack.base}/v1", api_key=keys[name], max_retries=0, default_headers=hdrs
        )
        whole = await oa.chat.completions.create(**body, **extra)
        assert whole.service_tier == want, (name, extra, hdrs)
        chunks = [c async for c in await oa.chat.completions.create(**body, **extra, stream=True)]
        assert chunks and all(c.service_tier == want for c in chunks), (name, extra)
        await oa.close()
    oa = stack.openai(keys["std"])
    with pytest.raises(openai.BadRequestError) as bad:
        await oa.chat.completions.create(**{**body, "service_tier": "gold"})
    assert bad.value.status_code == 400 and "service_tier" in str(bad.value)
    # The Responses API says it on the response; the Messages API in usage, in its words.
    oa = stack.openai(keys["batchy"])
    resp = await oa.responses.create(model=model, input="Hi", max_output_tokens=3)
    assert resp.service_tier == "flex"
    oa = stack.openai(keys["vip"])
    resp = await oa.responses.create(
        model=model, input="Hi", max_output_tokens=3, service_tier="priority"
    )
    assert resp.service_tier == "priority"
    async with stack.http("/v1") as h:
        for key, asked, want in (
            ("vip", "auto", "standard"),
            ("batchy", None, "batch"),
            ("vip", "standard_only", "standard"),
        ):
            msg = {"model": model, "max_tokens": 3, "messages": MSG}
            if asked:
                msg["service_tier"] = asked
            r = await h.post("/messages", json=msg, headers={"x-api-key": keys[key]})
            assert r.status_code == 200 and r.json()["usage"]["service_tier"] == want, r.text
        r = await h.post(
            "/messages",
            json={"model": model, "max_tokens": 3, "messages": MSG, "service_tier": "gold"},
            headers={"x-api-key": keys["vip"]},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "service_tier" in r.text
    async with await Client.connect(procs.url) as client:
        got = await client.chat_completion(
            model, MSG, max_tokens=3, service_tier="priority", api_key=keys["vip"]
        )
        assert got.service_tier == "priority"
        got = await client.chat_completion(model, MSG, max_tokens=3, api_key=keys["batchy"])
        assert got.service_tier == "flex"
        with pytest.raises(E.InvalidRequest):
            await client.chat_completion(
                model, MSG, max_tokens=3, service_tier=7, api_key=keys["std"]
            )
    assert stack.all_alive()


async def test_reserved_slot_and_displacement_before_the_first_byte(
    procs: Procs, model: str
) -> None:
    """A flex flood fills what it may (all but default's reserved slot); a default request
    takes the reserved slot at once; a priority one then displaces a flex request that has
    not sent a byte (long prefill), which waits again and still completes whole."""
    keys = await _keys(
        procs.url, flex={"service_tier": "flex"}, std={}, vip={"max_service_tier": "priority"}
    )
    stack = await start_stack(
        procs,
        model,
        "auth",
        worker_args=(
            *("--sim-max-running", "4", "--max-concurrency", "64"),
            *("--sim-prefill-ms", "6000"),
        ),
        env=_flow_env(True),
        settle=0.5,
    )
    firsts: list[float] = []
    body = {"model": model, **FLOOD, "max_tokens": 5}
    flood = [
        asyncio.ensure_future(_http_stream(stack.base, keys["flex"], body, firsts))
        for _ in range(6)
    ]
    # Each step happens well within the first requests' prefill (6 s; a step takes well
    # under a second on a loaded machine).
    stats = await _until_flow(procs.url, model, lambda s: s["flex"]["queued"] == 3)
    assert stats["flex"]["running"] == 3, stats  # the 4th slot is kept for default
    std = asyncio.ensure_future(_http_stream(stack.base, keys["std"], body, []))
    stats = await _until_flow(procs.url, model, lambda s: s["default"]["running"] == 1)
    assert stats["flex"]["running"] == 3 and stats["flex"]["displaced"] == 0, stats
    vip = asyncio.ensure_future(
        _http_stream(stack.base, keys["vip"], {**body, "service_tier": "priority"}, [])
    )
    stats = await _until_flow(procs.url, model, lambda s: s["priority"]["running"] == 1)
    assert stats["flex"]["displaced"] == 1 and stats["flex"]["running"] == 2, stats
    assert stats["default"]["running"] == 1 and not firsts, stats
    done = await asyncio.gather(*flood, std, vip)
    # Every displaced request came back and finished whole.
    assert all(r["last"]["choices"][0]["finish_reason"] == "length" for r in done)
    assert all(r["last"].get("service_tier") for r in done)
    assert stack.all_alive()


async def test_a_full_queue_is_429_for_the_key_over_its_share_and_503_for_others(
    procs: Procs, model: str
) -> None:
    keys = await _keys(procs.url, a={}, b={})
    stack = await start_stack(
        procs,
        model,
        "auth",
        worker_args=("--sim-max-running", "1", "--max-concurrency", "64"),
        env=_flow_env(
            True,
            TOKENBUS_WORKER__FLOW__MAX_QUEUED='{"default": 3}',
            TOKENBUS_ROUTER__QUEUE_TIMEOUT_S="0.3",
        ),
        settle=0.5,
    )
    body = {"model": model, **FLOOD}
    async with stack.http("/v1", timeout=60) as h:

        async def post(key: str, tokens: int = 10) -> httpx.Response:
            return await h.post(
                "/chat/completions",
                json={**body, "max_tokens": tokens},
                headers={"Authorization": f"Bearer {key}"},
            )

        # The first runs until the test ends it (the queue stays full however long the CLI
        # calls below take on a loaded machine); 3 wait behind it.
        first = asyncio.ensure_future(post(keys["a"], 10**6))
        a = [first]
        await _until_in_flight(procs.url, model, 1)
        a += [asyncio.ensure_future(post(keys["a"])) for _ in range(3)]
        await _until_in_flight(procs.url, model, 4)
        # What an operator sees: the queue per class and per flow (the key's id).
        status = await asyncio.to_thread(
            run_cli,
            "status",
            "--json",
            "--wait",
            "0.7",
            env={**os.environ, "TOKENBUS_NATS_URL": procs.url},
        )
        (row,) = [r for r in json.loads(status.stdout)["replicas"] if r["model"] == model]
        assert row["flow"]["default"]["queued"] == 3 and row["flow"]["default"]["running"] == 1
        a_id = keys["a"][3:15]
        assert row["flows"][a_id]["queued"] == 3, row["flows"]
        table = await asyncio.to_thread(
            run_cli, "status", "--wait", "0.7", env={**os.environ, "TOKENBUS_NATS_URL": procs.url}
        )
        assert "QUEUED" in table.stdout and "0/3/0" in table.stdout, table.stdout
        over = await post(keys["a"])
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(over.headers["retry-after"]) >= 1
        other = await post(keys["b"])
        assert other.status_code == 503, other.text
        assert other.headers.get("retry-after")
        # The client leaves the first (its engine request is cancelled): the queue runs.
        first.cancel()
        assert all(r.status_code == 200 for r in await asyncio.gather(*a[1:]))
    assert stack.all_alive()


async def test_a_wait_past_the_class_limit_is_503_with_retry_after(
    procs: Procs, model: str
) -> None:
    keys = await _keys(procs.url, a={})
    stack = await start_stack(
        procs,
        model,
        "auth",
        worker_args=("--sim-max-running", "1"),
        env=_flow_env(True, TOKENBUS_WORKER__FLOW__MAX_WAIT_S='{"default": 0.3}'),
        settle=0.5,
    )
    async with stack.http("/v1", headers={"Authorization": f"Bearer {keys['a']}"}) as h:
        # It runs until the test ends it: the next request waits behind it however long a
        # loaded machine takes to send it.
        long = asyncio.ensure_future(
            h.post("/chat/completions", json={"model": model, **FLOOD, "max_tokens": 10**6})
        )
        await _until_in_flight(procs.url, model, 1)
        r = await h.post("/chat/completions", json={"model": model, **FLOOD, "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "overloaded" and r.headers.get("retry-after")
        long.cancel()  # the client leaves: its engine request ends
        # The refused request left no place behind: the next one is served.
        r = await h.post("/chat/completions", json={"model": model, **FLOOD, "max_tokens": 2})
        assert r.status_code == 200
    stats = await _until_flow(procs.url, model, lambda s: s["default"]["queued"] == 0)
    assert stats["default"]["shed"] >= 1
    assert stack.all_alive()


async def test_the_waiting_room_holds_a_request_until_a_worker_starts(
    procs: Procs, model: str
) -> None:
    """Scale from zero: no replica of the model runs; the bridge holds the request (and
    says so on the bus, per model and class, for an autoscaler) until a worker starts."""
    env = {
        "TOKENBUS_ROUTER__WAITING_ROOM_S": "60",
        "TOKENBUS_ROUTER__WAITING_ROOM_MODELS": json.dumps([model]),
    }
    stack = await start_stack(procs, model, workers=0, env=env)
    reports: list[dict[str, Any]] = []
    nc = await nats.connect(procs.url)

    async def on_report(msg: Any) -> None:
        reports.append(codec.decode_map(msg.data))

    await nc.subscribe(subjects.telemetry(subjects.TELEMETRY_QUEUE), cb=on_report)
    try:
        async with stack.http("/v1", timeout=60) as h:
            held = asyncio.ensure_future(
                h.post("/chat/completions", json={"model": model, "messages": MSG, "max_tokens": 3})
            )
            deadline = time.monotonic() + 10
            while not any(r["waiting"].get(model) == {"default": 1} for r in reports):
                assert time.monotonic() < deadline and not held.done(), reports
                await asyncio.sleep(0.05)
            start_worker(procs, model, 0)
            r = await held
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 5
        while not reports or reports[-1]["waiting"]:
            assert time.monotonic() < deadline, reports[-3:]
            await asyncio.sleep(0.05)
    finally:
        await nc.drain()
    assert stack.all_alive()


async def test_the_waiting_room_answers_503_after_its_limit(procs: Procs, model: str) -> None:
    """Over NATS (ingress, router): a held request that no worker came for is refused with
    503 no_replica and Retry-After; a model nobody knows is still 404 at once."""
    env = {
        "TOKENBUS_ROUTER__WAITING_ROOM_S": "1",
        "TOKENBUS_ROUTER__WAITING_ROOM_MODELS": json.dumps([model]),
    }
    stack = await start_stack(
        procs, model, "ingress", "router", workers=0, bridge=False, env=env, settle=2.0
    )
    async with await Client.connect(procs.url) as client:
        t0 = time.monotonic()
        with pytest.raises(E.NoReplica) as err:
            await client.chat_completion(model, MSG, max_tokens=3)
        assert time.monotonic() - t0 >= 1.0
        assert err.value.headers and err.value.headers.get("Retry-After")
        with pytest.raises(E.ModelNotFound):
            await client.chat_completion(model + "-nobody", MSG, max_tokens=3)
    assert stack.all_alive()
