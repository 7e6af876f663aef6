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
from tests.conftest import NatsServer, Procs, start_stack, wait_for
from tests.lockedbus import LockedCluster
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


async def test_streams_ride_out_a_paused_nats_server(
    tmp_path: Path, model: str, paused: list[int]
) -> None:
    """The only nats-server of the stack paused for 4 s (longer than the 3 s after which
    connections take it for gone) under streaming HTTP load: no stream is cut and every
    answer is whole and right; a request made during the pause is served once it ends."""
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
                outcomes: Counter[str] = Counter()
                errors: list[str] = []
                stop_at = time.monotonic() + 9.0

                async def client() -> None:
                    while time.monotonic() < stop_at:
                        try:
                            stream: Any = await oai.chat.completions.create(
                                model=model,
                                messages=PROMPT,
                                max_tokens=40,
                                stream=True,
                                timeout=60,
                            )
                            text = "".join(
                                [
                                    c.choices[0].delta.content or ""
                                    async for c in stream
                                    if c.choices
                                ]
                            )
                        except openai.APIError as exc:
                            outcomes["error"] += 1
                            errors.append(repr(exc)[:300])
                            continue
                        outcomes["ok" if text == want else "wrong_text"] += 1

                load = asyncio.gather(*(client() for _ in range(4)))
                await asyncio.sleep(2.0)
                assert srv.proc is not None
                pause(paused, srv.proc.pid)
                await asyncio.sleep(3.5)  # the connections have taken the server for gone
                late = asyncio.create_task(
                    oai.chat.completions.create(model=model, messages=PROMPT, max_tokens=40)
                )
                await asyncio.sleep(0.5)
                os.kill(srv.proc.pid, signal.SIGCONT)
                await load
                # A request made while the connection was down waited for it, not a 503.
                assert (await late).choices[0].message.content == want
            print(f"\nnats-server paused 4 s under load: {dict(outcomes)}")
            assert outcomes["ok"] > 8, outcomes
            assert outcomes["error"] == 0 and outcomes["wrong_text"] == 0, (outcomes, errors[:3])
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
