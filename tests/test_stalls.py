"""Stalls: a NATS server or a process that stops answering with its sockets open (SIGSTOP),
the gray failure a crash test never shows (docs/fault-tolerance.md, "Stalls")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.natsconf import role_login
from services.runtime import connect
from tests import netns
from tests.conftest import (
    NatsServer,
    Procs,
    free_port,
    spawn_nats,
    start_stack,
    stop_process,
    wait_for,
    wait_replicas,
)
from tests.lockedbus import UNLIMITED, LockedCluster, create_key
from tests.lockedbus import wait_replicas as wait_cluster_replicas
from tokenbus.launcher import Child, Supervisor

PROMPT: Any = [{"role": "user", "content": "a stall"}]


@pytest.fixture
def paused() -> Iterator[list[int]]:
    """Pids a test paused: continued when it ends, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def pause(pids: list[int], pid: int) -> None:
    pids.append(pid)
    os.kill(pid, signal.SIGSTOP)


async def test_a_connection_leaves_a_paused_node_within_seconds(
    tmp_path: Path, paused: list[int]
) -> None:
    """A service's connection to a node that stops answering (paused: its sockets stay
    open, nothing resets them) moves to another node of the cluster within a few seconds
    (nats-py's defaults took about four minutes), and works there."""
    cluster = LockedCluster(tmp_path / "cluster").start()
    try:
        await cluster.routed()
        nc = await connect(cluster.urls(0), "stall-test", **role_login(cluster.users, "admin"))
        try:
            assert nc.connected_url is not None and nc.connected_url.port == cluster.ports[0]
            t0 = time.monotonic()
            pause(paused, cluster.procs[0].pid)
            await wait_for(
                lambda: nc.is_connected and nc.connected_url.port != cluster.ports[0],
                timeout=20,
                what="not moved off the paused node",
            )
            moved = time.monotonic() - t0
            print(f"\nmoved off the paused node after {moved:.2f} s")
            sub = await nc.subscribe("tb.test.stall")
            await nc.publish("tb.test.stall", b"x")
            assert (await sub.next_msg(timeout=5)).data == b"x"
        finally:
            await nc.close()
    finally:
        os.kill(cluster.procs[0].pid, signal.SIGCONT)
        cluster.stop()


async def _http_load(
    oai: openai.AsyncOpenAI, model: str, want: str | None, seconds: float, clients: int
) -> tuple[Counter[str], list[str]]:
    """``clients`` closed-loop streaming HTTP clients for ``seconds``: outcomes (``ok``:
    the whole answer, right), and the errors' text."""
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop_at:
            try:
                stream: Any = await oai.chat.completions.create(
                    model=model, messages=PROMPT, max_tokens=40, stream=True, timeout=60
                )
                parts = [c.choices[0].delta.content async for c in stream if c.choices]
                text = "".join(p or "" for p in parts)
            except openai.APIError as exc:
                outcomes[getattr(exc, "code", None) or "error"] += 1
                errors.append(repr(exc)[:300])
                continue
            outcomes["ok" if text == want else "wrong_text"] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, errors


async def _key_when_jetstream_answers(cluster: LockedCluster, deadline: float) -> str:
    """A key made through node 1, asked again while JetStream does not answer (its meta or
    the bucket's leader was on the paused node, until the others elect another)."""
    while True:
        try:
            return await create_key(await cluster.admin(1), "during-the-pause", **UNLIMITED)
        except Exception:
            if time.monotonic() > deadline:
                raise


async def test_a_paused_cluster_node_under_the_bridge_fails_next_to_nothing(
    tmp_path: Path, model: str, paused: list[int]
) -> None:
    """A 3-node cluster (buckets with 3 replicas, the auth callout on); the bridge, ingress,
    auth and router connected to node 0, a worker on each node. Node 0 paused under 8
    streaming HTTP clients, for 8 s or until a key made through another node is served: at
    least 99 % of the requests complete whole and right, the
    rest end with a retryable error, none hangs; the stack serves on the two nodes left,
    and a key made there during the pause is let in at once."""
    cluster = LockedCluster(tmp_path / "cluster").start()
    try:
        await cluster.routed()
        key = await cluster.create_key("stall", **UNLIMITED)
        env = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]', "TOKENBUS_KV_REPLICAS": "3"}
        with Procs(cluster.urls(0), tmp_path) as procs:
            stack = await start_stack(
                procs,
                model,
                "ingress",
                "auth",
                "router",
                workers=3,
                worker_args=("--sim-prefill-ms", "5", "--sim-decode-ms", "20"),
                env=env,
                env_for=lambda role, i: {
                    **cluster.env(role),
                    "TOKENBUS_NATS_URL": cluster.urls(i if role == "worker" else 0),
                },
                heartbeats=False,
            )
            await wait_cluster_replicas(cluster, cluster.urls(1), model, 3)
            async with stack.openai(key) as oai:
                ref = await oai.chat.completions.create(model=model, messages=PROMPT, max_tokens=40)
                want = ref.choices[0].message.content
                load = asyncio.create_task(_http_load(oai, model, want, 14.0, 8))
                await asyncio.sleep(2.0)
                t0 = time.monotonic()
                pause(paused, cluster.procs[0].pid)
                # During the pause, once the bridge is on another node: a key made through a
                # healthy node (the key bucket elects a leader there if node 0 led it) is
                # let in at once, and the old key still works.
                await wait_for(
                    lambda: "nats_reconnected" in stack.bridge.output(),
                    timeout=20,
                    what="the bridge did not leave the paused node",
                )
                fresh = await _key_when_jetstream_answers(cluster, deadline=t0 + 30)
                print(f"\na key made {time.monotonic() - t0:.1f} s into the pause")
                async with stack.openai(fresh) as during:
                    out = await during.chat.completions.create(
                        model=model, messages=PROMPT, max_tokens=40, timeout=30
                    )
                assert out.choices[0].message.content == want
                await asyncio.sleep(max(0.0, 8.0 - (time.monotonic() - t0)))
                paused_s = time.monotonic() - t0
                os.kill(cluster.procs[0].pid, signal.SIGCONT)
                outcomes, errors = await load
            total = sum(outcomes.values())
            print(f"\ncluster node under the bridge paused {paused_s:.1f} s: {dict(outcomes)}")
            assert outcomes["ok"] >= 0.99 * total and outcomes["wrong_text"] == 0, (
                outcomes,
                errors[:5],
            )
            assert procs.all_alive()
    finally:
        os.kill(cluster.procs[0].pid, signal.SIGCONT)
        cluster.stop()


async def test_streams_ride_out_a_paused_nats_server(
    tmp_path: Path, model: str, paused: list[int]
) -> None:
    """The only nats-server of the stack paused (until its connections have taken it for
    gone, 2 to 3 s, and half a second more) under streaming HTTP load: no stream is cut and
    every answer is whole and right; a request made while the bridge's connection was down
    is served once the pause ends."""
    srv = NatsServer(tmp_path / "nats").start()
    try:
        with Procs(srv.url, tmp_path) as procs:
            stack = await start_stack(
                procs,
                model,
                "ingress",
                "router",
                workers=2,
                worker_args=("--sim-prefill-ms", "5", "--sim-decode-ms", "20"),
            )
            async with stack.openai() as oai:
                ref = await oai.chat.completions.create(
                    model=model,
                    messages=PROMPT,
                    max_tokens=40,
                )
                want = ref.choices[0].message.content
                load = asyncio.create_task(_http_load(oai, model, want, 9.0, 4))
                await asyncio.sleep(2.0)
                assert srv.proc is not None
                pause(paused, srv.proc.pid)
                # Once the bridge has taken the server for gone (its pings unanswered):
                await wait_for(
                    lambda: "nats_disconnected" in stack.bridge.output(),
                    timeout=20,
                    what="the bridge did not notice the paused server",
                )
                late = asyncio.create_task(
                    oai.chat.completions.create(model=model, messages=PROMPT, max_tokens=40)
                )
                await asyncio.sleep(0.5)
                os.kill(srv.proc.pid, signal.SIGCONT)
                outcomes, errors = await load
                # A request made while the connection was down waited for it, not a 503.
                assert (await late).choices[0].message.content == want
            print(f"\nnats-server paused under load: {dict(outcomes)}")
            assert outcomes["ok"] > 8 and outcomes["ok"] == sum(outcomes.values()), (
                outcomes,
                errors[:3],
            )
            assert procs.all_alive()
    finally:
        srv.stop()


async def test_the_watchdog_restarts_a_paused_process(
    nats_server: NatsServer, tmp_path: Path, paused: list[int]
) -> None:
    """`tokenbus up`'s supervisor kills a child whose loop stopped writing its health file
    (here: paused) and starts it again; a child that is slow to start is left alone."""
    sup = Supervisor(tmp_path / "logs", echo=False, watchdog_s=5.0)
    child = Child(
        "filter",
        [sys.executable, "-m", "tokenbus.cli", "serve", "filter"],
        {"TOKENBUS_NATS_URL": nats_server.url, "TOKENBUS_LOG_LEVEL": "warning"},
    )
    await sup.add(child)
    watch = asyncio.get_running_loop().create_task(sup.watch())
    try:
        health = sup.health_file(child)
        await wait_for(health.exists, timeout=30, what="no health file")
        assert child.proc is not None
        first = child.proc.pid
        pause(paused, first)
        await wait_for(
            lambda: child.proc is not None and child.proc.pid != first and health.exists(),
            timeout=40,
            what="the paused child not restarted",
        )
        assert child.stalls == 1 and child.restarts == 1
        assert child.proc.returncode is None  # the new one runs
    finally:
        watch.cancel()
        await sup.stop(10)


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    if not netns.available():
        pytest.skip("network namespaces cannot be made here (needs root and ip)")
    h = netns.Hosts().start()
    yield h
    h.stop()


async def _stream_text(oai: openai.AsyncOpenAI, model: str, gaps: list[float]) -> str:
    """One streamed answer's text; the longest wait between two of its chunks in ``gaps``."""
    stream: Any = await oai.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=60, stream=True, timeout=60
    )
    parts, last, gap = [], time.monotonic(), 0.0
    async for c in stream:
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
    gaps.append(gap)
    return "".join(parts)


async def test_a_partitioned_worker_host_s_streams_move_to_another(
    hosts: netns.Hosts, tmp_path: Path, model: str
) -> None:
    """Two worker hosts (network namespaces); one's link goes down under streaming HTTP
    load, its sockets open and nothing reset: its streams continue on the other host, whole
    and right, none cut; once the link is back the host reconnects and serves again."""
    w0, w1 = hosts.add("w0"), hosts.add("w1")
    port = free_port()
    srv = spawn_nats(port, "-a", "0.0.0.0", "-p", str(port), "-js", "-sd", str(tmp_path / "js"))
    far = f"nats://{hosts.gateway}:{port}"
    try:
        with Procs(f"nats://127.0.0.1:{port}", tmp_path) as procs:
            args = ("--sim-prefill-ms", "5", "--sim-decode-ms", "20")
            for i, host in enumerate((w0, w1)):
                procs.start(
                    f"worker-{i}",
                    *("serve", "worker", "--model", model, "--replica", f"{model}-{i}", *args),
                    env={"TOKENBUS_NATS_URL": far},
                    prefix=host.prefix(),
                )
            await wait_replicas(procs.url, model, 2)
            stack = await start_stack(procs, model, "ingress", "router", workers=0)
            async with stack.openai() as oai:
                want = await _stream_text(oai, model, [])
                gaps: list[float] = []
                outcomes: Counter[str] = Counter()
                errors: list[str] = []
                stop_at = time.monotonic() + 6.0

                async def client() -> None:
                    while time.monotonic() < stop_at:
                        try:
                            text = await _stream_text(oai, model, gaps)
                        except openai.APIError as exc:
                            outcomes["error"] += 1
                            errors.append(repr(exc)[:300])
                            continue
                        outcomes["ok" if text == want else "wrong_text"] += 1

                load = asyncio.gather(*(client() for _ in range(4)))
                await asyncio.sleep(1.5)
                hosts.cut(w0)
                await load
                print(
                    f"\nworker host partitioned under load: {dict(outcomes)}, longest wait "
                    f"between two chunks {max(gaps):.2f} s"
                )
                assert outcomes["ok"] > 8, outcomes
                assert outcomes["error"] == 0 and outcomes["wrong_text"] == 0, (outcomes, errors)
                hosts.heal(w0)
                # Back on the bus: the host's worker beats again and is routed to.
                await wait_replicas(procs.url, model, 2, timeout=30)
            assert procs.all_alive()
    finally:
        stop_process(srv)
