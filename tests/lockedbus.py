"""The locked bus with the auth callout, for the tests that run whole stacks on it (chaos,
cluster): a nats-server on ``tokenbus nats-config`` output with the callout on (one node, or
a cluster of nodes on configs including it), admin access to the key store, and waits that
log in as admin (a client logged in with an API key does not see heartbeats).

Every stack on this bus runs the ``auth`` service: it answers the callout, so a client can
log in only once an auth instance is up and the client's key is in the store."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS

from auth.store import BUCKET, KeyStore
from services.natsconf import generate, role_env, role_login, write_node_configs
from services.runtime import servers
from services.supervisor import Process
from tests.netns import Host
from tests.support import waits
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tokenbus import Client

PING = [{"role": "user", "content": "ready?"}]
# No limit the tests' load reaches.
UNLIMITED: dict[str, int] = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}


class LockedBus:
    """One nats-server on the generated config with the callout, restartable: the same config
    file on the same port, JetStream (the key store) kept in the config's store_dir."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.conf, self.users = generate(folder, port=self.port, callout=True)
        self.proc: Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> LockedBus:
        self.proc = spawn_nats(self.port, "-c", str(self.conf))
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def env(self, role: str, _index: int = 0) -> dict[str, str]:
        """A service's login (``start_stack(env_for=bus.env)``)."""
        return role_env(self.users, role)

    async def admin(self, url: str | None = None, **kw: Any) -> NATS:
        return await nats.connect(
            servers(url or self.url), dont_randomize=True, **role_login(self.users, "admin"), **kw
        )

    async def create_key(self, name: str, **fields: Any) -> str:
        """A new API key (limits: ``fields``; none by default) in the bus's key store."""
        return await create_key(await self.admin(), name, **fields)

    async def wait_replicas(self, model: str, n: int, timeout: float = 60) -> None:
        await wait_replicas(self, self.url, model, n, timeout)


class LockedCluster:
    """``n`` nats-server nodes routed on loopback, each on a config of its own that includes
    the generated ``nats.conf`` (same accounts, role passwords and callout issuer) and adds
    its server name, listen port, JetStream store and cluster block. Routes carry no auth
    (loopback only)."""

    def __init__(self, folder: Path, n: int = 3, hosts: list[Host] | None = None) -> None:
        # ``hosts``: each node on a host of its own (tests/netns.py), reached at its address
        # from this machine, routed to its peers over their addresses; else on loopback.
        self.hosts = hosts
        self.addrs = [h.addr for h in hosts] if hosts else ["127.0.0.1"] * n
        n = len(self.addrs)
        self.ports = [free_port() for _ in range(n)]
        self.cports = [free_port() for _ in range(n)]
        self.mports = [free_port() for _ in range(n)]
        self.conf, self.users = generate(folder, port=self.ports[0], callout=True)
        self.confs = write_node_configs(
            self.conf,
            self.addrs,
            self.ports,
            self.cports,
            [folder / f"jetstream-{i}" for i in range(n)],
            monitor_ports=self.mports,
        )
        self.procs: list[Process] = []

    def url(self, i: int) -> str:
        return f"nats://{self.addrs[i]}:{self.ports[i]}"

    def urls(self, first: int) -> str:
        """Node ``first``, then the others (for failover), comma separated."""
        order = [first] + [i for i in range(len(self.ports)) if i != first]
        return ",".join(self.url(i) for i in order)

    def start(self) -> LockedCluster:
        for i, (port, conf) in enumerate(zip(self.ports, self.confs, strict=True)):
            prefix = self.hosts[i].prefix() if self.hosts else ()
            self.procs.append(spawn_nats(port, "-c", str(conf), prefix=prefix, host=self.addrs[i]))
        return self

    def varz(self, i: int) -> dict[str, Any]:
        """Node ``i``'s ``/varz`` (its monitoring endpoint)."""
        with urllib.request.urlopen(
            f"http://{self.addrs[i]}:{self.mports[i]}/varz", timeout=5
        ) as r:
            return dict(json.load(r))

    def stream_state(self, i: int, stream: str) -> dict[str, Any]:
        """Node ``i``'s own replica of ``stream`` (its monitoring endpoint): messages,
        first and last sequence."""
        url = f"http://{self.addrs[i]}:{self.mports[i]}/jsz?accounts=true&streams=true"
        with urllib.request.urlopen(url, timeout=5) as r:
            jsz = json.load(r)
        for acc in jsz.get("account_details") or []:
            for st in acc.get("stream_detail") or []:
                if st.get("name") == stream:
                    return dict(st["state"])
        return {}

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(5)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)

    def env(self, role: str, _index: int = 0) -> dict[str, str]:
        return role_env(self.users, role)

    async def admin(self, i: int = 0, **kw: Any) -> NATS:
        return await nats.connect(
            servers(self.urls(i)), dont_randomize=True, **role_login(self.users, "admin"), **kw
        )

    async def routed(self, timeout: float = 60) -> None:
        """Until every node has joined the cluster and JetStream has a meta leader."""
        deadline = time.monotonic() + timeout
        for i in range(1, len(self.ports)):
            sub_nc = await self.admin(i)
            pub_nc = await self.admin(0)
            try:
                sub = await sub_nc.subscribe("tb.test.mesh")
                await sub_nc.flush()
                while True:
                    await pub_nc.publish("tb.test.mesh", b"x")
                    try:
                        await sub.next_msg(timeout=0.1)
                        break
                    except nats.errors.TimeoutError:
                        if time.monotonic() > deadline:
                            raise AssertionError(f"node {i} never joined the cluster") from None
            finally:
                await sub_nc.close()
                await pub_nc.close()
        nc = await self.admin(0)
        try:
            while True:
                try:
                    await nc.jetstream().account_info()
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        finally:
            await nc.close()

    async def create_key(self, name: str, **fields: Any) -> str:
        """A new key; the key store is replicated on every node (it survives a node's loss)."""
        nc = await self.admin(0)
        kv_replicas = len(self.ports)
        await nc.jetstream().create_key_value(bucket=BUCKET, history=1, replicas=kv_replicas)
        return await create_key(nc, name, **fields)


async def create_key(admin: NATS, name: str, **fields: Any) -> str:
    """A key created on ``admin`` (a connection logged in as admin, closed here)."""
    try:
        store = await KeyStore(admin).open(watch=False)
        key, _ = await store.create(name, **fields)
        return key
    finally:
        await admin.drain()


async def live_replicas(
    bus: LockedBus | LockedCluster, url: str, model: str, wait: float = 0.6
) -> dict[str, dict[str, Any]]:
    """Replicas of ``model`` heard within ``wait`` seconds (as admin: the heartbeats are
    not a key's to read)."""
    return await waits.live_replicas(url, model, wait, **role_login(bus.users, "admin"))


async def wait_replicas(
    bus: LockedBus | LockedCluster, url: str, model: str, n: int, timeout: float = 60
) -> None:
    # A bound a loaded machine does not miss: a dozen processes starting at once on 2 busy
    # cores took over 20 s in a full suite run (every log still empty); it returns as soon
    # as they beat.
    await waits.wait_replicas(url, model, n, timeout, **role_login(bus.users, "admin"))


async def serve_when_ready(url: str, key: str, model: str, timeout: float = 60) -> None:
    """Until a client logging in with ``key`` (the callout answered) is served by ``model``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            async with await Client.connect(
                url, api_key=key, allow_reconnect=False, max_reconnect_attempts=0
            ) as tb:
                await tb.chat_completion(model, PING, max_tokens=1, timeout=5)
                return
        except Exception as exc:  # not logged in (auth not up yet) or no replica yet
            last = exc
            await asyncio.sleep(0.2)
    raise AssertionError(f"the stack did not serve a client with a key: {last!r}")
