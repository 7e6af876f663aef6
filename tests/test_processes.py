"""Real processes under failure: kill -9, SIGTERM drain, an OpenAI upstream joined to the bus,
several bridge processes on one port, ``tokenbus status``."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from nats.aio.client import Client as NATS

from engine_worker.backends.sim import expected_text
from tests.support.natsserver import NatsServer
from tests.support.ports import free_port
from tests.support.procs import Procs, ProcStack, start_stack, start_worker
from tests.support.repo import run_cli
from tests.support.waits import live_replicas, wait_for, wait_http, wait_replicas

MSG = [{"role": "user", "content": "hello there"}]
PROMPT = "<|user|>hello there\n"
FAST = ("--sim-prefill-ms", "2", "--sim-decode-ms", "1")
SLOW = ("--sim-prefill-ms", "2", "--sim-decode-ms", "20")


async def bridged(procs: Procs, model: str, workers: int, *worker_args: str) -> ProcStack:
    """Workers and a bridge (its own router), no ingress or router process."""
    # /ready needs one replica; two heartbeat intervals more and the bridge knows them all.
    return await start_stack(procs, model, workers=workers, worker_args=worker_args, settle=0.5)


@pytest.mark.fault
async def test_worker_killed_before_accepting_requests_go_to_another(
    procs: Procs, model: str
) -> None:
    stack = await bridged(procs, model, 2, *FAST)
    ws = stack.workers
    ws[0].signal(signal.SIGKILL)
    ws[0].proc.wait(5)
    # Heartbeats have not expired yet: the router still lists the dead replica.
    async with stack.openai() as c:
        outs = await asyncio.gather(
            *(c.chat.completions.create(model=model, messages=MSG, max_tokens=5) for _ in range(20))
        )
    assert all(o.choices[0].message.content == expected_text(PROMPT, 5)[0] for o in outs)
    assert ws[1].output().count('"event": "request"') == 20, ws[1].output()


@pytest.mark.stack
async def test_sigterm_drains_a_worker_and_finishes_its_streams(procs: Procs, model: str) -> None:
    stack = await bridged(procs, model, 2, *SLOW)
    ws = stack.workers
    async with stack.openai() as c:
        streams = [
            await c.chat.completions.create(model=model, messages=MSG, max_tokens=50, stream=True)
            for _ in range(6)
        ]
        firsts = [await s.__anext__() for s in streams]
        assert all(f.choices for f in firsts)
        load = await live_replicas(procs.url, model)
        busiest = max(load.values(), key=lambda hb: hb["in_flight"])
        assert busiest["in_flight"] > 0
        victim = next(w for w in ws if w.name.endswith(busiest["replica"].rsplit("-", 1)[1]))
        survivor = next(w for w in ws if w is not victim)
        victim.signal(signal.SIGTERM)
        texts = []
        for s, f in zip(streams, firsts, strict=True):
            text = f.choices[0].delta.content or ""
            finish = None
            async for ch in s:
                for choice in ch.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            assert finish == "length"
            texts.append(text)
        assert all(t == expected_text(PROMPT, 50)[0] for t in texts)
        assert victim.proc.wait(20) == 0
        out = await c.chat.completions.create(model=model, messages=MSG, max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    log = victim.output()
    assert "draining" in log and "service_stopped" in log
    assert survivor.alive()


@pytest.mark.stack
async def test_sigterm_on_the_bridge_finishes_open_streams(procs: Procs, model: str) -> None:
    stack = await bridged(procs, model, 1, *SLOW)
    bridge = stack.bridge
    async with stack.openai() as c:
        s = await c.chat.completions.create(model=model, messages=MSG, max_tokens=40, stream=True)
        text = ""
        async for ch in s:
            if not text:
                bridge.signal(signal.SIGTERM)
            for choice in ch.choices:
                text += choice.delta.content or ""
        assert text == expected_text(PROMPT, 40)[0]
    assert bridge.proc.wait(20) == 0


@pytest.mark.stack
async def test_a_stopping_bridge_says_it_is_not_ready_while_it_still_serves(
    procs: Procs, model: str
) -> None:
    # With bridge.unready_s a load balancer's health check sees 503 first: requests still
    # come in for that long, and the ones open when the bridge stops listening finish.
    stack = await start_stack(
        procs, model, workers=1, worker_args=SLOW, env={"TOKENBUS_BRIDGE__UNREADY_S": "3"}
    )
    bridge = stack.bridge
    async with stack.openai() as c, stack.http() as h:
        s = await c.chat.completions.create(model=model, messages=MSG, max_tokens=60, stream=True)
        text = ""
        async for ch in s:
            if not text:
                bridge.signal(signal.SIGTERM)

                async def unready() -> bool:
                    return (await h.get("/ready")).status_code == 503

                await wait_for(unready, timeout=2, what="/ready saying 503 after SIGTERM")
                # Not ready, still serving: a new request is answered whole.
                late = await c.chat.completions.create(model=model, messages=MSG, max_tokens=3)
                assert late.choices[0].message.content == expected_text(PROMPT, 3)[0]
                assert (await h.get("/health")).status_code == 200
            for choice in ch.choices:
                text += choice.delta.content or ""
        assert text == expected_text(PROMPT, 60)[0]
    assert bridge.proc.wait(30) == 0
    assert "bridge_unready" in bridge.output()


@pytest.mark.stack
async def test_openai_upstream_joins_the_bus_as_a_replica(procs: Procs, model: str) -> None:
    upstream_port = free_port()
    procs.start(
        "upstream",
        "serve",
        "openai-http",
        "--port",
        str(upstream_port),
        "--model",
        "upstream-model",
        *FAST,
    )
    await wait_http(f"http://127.0.0.1:{upstream_port}/ready")
    upstream = ("--backend", "openai", "--upstream-url", f"http://127.0.0.1:{upstream_port}/v1")
    # A worker for a model the upstream does not serve would join and fail every request:
    # it refuses to start instead, at once, naming what the upstream serves.
    bad = start_worker(
        procs, f"{model}-bad", "bad", *upstream, "--upstream-model", "not-served-upstream"
    )
    assert bad.proc.wait(60) == 2, bad.output()
    assert "does not serve the model 'not-served-upstream'" in bad.output()
    assert "it serves 'upstream-model'" in bad.output()
    # Named after tokenbus' own model (no --upstream-model) on an upstream with one model,
    # it serves that one; the README's example names it with --upstream-model.
    stack = await start_stack(procs, model, worker_args=upstream)
    start_worker(procs, f"{model}-named", 0, *upstream, "--upstream-model", "upstream-model")
    await wait_replicas(procs.url, f"{model}-named", 1)
    async with stack.openai() as c:
        for served in (model, f"{model}-named"):
            out = await c.chat.completions.create(model=served, messages=MSG, max_tokens=7)
            assert out.choices[0].message.content == expected_text(PROMPT, 7)[0]
            assert out.usage is not None and out.usage.completion_tokens == 7
        comp = await c.completions.create(model=model, prompt="abc", max_tokens=4)
        assert comp.choices[0].text == expected_text("abc", 4)[0]


@pytest.mark.stack
async def test_several_bridge_processes_share_one_port(procs: Procs, model: str, nc: NATS) -> None:
    stack = await start_stack(procs, model, worker_args=FAST, bridge_args=("--processes", "2"))
    for _ in range(100):
        inbox = nc.new_inbox()
        got: list[Any] = []

        async def cb(m: Any, got: list[Any] = got) -> None:
            got.append(json.loads(m.data))

        sub = await nc.subscribe(inbox, cb=cb)
        await nc.publish("$SRV.PING.tokenbus-bridge", b"", reply=inbox)
        await asyncio.sleep(0.2)
        await sub.unsubscribe()
        if len({g["id"] for g in got}) >= 2:
            break
    assert len({g["id"] for g in got}) == 2
    assert len({g["metadata"]["pid"] for g in got}) == 2
    async with stack.openai() as c:
        outs = await asyncio.gather(
            *(c.chat.completions.create(model=model, messages=MSG, max_tokens=3) for _ in range(20))
        )
    assert len(outs) == 20


@pytest.mark.stack
async def test_status_lists_replicas_and_load(procs: Procs, model: str) -> None:
    start_worker(procs, model, "a", "--max-concurrency", "7", "--tp", "2", "--pool", "big")
    await wait_replicas(procs.url, model, 1)
    out = run_cli("--nats-url", procs.url, "status", "--json", timeout=30, check=True).stdout
    rows = [r for r in json.loads(out)["replicas"] if r["model"] == model]
    assert rows == [
        {
            "replica": f"{model}-a",
            "model": model,
            "backend": "sim",
            "in_flight": 0,
            "running": 0,
            "waiting": 0,
            "max_concurrency": 7,
            "tp": 2,
            "pool": "big",
            # The worker's host: the machine's name (no worker.host, no GPU-host login).
            "host": socket.gethostname(),
            "draining": False,
            "endpoints": ["chat", "completions", "embeddings"],
            "max_model_len": 10**9,  # the suite's sim context (tests/conftest.py)
            # Its flow control (docs/flow.md): nothing waiting, nothing served yet.
            "flow": {
                c: {
                    "queued": 0,
                    "queued_tokens": 0,
                    "running": 0,
                    "served": 0,
                    "shed": 0,
                    "displaced": 0,
                    "wait_s_sum": 0.0,
                }
                for c in ("priority", "default", "flex")
            },
            "flows": {},
            # Its prefix cache reports events (the sim's hashing): kv_aware routes exactly.
            "kv_routing": "exact (text)",
        }
    ]
    table = run_cli("--nats-url", procs.url, "status", timeout=30, check=True).stdout
    assert "REPLICA" in table and f"{model}-a" in table and "0/0/0" in table
    assert "KV_ROUTING" in table and "exact (text)" in table
    # A replica without events (no prefix cache here; the openai backend never has any).
    start_worker(procs, model, "b", "--sim-kv-cache-blocks", "0")
    await wait_replicas(procs.url, model, 2)
    out = run_cli("--nats-url", procs.url, "status", "--json", timeout=30, check=True).stdout
    kinds = {r["replica"]: r["kv_routing"] for r in json.loads(out)["replicas"]}
    assert kinds[f"{model}-b"] == "approximate"


@pytest.mark.stack
def test_status_without_nats_is_a_clear_error(tmp_path: Any) -> None:
    r = run_cli("--nats-url", f"nats://127.0.0.1:{free_port()}", "status", timeout=30)
    assert r.returncode == 1 and "cannot reach NATS" in r.stderr


@pytest.mark.fault
async def test_a_slow_worker_never_hangs_a_request(procs: Procs, model: str) -> None:
    stack = await bridged(procs, model, 1)
    stack.workers[0].signal(signal.SIGSTOP)  # alive for the kernel, silent on the bus
    try:
        async with stack.openai() as c:
            with pytest.raises(openai.APIStatusError) as ei:
                await c.chat.completions.create(model=model, messages=MSG, max_tokens=3)
        assert ei.value.status_code == 503
        assert ei.value.response.headers.get("retry-after") == "1"
    finally:
        stack.workers[0].signal(signal.SIGCONT)


@pytest.mark.stack
async def test_while_nats_is_away_the_bridge_answers_503_at_once_and_recovers(
    private_nats: NatsServer, tmp_path: Path
) -> None:
    model = "nats-away"
    with Procs(private_nats.url, tmp_path) as procs:
        stack = await start_stack(
            procs, model, "ingress", "router", worker_args=("--sim-decode-ms", "20"), settle=0.6
        )
        async with stack.http(timeout=15) as http:
            body = {"model": model, "messages": MSG, "max_tokens": 200, "stream": True}
            # A stream in flight when the server goes: it ends (an error event), not hangs.
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 3:
                            private_nats.stop()
            assert events[-1] == "data: [DONE]" or '"error"' in "".join(events[-2:]), events[-3:]
            # New requests: 503 with Retry-After within about a second, not a held request.
            t0 = time.monotonic()
            r = await http.post(
                "/v1/chat/completions", json={"model": model, "messages": MSG, "max_tokens": 2}
            )
            took = time.monotonic() - t0
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "service_unavailable"
            assert took < 5, took
            assert (await http.get("/ready")).status_code == 503
            private_nats.start()
            for _ in range(100):
                r = await http.post(
                    "/v1/chat/completions", json={"model": model, "messages": MSG, "max_tokens": 2}
                )
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.2)
            assert r.status_code == 200, r.text
        assert stack.all_alive()
