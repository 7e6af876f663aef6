"""A 3-node NATS cluster on loopback, locked with the auth callout: services and workers on
different nodes, one node killed under load, requests keep being served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus_schemas import errors as E
from services.natsconf import role_login
from tests.lockedbus import UNLIMITED, LockedCluster, serve_when_ready, wait_replicas
from tests.support.procs import Procs, ProcStack, start_stack
from tests.support.waits import wait_for
from tests.test_chaos import EXPECTED, FAST, HB, MAX_TOKENS, MSG, Tally, steady_load
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
            before = tally.outcomes["ok"]
            await load
        tally.report("kill -9 of a cluster node")
        # Served on after the kill (not a throughput, which a loaded machine cuts).
        assert tally.outcomes["ok"] - before >= 16, (before, tally.outcomes)
        assert tally.failed() == 0, (tally.outcomes, tally.errors[:5])
        # The worker that lost its node reconnected to another and still serves.
        assert procs.all_alive()
        assert "nats_reconnected" in stack.workers[2].output()


async def test_a_batch_outlives_a_cluster_node_killed_under_it(
    cluster: LockedCluster, model: str, tmp_path: Path
) -> None:
    """A batch on a 3-node cluster whose JetStream keeps three replicas of everything: node
    2 (where one worker and the second bridge, a runner, are) is killed mid-batch; the
    batch completes through the others, every line answered exactly once."""
    import json

    await cluster.routed()
    key = await cluster.create_key("batches", **UNLIMITED)
    env = {
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
        "TOKENBUS_KV_REPLICAS": "3",
        "TOKENBUS_BATCHES__ACK_WAIT_S": "3",
        **HB,
    }
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": MSG, "max_tokens": 200, "ignore_eos": True},
        }
        for i in range(80)
    ]
    with Procs(cluster.urls(0), tmp_path) as procs:
        await spread_stack(procs, cluster, model, env)
        await serve_when_ready(cluster.url(0), key, model)
        # The second bridge runs lines on node 2 (it fails over when that node dies).
        runner = procs.start(
            "bridge-2",
            "serve",
            "bridge",
            "--port",
            "0",
            env={**env, **cluster.env("bridge"), "TOKENBUS_NATS_URL": cluster.urls(2)},
        )
        async with await Client.connect(cluster.urls(0), api_key=key) as c:
            f = await c.files_create("".join(json.dumps(x) + "\n" for x in lines).encode())
            b = await c.batches_create(f["id"])
            # Its lines run on the bridge on node 2 only until then: no bridge on node 0.
            for _ in range(300):
                cur = await c.batch(b["id"])
                if cur["request_counts"]["completed"] >= 10:
                    break
                await asyncio.sleep(0.1)
            assert cur["status"] == "in_progress", cur
            procs.start(
                "bridge-0",
                "serve",
                "bridge",
                "--port",
                "0",
                env={**env, **cluster.env("bridge"), "TOKENBUS_NATS_URL": cluster.urls(0)},
            )
            cluster.kill(2)
            done = await c.wait_batch(b["id"], timeout=120, poll_s=0.3)
            # The object store may still be electing its leader on the nodes left: a
            # retryable 503, asked again as a client would.
            for _ in range(100):
                try:
                    data = await c.file_content(done["output_file_id"])
                    break
                except E.TokenbusError as exc:
                    if not exc.retryable:
                        raise
                    await asyncio.sleep(0.3)
            out = [json.loads(x) for x in data.splitlines()]
        assert done["status"] == "completed", done
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        assert done["request_counts"] == {"total": 80, "completed": 80, "failed": 0}
        assert runner.alive()
