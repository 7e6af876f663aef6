"""A 3-node NATS cluster on loopback: services and workers on different nodes, one node
killed under load, requests keep being served."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tests.conftest import Procs, free_port, spawn_nats, start_stack
from tests.test_chaos import EXPECTED, FAST, HB, MAX_TOKENS, MSG, Tally, steady_load
from tokenbus import Client


class Cluster:
    def __init__(self, n: int = 3) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.cports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def url(self, i: int) -> str:
        return f"nats://127.0.0.1:{self.ports[i]}"

    def urls(self, first: int) -> str:
        """Node ``first``, then the others (for failover), comma separated."""
        order = [first] + [i for i in range(len(self.ports)) if i != first]
        return ",".join(self.url(i) for i in order)

    def start(self) -> Cluster:
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.cports)
        for i, (port, cport) in enumerate(zip(self.ports, self.cports, strict=True)):
            node = ("-a", "127.0.0.1", "-p", str(port), "-n", f"node{i}")
            cluster = ("--cluster_name", "tokenbus", "--cluster", f"nats://127.0.0.1:{cport}")
            self.procs.append(spawn_nats(port, *node, *cluster, "--routes", routes))
        return self

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster().start()
    yield c
    c.stop()


async def _routed(cluster: Cluster) -> None:
    """Until a message published on node 0 reaches a subscriber on each other node."""
    for i in (1, 2):
        sub_nc = await nats.connect(cluster.url(i))
        pub_nc = await nats.connect(cluster.url(0))
        try:
            sub = await sub_nc.subscribe("tb.test.mesh")
            await sub_nc.flush()
            for _ in range(100):
                await pub_nc.publish("tb.test.mesh", b"x")
                try:
                    await sub.next_msg(timeout=0.1)
                    break
                except nats.errors.TimeoutError:
                    continue
            else:
                raise AssertionError(f"node {i} never joined the cluster")
        finally:
            await sub_nc.close()
            await pub_nc.close()


async def test_a_node_killed_under_load_does_not_stop_the_service(
    cluster: Cluster, model: str, tmp_path: Path
) -> None:
    await _routed(cluster)
    with Procs(cluster.urls(0), tmp_path) as procs:
        # Ingress and router on node 0, one worker on each node.
        stack = await start_stack(
            procs,
            model,
            "ingress",
            "router",
            workers=3,
            worker_args=FAST,
            bridge=False,
            env=HB,
            env_for=lambda role, i: {
                "TOKENBUS_NATS_URL": cluster.urls(i if role == "worker" else 0)
            },
            settle=0.6,
        )
        tally = Tally()
        async with await Client.connect(cluster.urls(0)) as c:
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
