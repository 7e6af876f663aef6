"""The nemesis run's processes: every tokenbus process placed on the cluster's hosts,
restartable as it was, supervised (an unplanned exit restarted and noted); and the waits
until the stack serves."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from services.supervisor import Process
from tokenbus.evaluation.nemesis_cluster import SITE_NAMES, Cluster
from tokenbus.evaluation.nemesis_config import MEMBER_ROLES, PIPELINE, PRICE_IN, PRICE_OUT, Config
from tokenbus.evaluation.netns import Hosts
from tokenbus.launcher import free_port


class Proc(Process):
    """A tokenbus process (``python -m tokenbus.cli serve ...``) on a cluster's host,
    restartable as it was."""

    def __init__(self, name: str, role: str, host: int, argv: list[str], env: dict[str, str]):
        super().__init__(name, [sys.executable, "-m", "tokenbus.cli", *argv], env)
        self.role, self.host = role, host
        self.held = False  # down on purpose (a fault): the supervisor leaves it

    def start_in(self, log_dir: Path) -> None:
        self.log = log_dir / f"{self.name}.log"
        self.start()

    def stop(self, timeout: float = 10.0) -> int | None:
        return super().stop(timeout)


class Stack:
    """The cluster and every process of the run, placed on the cluster's hosts (a process on
    host ``i`` connects to node ``i`` first, and fails over to the others)."""

    def __init__(self, cfg: Config, folder: Path, hosts: Hosts | None) -> None:
        from services.natsconf import role_env

        self.cfg = cfg
        self.folder = folder
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Each site's one worker (its replica id the site's login may serve).
        self.site_replicas = {
            site: [f"{cfg.model}-{site}0"] for site in SITE_NAMES[: max(0, cfg.sites)]
        }
        self.cluster = Cluster(folder / "bus", cfg.nodes, hosts, self.site_replicas)
        self.telemetry_db = folder / "telemetry.db"
        n = cfg.nodes
        base = {
            "TOKENBUS_LOG_LEVEL": "info",
            "TOKENBUS_INGRESS__PIPELINE": json.dumps(PIPELINE),
            "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25",
            "TOKENBUS_KV_REPLICAS": str(min(3, n)),
            "TOKENBUS_BATCHES__ACK_WAIT_S": "3",
            "TOKENBUS_TELEMETRY__ACK_WAIT_S": "3",
            "TOKENBUS_NATS_PING_INTERVAL_S": "1",
            "TOKENBUS_DRAIN_TIMEOUT_S": "5",
            "TOKENBUS_ROUTER__PRICE__INPUT": str(PRICE_IN),
            "TOKENBUS_ROUTER__PRICE__OUTPUT": str(PRICE_OUT),
            "TOKENBUS_TELEMETRY__ENABLED": "true",
            "TOKENBUS_WORKER__SIM__MAX_MODEL_LEN": str(10**9),
            # The bridges' deadline is the HTTP clients' own: a request cut off with its
            # bridge and worker holds its spend until then.
            "TOKENBUS_BRIDGE__REQUEST_TIMEOUT_S": str(cfg.deadline_s),
            **cfg.extra_env,
        }
        self.procs: list[Proc] = []
        self.bridge_ports: list[int] = []

        spools = folder / "spool"  # a folder per host

        def add(role: str, name: str, host: int, argv: list[str], env: dict[str, str]) -> None:
            role_of = {"worker": "worker", "bridge": "bridge"}.get(role, role)
            self.procs.append(
                Proc(
                    name,
                    role,
                    host,
                    argv,
                    {
                        **base,
                        **role_env(self.cluster.users, role_of),
                        "TOKENBUS_NATS_URL": self.cluster.urls(host),
                        # The host's own disk: a crashed host's processes, started again,
                        # send what they had not had acknowledged (telemetry/spool.py).
                        "TOKENBUS_TELEMETRY__SPOOL_DIR": str(spools / str(host)),
                        **env,
                    },
                )
            )

        for k, role in enumerate(MEMBER_ROLES):
            for j in range(cfg.per_role):
                add(role, f"{role}-{j}", (j + k) % n, ["serve", role], {})
        sim = [
            "--sim-prefill-ms",
            str(cfg.sim_prefill_ms),
            "--sim-decode-ms",
            str(cfg.sim_decode_ms),
        ]
        for i in range(cfg.workers):
            argv = ["serve", "worker", "--model", cfg.model, "--replica", f"{cfg.model}-{i}", *sim]
            add("worker", f"worker-{i}", i % n, argv, {})
        for site, replicas in self.site_replicas.items():
            # At its site: on the site's node, with the site's workers' login (host -1: on
            # no hub host, so a hub host's crash is not the site's).
            login = self.cluster.site_login(site)
            for replica in replicas:
                argv = ["serve", "worker", "--model", cfg.model, "--replica", replica, *sim]
                env = {
                    "TOKENBUS_NATS_URL": self.cluster.site_url(site),
                    "TOKENBUS_NATS_USER": login["user"],
                    "TOKENBUS_NATS_PASSWORD": login["password"],
                    "TOKENBUS_SITE": site,
                    "TOKENBUS_TELEMETRY__SPOOL_DIR": str(spools / f"site-{site}"),
                }
                add("worker", f"worker-{replica.removeprefix(cfg.model + '-')}", -1, argv, env)
        for i in range(cfg.bridges):
            port = free_port()
            self.bridge_ports.append(port)
            add("bridge", f"bridge-{i}", i % n, ["serve", "bridge", "--port", str(port)], {})
        add(
            "telemetry",
            "telemetry",
            (n - 1) % n,
            ["serve", "telemetry"],
            {
                "TOKENBUS_TELEMETRY__DB_PATH": str(self.telemetry_db),
                "TOKENBUS_TELEMETRY__METRICS_PORT": "0",
            },
        )

    @property
    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.bridge_ports]

    def start(self) -> None:
        self.cluster.start()

    def start_procs(self) -> None:
        for p in self.procs:
            p.start_in(self.log_dir)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.held = True
            p.stop()
        self.cluster.stop()

    async def supervise(self, exits: list[dict[str, Any]], t0: float) -> None:
        """Restart a process that ended without a fault (as `tokenbus up`'s supervisor or a
        container runtime would), noting it: an unplanned exit is a finding of its own."""
        while True:
            await asyncio.sleep(0.5)
            for p in self.procs:
                if p.held or p.proc is None or p.alive():
                    continue
                tail = ""
                if p.log is not None and p.log.exists():
                    lines = p.log.read_text(errors="replace").strip().splitlines()
                    tail = lines[-1][:300] if lines else ""
                exits.append(
                    {
                        "process": p.name,
                        "rc": p.returncode,
                        "t": round(time.monotonic() - t0, 2),
                        "last_line": tail,
                    }
                )
                p.start_in(self.log_dir)


async def retrying(what: str, call: Any, timeout: float = 60.0) -> Any:
    """``call()`` again until it succeeds (a node electing, a stage not up yet), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {exc!r}") from exc
            await asyncio.sleep(0.3)


async def until_routed(cluster: Cluster, timeout: float = 30) -> None:
    """Until JetStream answers (every node joined, a meta leader elected)."""

    async def ask() -> None:
        nc = await cluster.admin(0)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()

    await retrying("JetStream never answered", ask, timeout)


async def create_key(cluster: Cluster, name: str, **fields: Any) -> tuple[str, str]:
    """A new key (its secret, its id), through the admin login."""
    from auth.store import KeyStore

    nc = await cluster.admin(0)
    try:
        store = await KeyStore(nc).open(watch=False)
        key, rec = await store.create(name, **fields)
        return key, rec.id
    finally:
        await nc.close()


async def until_ready(stack: Stack, key: str, timeout: float = 90) -> None:
    """Until a client logging in with ``key`` on each node is served, and every bridge is
    ready and serves a chat request."""
    import httpx

    from tokenbus import Client

    cfg = stack.cfg
    msgs = [{"role": "user", "content": "ready?"}]

    async def nats_ok(i: int) -> None:
        c = await Client.connect(
            stack.cluster.url(i), api_key=key, allow_reconnect=False, max_reconnect_attempts=0
        )
        try:
            await c.chat_completion(cfg.model, msgs, max_tokens=1, timeout=5)
        finally:
            await c.close()

    for i in range(cfg.nodes):
        await retrying(f"node {i} never served", lambda i=i: nats_ok(i), timeout)

    async def http_ok(base: str) -> None:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.post(
                f"{base}/v1/chat/completions",
                json={"model": cfg.model, "messages": msgs, "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
            )
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")

    for base in stack.bases:
        await retrying(f"{base} never served", lambda b=base: http_ok(b), timeout)
    # Every member role's instances answered discovery.
    nc = await stack.cluster.admin(0)
    try:
        want = Counter(p.role for p in stack.procs if p.role in MEMBER_ROLES)
        deadline = time.monotonic() + timeout
        while True:
            seen: dict[str, set[str]] = {r: set() for r in want}
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("$SRV.PING", b"", reply=inbox)
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                try:
                    msg = await sub.next_msg(timeout=max(0.01, end - time.monotonic()))
                except Exception:
                    break
                info = json.loads(msg.data)
                name = str(info.get("name", "")).removeprefix("tokenbus-")
                if name in seen:
                    seen[name].add(str(info.get("id")))
            await sub.unsubscribe()
            if all(len(seen[r]) >= n for r, n in want.items()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every service started: {seen}")
    finally:
        await nc.close()
