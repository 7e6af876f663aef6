"""A 3-node NATS cluster on loopback, locked with the auth callout: services and workers on
different nodes, one node killed under load, requests keep being served (a batch outliving
a killed node: tests/test_cluster_batches.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from services.natsconf import role_login
from tests.lockedbus import UNLIMITED, LockedCluster, serve_when_ready, wait_replicas
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for
from tests.test_chaos import EXPECTED, FAST, HB, MAX_TOKENS, MSG, Tally, served_on, steady_load
from tokenbus import Client

pytestmark = pytest.mark.fault


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LockedCluster]:
    c = LockedCluster(tmp_path / "cluster").start()
    yield c
    c.stop()


async def spread_stack(
    procs: Procs, cluster: LockedCluster, model: str, env: dict[str, str]
) -> ProcStack:
    """Ingress, auth (the callout's only responder) and router on node 0, one worker on
    each node (each fails over to the others), no bridge; once the workers beat."""
    stack = await start_stack(
        procs,
        model,
        "ingress",
        "auth",
        "router",
        workers=3,
        worker_args=FAST,
        bridge=False,
        env=env,
        env_for=lambda role, i: {
            **cluster.env(role),
            "TOKENBUS_NATS_URL": cluster.urls(i if role == "worker" else 0),
        },
        login=role_login(cluster.users, "admin"),
    )
    await wait_replicas(cluster, cluster.urls(0), model, 3)
    return stack


async def test_a_node_killed_under_load_does_not_stop_the_service(
    cluster: LockedCluster, model: str, tmp_path: Path
) -> None:
    await cluster.routed()
    # Every node syncs each write before acknowledging it, as every config tokenbus writes
    # (its node config's jetstream block replaces the included one's whole: the policy is
    # written again there).
    for i in range(len(cluster.addrs)):
        assert cluster.varz(i)["jetstream"]["config"]["sync_always"] is True
    key = await cluster.create_key("cluster", **UNLIMITED)
    with Procs(cluster.urls(0), tmp_path) as procs:
        stack = await spread_stack(
            procs, cluster, model, {"TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]', **HB}
        )
        await serve_when_ready(cluster.url(0), key, model)
        # Until the callout's interest reached nodes 1 and 2 too (a client logging in there
        # is served), then the same as an assertion.
        for i in (1, 2):
            await serve_when_ready(cluster.url(i), key, model)
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
            # The load runs (100 requests served) before the fault, and still runs after.
            await wait_for(
                lambda: tally.outcomes["ok"] >= 100 or load.done(),
                timeout=30,
                what="the load did not get going",
            )
            assert not load.done(), f"the load ended before the kill: {tally.outcomes}"
            cluster.kill(2)  # node 2 and the connection of the worker on it
            before = await served_on(load, tally, 16)
        tally.report("kill -9 of a cluster node")
        # Served on after the kill (not a throughput, which a loaded machine cuts).
        assert tally.outcomes["ok"] - before >= 16, (before, tally.outcomes)
        assert tally.failed() == 0, (tally.outcomes, tally.errors[:5])
        # The worker that lost its node reconnected to another and still serves.
        assert procs.all_alive()
        assert "nats_reconnected" in stack.workers[2].output()
