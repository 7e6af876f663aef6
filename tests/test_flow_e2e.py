"""Flow control end to end (engine_worker/flow.py, docs/flow.md): real nats-server, real
processes, two routers (NATS clients' requests) beside a bridge that routes in-process (HTTP
clients'): every path meets in the replica's worker, where the schedule is kept.

Orders of service are asserted, never durations: a newcomer's first token comes before the
flooding tenant's backlog, and with flow control off (the engine's own first come, first
served) it comes after it — so each fairness test shows it can fail. (Tiers, reserved
slots, full queues and the waiting room: tests/test_flow_queues.py.)
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from typing import Any

import httpx
import nats
import pytest

from bus_schemas import codec, subjects
from tests.support.busdata import key_store
from tests.support.procs import Proc, Procs, start_stack
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
