"""A 3-node NATS cluster on loopback, locked with the auth callout: services and workers on
different nodes, one node killed under load, requests keep being served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tests.conftest import Procs, start_stack
from tests.lockedbus import UNLIMITED, LockedCluster, serve_when_ready, wait_replicas
from tests.test_chaos import EXPECTED, FAST, HB, MAX_TOKENS, MSG, Tally, steady_load
from tokenbus import Client


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LockedCluster]:
    c = LockedCluster(tmp_path / "cluster").start()
    yield c
    c.stop()


async def test_a_node_killed_under_load_does_not_stop_the_service(
    cluster: LockedCluster, model: str, tmp_path: Path
) -> None:
    await cluster.routed()
    key = await cluster.create_key("cluster", **UNLIMITED)
    with Procs(cluster.urls(0), tmp_path) as procs:
        # Ingress, auth (the callout's only responder) and router on node 0, one worker on
        # each node.
        stack = await start_stack(
            procs,
            model,
            "ingress",
            "auth",
            "router",
            workers=3,
            worker_args=FAST,
            bridge=False,
            env={"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]', **HB},
            env_for=lambda role, i: {
                **cluster.env(role),
                "TOKENBUS_NATS_URL": cluster.urls(i if role == "worker" else 0),
            },
            heartbeats=False,
        )
        await wait_replicas(cluster, cluster.urls(0), model, 3)
        await serve_when_ready(cluster.url(0), key, model)
        await asyncio.sleep(0.6)
        # A key logging in on node 1 or 2 is let in by the auth service on node 0 (the
        # callout crosses the cluster); an unknown one is refused there too.
        for i in (1, 2):
            async with await Client.connect(cluster.url(i), api_key=key) as c:
                out = await c.chat_completion(model, MSG, max_tokens=MAX_TOKENS)
                assert out.text == EXPECTED
            with pytest.raises(Exception, match="Authorization"):
                await nats.connect(
                    cluster.url(i),
                    token="tb-000000000000_nope",
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                )
        tally = Tally()
        async with await Client.connect(cluster.urls(0), api_key=key) as c:
            out = await c.chat_completion(model, MSG, max_tokens=MAX_TOKENS)
            assert out.text == EXPECTED
            load = asyncio.create_task(steady_load(c, model, 4.0, tally))
            await asyncio.sleep(1.5)
            cluster.kill(2)  # node 2 and the connection of the worker on it
            await load
        tally.report("kill -9 of a cluster node")
        assert tally.outcomes["ok"] > 200, tally.outcomes
        assert tally.failed() == 0, (tally.outcomes, tally.errors[:5])
        # The worker that lost its node reconnected to another and still serves.
        assert procs.all_alive()
        assert "nats_reconnected" in stack.workers[2].output()
