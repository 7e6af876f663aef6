"""A batch on a 3-node NATS cluster on loopback, locked with the auth callout, outliving the
node its runner is on (services on the cluster, nodes killed under load:
tests/test_cluster.py, whose fixture and stack this file shares)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bus_schemas import errors as E
from tests.lockedbus import UNLIMITED, LockedCluster, serve_when_ready
from tests.support.procs import Procs
from tests.support.waits import wait_for
from tests.test_chaos import HB, MSG
from tests.test_cluster import cluster, spread_stack
from tokenbus import Client

pytestmark = pytest.mark.fault

# The 3-node locked cluster of each test's own (a fixture of tests/test_cluster.py).
__all__ = ["cluster"]


async def test_a_batch_outlives_a_cluster_node_killed_under_it(
    cluster: LockedCluster, model: str, tmp_path: Path
) -> None:
    """A batch on a 3-node cluster whose JetStream keeps three replicas of everything: node
    2 (where one worker and the second bridge, a runner, are) is killed mid-batch; the
    batch completes through the others, every line answered exactly once."""
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
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            f: dict[str, Any] = {}

            async def stored() -> bool:
                # The stores open at the first request, each a new stream of three
                # replicas: on a cluster just started its leader may not be elected yet,
                # and the answer is 503 "retry" (CI: once, in a loaded run).
                try:
                    f.update(await c.files_create(data))
                except E.ServiceUnavailable:
                    return False
                return True

            await wait_for(stored, timeout=60, interval=0.5, what="the file never stored")
            b = await c.batches_create(f["id"])
            # Its lines run on the bridge on node 2 only until then: no bridge on node 0.
            cur: dict[str, Any] = {}

            async def ten_done() -> bool:
                cur.update(await c.batch(b["id"]))
                return bool(cur["request_counts"]["completed"] >= 10)

            await wait_for(ten_done, timeout=30, interval=0.1, what="no lines ran on node 2")
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
            got: list[bytes] = []

            async def read_out() -> bool:
                try:
                    got.append(await c.file_content(done["output_file_id"]))
                except E.TokenbusError as exc:
                    if not exc.retryable:
                        raise
                return bool(got)

            await wait_for(read_out, timeout=30, interval=0.3, what="the output never read")
            out = [json.loads(x) for x in got[0].splitlines()]
        assert done["status"] == "completed", done
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        assert done["request_counts"] == {"total": 80, "completed": 80, "failed": 0}
        assert runner.alive()
