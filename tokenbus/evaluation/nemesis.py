"""``tokenbus bench --nemesis``: mixed traffic on a locked NATS cluster while a scheduler
injects one fault every few seconds, then a check of the invariants that must hold whatever
failed (docs/nemesis.md).

Traffic: streamed chat completions over HTTP (the bridges) and over NATS
(:class:`tokenbus.Client`) from several API keys with budgets and limits, a batch and a
background response. Faults, one at a time, chosen by a seeded random generator (the seed is
printed) and healed before the next: ``kill`` (kill -9 of any tokenbus process, then a
restart), ``pause`` (SIGSTOP, then SIGCONT), ``nats_kill``, ``nats_pause``, ``nats_partition``
(a node's host cut off: its network namespace's link down; only where namespaces can be
made: root and ``ip``) and ``host_crash`` (every process of one host killed, its node's
JetStream store put back to the copy taken at the last sync point, as a lost page cache
would leave it, then everything restarted).

Invariants checked afterwards: every request ended (an answer or one clear error) within
its deadline; no streamed text has a gap or a repeat (the simulator's text is known:
:func:`engine_worker.backends.sim.expected_text`); every batch line answered exactly once;
each key's spend equals its settled usage and no hold is left; every usage record stored
once (the telemetry store, by request id); every key created and acknowledged still exists.

The harness here (the cluster, the processes, the namespaces) is the bench's own: the
package does not import the tests' helpers (tests/lockedbus.py, tests/netns.py), which this
follows."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenbus.evaluation.balancer import Balancer
from tokenbus.evaluation.netns import Hosts, available
from tokenbus.evaluation.options import KINDS
from tokenbus.launcher import free_port, port_open

ROLES = ("ingress", "router", "auth", "ratelimit", "filter", "worker", "bridge", "telemetry")
MEMBER_ROLES = ("ingress", "auth", "ratelimit", "filter", "router")
# Price of the run's model, dollars per million tokens: one micro-dollar per prompt token,
# two per generated token (auth/budgets.py).
PRICE_IN, PRICE_OUT = 1, 2
PIPELINE = ["auth", "ratelimit", "filter", "route"]


@dataclass
class Config:
    duration_s: float = 600.0
    fault_every_s: float = 10.0
    nodes: int = 3
    seed: int | None = None
    kinds: tuple[str, ...] = KINDS
    per_role: int = 2  # instances of each member role (ingress, auth, ratelimit, ...)
    workers: int = 3
    bridges: int = 2
    nats_clients: int = 6
    http_clients: int = 6
    deadline_s: float = 30.0  # every request's own deadline
    batch_lines: int = 40
    pause_s: float = 1.5  # how long a paused process or node stays paused
    partition_s: float = 2.0
    down_s: float = 1.0  # how long a killed node or crashed host stays down
    warmup_s: float = 3.0  # load before the first fault (the "none" window)
    sim_prefill_ms: float = 5.0
    sim_decode_ms: float = 8.0
    model: str = "nemesis-sim"
    run_dir: str = ""
    out: str = ""
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    # What a crashed host's JetStream store keeps. False: what its node synced, which with
    # the nodes' policy (``sync_interval: always``, every config tokenbus writes) is every
    # write it acknowledged. True: only what it held one fault interval before the crash,
    # as a node syncing lazily (nats' own 2 minutes) loses its page cache.
    lost_cache: bool = False
    # HTTP clients through a load balancer with health checks on the bridges' /ready
    # (tokenbus/evaluation/balancer.py, what compose/haproxy.cfg does), not each to one
    # bridge of its own: a crashed host takes none of their new requests with it.
    balancer: bool = True


async def _quiet(exc: Exception) -> None:
    """A NATS connection's error callback: the faults make many, and the outcomes say
    what they cost."""


# -- the cluster -----------------------------------------------------------------------------
class Cluster:
    """``n`` nats-server nodes on the locked config with the auth callout (each node a config
    of its own including the generated one), on loopback or on hosts of their own; each
    node's JetStream store in a folder of its own, with a copy taken at each sync point."""

    def __init__(self, folder: Path, n: int, hosts: Hosts | None) -> None:
        from services.natsconf import generate

        self.folder = folder
        self.hostset = hosts
        self.hosts = [hosts.add(f"n{i}") for i in range(n)] if hosts else []
        self.addrs = [h.addr for h in self.hosts] if hosts else ["127.0.0.1"] * n
        self.ports = [free_port() for _ in range(n)]
        cports = [free_port() for _ in range(n)]
        self.conf, self.users = generate(folder, port=self.ports[0], callout=True)
        routes = ", ".join(
            json.dumps(f"nats://{a}:{p}") for a, p in zip(self.addrs, cports, strict=True)
        )
        self.confs: list[Path] = []
        self.stores = [folder / f"jetstream-{i}" for i in range(n)]
        for i, addr in enumerate(self.addrs):
            conf = folder / f"node{i}.conf"
            cluster = (
                f"cluster {{ name: nemesis, listen: {json.dumps(f'{addr}:{cports[i]}')}, "
                f"routes: [{routes}] }}\n"
                if n > 1
                else ""
            )
            conf.write_text(
                f"include {json.dumps(self.conf.name)}\n"
                f"server_name: node{i}\n"
                f"listen: {json.dumps(f'{addr}:{self.ports[i]}')}\n"
                f"jetstream {{ store_dir: {json.dumps(str(self.stores[i]))} }}\n" + cluster
            )
            self.confs.append(conf)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n

    def url(self, i: int) -> str:
        return f"nats://{self.addrs[i]}:{self.ports[i]}"

    def urls(self, first: int) -> str:
        order = [first] + [i for i in range(len(self.ports)) if i != first]
        return ",".join(self.url(i) for i in order)

    def start_node(self, i: int) -> None:
        from tokenbus.launcher import nats_server_binary

        prefix = self.hosts[i].prefix() if self.hosts else []
        log = open(self.folder / f"node{i}.log", "ab")  # noqa: SIM115 - the child holds it
        self.procs[i] = subprocess.Popen(
            [*prefix, nats_server_binary(), "-c", str(self.confs[i])],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 20
        while not port_open(self.addrs[i], self.ports[i]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats node {i} did not listen")
            time.sleep(0.02)

    def start(self) -> Cluster:
        for i in range(len(self.ports)):
            self.start_node(i)
        return self

    def signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def kill(self, i: int) -> None:
        self.signal(i, signal.SIGKILL)
        p = self.procs[i]
        if p is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)

    def sync_point(self, i: int) -> float:
        """What node ``i``'s store holds on disk after a sync: a copy of it aside, taken
        with the node paused for the moment of the copy (a consistent one); the seconds the
        copy took (the node's pause)."""
        store, p = self.stores[i], self.procs[i]
        if p is None or p.poll() is not None or not store.exists():
            return 0.0
        aside = store.with_name(store.name + ".synced")
        tmp = store.with_name(store.name + ".copying")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        self.signal(i, signal.SIGSTOP)
        try:
            shutil.copytree(store, tmp, symlinks=True)
        except (OSError, shutil.Error):
            shutil.rmtree(tmp, ignore_errors=True)
            return time.monotonic() - t0
        finally:
            self.signal(i, signal.SIGCONT)
        shutil.rmtree(aside, ignore_errors=True)
        tmp.rename(aside)
        return time.monotonic() - t0

    def revert_store(self, i: int) -> bool:
        """Node ``i``'s store back to its last sync point's copy (the node is down); False
        when no sync point was taken yet (the store is emptied: nothing was synced)."""
        store = self.stores[i]
        aside = store.with_name(store.name + ".synced")
        shutil.rmtree(store, ignore_errors=True)
        if aside.exists():
            shutil.copytree(aside, store, symlinks=True)
            return True
        return False

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                self.signal(i, signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    async def admin(self, i: int = 0, **kw: Any) -> Any:
        import nats

        from services.natsconf import role_login
        from services.runtime import servers

        return await nats.connect(
            servers(self.urls(i)),
            dont_randomize=True,
            error_cb=_quiet,
            **role_login(self.users, "admin"),
            **kw,
        )


# -- the processes ---------------------------------------------------------------------------
class Proc:
    """A tokenbus process (``python -m tokenbus.cli serve ...``), restartable as it was."""

    def __init__(self, name: str, role: str, host: int, argv: list[str], env: dict[str, str]):
        self.name, self.role, self.host, self.argv, self.env = name, role, host, argv, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.held = False  # down on purpose (a fault): the supervisor leaves it

    def start(self, log_dir: Path) -> None:
        self.log = log_dir / f"{self.name}.log"
        fh = open(self.log, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenbus.cli", *self.argv],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        fh.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


class Stack:
    """The cluster and every process of the run, placed on the cluster's hosts (a process on
    host ``i`` connects to node ``i`` first, and fails over to the others)."""

    def __init__(self, cfg: Config, folder: Path, hosts: Hosts | None) -> None:
        from services.natsconf import role_env

        self.cfg = cfg
        self.folder = folder
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(folder / "bus", cfg.nodes, hosts)
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
            p.start(self.log_dir)

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
                if p.held or p.proc is None or p.proc.poll() is None:
                    continue
                tail = ""
                if p.log is not None and p.log.exists():
                    lines = p.log.read_text(errors="replace").strip().splitlines()
                    tail = lines[-1][:300] if lines else ""
                exits.append(
                    {
                        "process": p.name,
                        "rc": p.proc.returncode,
                        "t": round(time.monotonic() - t0, 2),
                        "last_line": tail,
                    }
                )
                p.start(self.log_dir)


async def _retrying(what: str, call: Any, timeout: float = 60.0) -> Any:
    """``call()`` again until it succeeds (a node electing, a stage not up yet), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {exc!r}") from exc
            await asyncio.sleep(0.3)


async def _routed(cluster: Cluster, timeout: float = 30) -> None:
    """Until JetStream answers (every node joined, a meta leader elected)."""

    async def ask() -> None:
        nc = await cluster.admin(0)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()

    await _retrying("JetStream never answered", ask, timeout)


async def _create_key(cluster: Cluster, name: str, **fields: Any) -> tuple[str, str]:
    """A new key (its secret, its id), through the admin login."""
    from auth.store import KeyStore

    nc = await cluster.admin(0)
    try:
        store = await KeyStore(nc).open(watch=False)
        key, rec = await store.create(name, **fields)
        return key, rec.id
    finally:
        await nc.close()


async def _ready(stack: Stack, key: str, timeout: float = 90) -> None:
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
        await _retrying(f"node {i} never served", lambda i=i: nats_ok(i), timeout)

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
        await _retrying(f"{base} never served", lambda b=base: http_ok(b), timeout)
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


# -- the load --------------------------------------------------------------------------------
@dataclass
class Outcome:
    rid: str
    via: str  # http | nats | batch | background
    key: str  # the key's name
    window: int
    t0: float
    t1: float = 0.0
    status: str = "open"  # ok | error | hung
    error: str = ""
    text_ok: bool = True
    text_problem: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_cost: int = 0  # what it could have been charged at most (micro-dollars)


def expected(content: str, max_tokens: int) -> str:
    from engine_worker.backends.sim import expected_text

    return expected_text(f"<|user|>{content}\n", max_tokens)[0]


def _check_text(o: Outcome, text: str, want: str) -> None:
    """An answer must be the expected text; a cut one, a prefix of it (no gap, no repeat)."""
    if o.status == "ok" and text != want:
        o.text_ok = False
        o.text_problem = f"got {text[:80]!r}..., want {want[:80]!r}..."
    elif o.status != "ok" and not want.startswith(text):
        o.text_ok = False
        o.text_problem = f"cut answer {text[:80]!r} is not a prefix of {want[:80]!r}"


class Run:
    """The run's state: windows (one per fault), outcomes, keys."""

    def __init__(self, cfg: Config, stack: Stack, rng: random.Random) -> None:
        self.cfg = cfg
        self.stack = stack
        self.rng = rng  # the clients' draws (how many tokens), which follow their pace
        # The faults' own draws: a seed replays the same schedule (kinds, targets) whatever
        # the clients drew meanwhile.
        self.fault_rng = random.Random(rng.random())
        self.t_start = time.monotonic()
        self.windows: list[dict[str, Any]] = [{"kind": "none", "target": "", "t": 0.0}]
        self.outcomes: list[Outcome] = []
        self.keys: dict[str, tuple[str, str]] = {}  # name -> (secret, id)
        self.acked_keys: list[str] = []  # ids of keys created during the run, acknowledged
        self.stop_at = float("inf")
        self.seq = 0
        self.log: list[str] = []
        self.http_bases: list[str] = []  # the balancer's, when there is one

    def now(self) -> float:
        return time.monotonic() - self.t_start

    def say(self, line: str) -> None:
        line = f"[{self.now():7.2f}s] {line}"
        self.log.append(line)
        if not self.cfg.quiet:
            print(line, flush=True)

    def new(self, via: str, key: str) -> Outcome:
        self.seq += 1
        o = Outcome(f"nem{os.getpid()}x{self.seq}", via, key, len(self.windows) - 1, self.now())
        self.outcomes.append(o)
        return o


async def nats_client_loop(run: Run, key_name: str, node: int) -> None:
    from bus_schemas.errors import TokenbusError
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    c = await Client.connect(
        run.stack.cluster.urls(node), api_key=secret, reconnect_time_wait=0.2, error_cb=_quiet
    )
    try:
        while time.monotonic() < run.stop_at:
            mt = run.rng.randint(8, 40)
            o = run.new("nats", key_name)
            content = f"nemesis {o.rid}"
            o.max_cost = 64 * PRICE_IN + mt * PRICE_OUT
            parts: list[str] = []
            stream = c.chat(
                cfg.model,
                [{"role": "user", "content": content}],
                max_tokens=mt,
                timeout=cfg.deadline_s,
                request_id=o.rid,
            )
            try:
                async with asyncio.timeout(cfg.deadline_s + 5):
                    try:
                        async for ch in stream:
                            parts.append(ch.text or "")
                        o.status = "ok"
                    except TokenbusError as exc:
                        o.status, o.error = "error", exc.code
                    finally:
                        with contextlib.suppress(Exception):
                            await stream.aclose()
            except TimeoutError:
                o.status, o.error = "hung", "no end within the deadline"
            o.t1 = run.now()
            if stream.usage is not None:
                o.prompt_tokens = stream.usage.prompt_tokens
                o.completion_tokens = stream.usage.completion_tokens
            _check_text(o, "".join(parts), expected(content, mt))
            # A refused connection (a killed bridge) fails at once: not a tight loop of them.
            await asyncio.sleep(0.02 if o.status == "ok" else 0.2)
    finally:
        with contextlib.suppress(Exception):
            await c.close()


async def http_client_loop(run: Run, key_name: str, bridge: int) -> None:
    import httpx

    cfg = run.cfg
    secret = run.keys[key_name][0]
    bases = run.http_bases or run.stack.bases
    i = bridge
    # The bridge ends a request at its deadline with an error of its own: the client waits
    # past that (as the invariant's 5 s of grace does), or it races the bridge's clock.
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.deadline_s + 5, connect=5)) as h:
        while time.monotonic() < run.stop_at:
            base = bases[i % len(bases)]
            i += 1
            mt = run.rng.randint(8, 40)
            o = run.new("http", key_name)
            content = f"nemesis {o.rid}"
            o.max_cost = 64 * PRICE_IN + mt * PRICE_OUT
            parts: list[str] = []
            body = {
                "model": cfg.model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": mt,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {"Authorization": f"Bearer {secret}", "X-Request-Id": o.rid}
            try:
                async with asyncio.timeout(cfg.deadline_s + 5):
                    async with h.stream(
                        "POST", f"{base}/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        if r.status_code != 200:
                            raw = await r.aread()
                            try:
                                code = json.loads(raw)["error"].get("code") or r.status_code
                            except (ValueError, KeyError, TypeError, AttributeError):
                                code = r.status_code
                            o.status, o.error = "error", f"http_{r.status_code}:{code}"
                        else:
                            o.status = "error"
                            o.error = "stream ended without [DONE]"
                            async for line in r.aiter_lines():
                                if not line.startswith("data: "):
                                    continue
                                data = line[6:].strip()
                                if data == "[DONE]":
                                    if not o.error.startswith("sse_error"):
                                        o.status, o.error = "ok", ""
                                    break
                                obj = json.loads(data)
                                if "error" in obj:
                                    o.error = f"sse_error:{obj['error'].get('code')}"
                                    continue
                                for ch in obj.get("choices") or ():
                                    parts.append((ch.get("delta") or {}).get("content") or "")
                                if obj.get("usage"):
                                    o.prompt_tokens = int(obj["usage"]["prompt_tokens"])
                                    o.completion_tokens = int(obj["usage"]["completion_tokens"])
            except (TimeoutError, httpx.TimeoutException) as exc:
                if isinstance(exc, httpx.ConnectTimeout):
                    o.status, o.error = "error", "connect_timeout"
                else:
                    o.status, o.error = "hung", f"no end within the deadline ({type(exc).__name__})"
            except httpx.HTTPError as exc:
                o.status, o.error = "error", type(exc).__name__
            o.t1 = run.now()
            _check_text(o, "".join(parts), expected(content, mt))
            # A refused connection (a killed bridge) fails at once: not a tight loop of them.
            await asyncio.sleep(0.02 if o.status == "ok" else 0.2)


async def batch_job(run: Run, key_name: str) -> dict[str, Any]:
    """A batch of ``batch_lines`` lines through the NATS client; every line answered once."""
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    lines = {f"line-{i}": (f"batch line {i}", 8 + i % 16) for i in range(cfg.batch_lines)}
    data = "".join(
        json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": cfg.model,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": mt,
                },
            }
        )
        + "\n"
        for cid, (content, mt) in lines.items()
    ).encode()
    o = run.new("batch", key_name)
    o.max_cost = sum(64 * PRICE_IN + mt * PRICE_OUT for _, mt in lines.values())
    res: dict[str, Any] = {"lines": len(lines)}
    c = await Client.connect(
        run.stack.cluster.urls(0), api_key=secret, reconnect_time_wait=0.2, error_cb=_quiet
    )
    try:
        f = await _retrying("batch file", lambda: c.files_create(data), 60)
        b = await _retrying("batch create", lambda: c.batches_create(f["id"]), 60)
        res["id"] = b["id"]
        done = await c.wait_batch(b["id"], timeout=cfg.duration_s + 180, poll_s=1.0)
        res["status"] = done["status"]
        res["request_counts"] = done.get("request_counts")
        seen: Counter[str] = Counter()
        bad_text: list[str] = []
        for fid in (done.get("output_file_id"), done.get("error_file_id")):
            if not fid:
                continue
            content = await _retrying("batch file content", lambda fid=fid: c.file_content(fid))
            for raw in bytes(content).decode().splitlines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                cid = line.get("custom_id")
                seen[cid] += 1
                body = ((line.get("response") or {}).get("body")) or {}
                if line.get("error") is None and body.get("choices"):
                    prompt, mt = lines.get(cid, ("", 0))
                    text = body["choices"][0]["message"].get("content") or ""
                    if text != expected(prompt, mt):
                        bad_text.append(cid)
                    usage = body.get("usage") or {}
                    o.prompt_tokens += int(usage.get("prompt_tokens", 0))
                    o.completion_tokens += int(usage.get("completion_tokens", 0))
        res["missing"] = sorted(set(lines) - set(seen))
        res["repeated"] = sorted(k for k, v in seen.items() if v > 1)
        res["unknown"] = sorted(set(seen) - set(lines))
        res["bad_text"] = bad_text
        o.status = "ok" if done["status"] == "completed" else "error"
        o.error = "" if o.status == "ok" else done["status"]
    except Exception as exc:
        res["error"] = repr(exc)
        o.status, o.error = "error", repr(exc)[:200]
    finally:
        o.t1 = run.now()
        with contextlib.suppress(Exception):
            await c.close()
    return res


async def background_job(run: Run, key_name: str) -> dict[str, Any]:
    """A background response, followed to its end."""
    from tokenbus import Client

    cfg = run.cfg
    secret = run.keys[key_name][0]
    o = run.new("background", key_name)
    o.max_cost = 64 * PRICE_IN + 200 * PRICE_OUT
    res: dict[str, Any] = {}
    c = await Client.connect(run.stack.cluster.urls(1 % cfg.nodes), api_key=secret, error_cb=_quiet)
    try:
        r = await _retrying(
            "background create",
            lambda: c.background_response(cfg.model, "nemesis background", max_output_tokens=200),
        )
        res["id"] = r["id"]
        deadline = time.monotonic() + cfg.duration_s + 180
        while True:
            try:
                cur = await c.get_response(r["id"])
            except Exception as exc:
                if not getattr(exc, "retryable", False) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            if cur["status"] not in ("queued", "in_progress"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"still {cur['status']}")
            await asyncio.sleep(0.5)
        res["status"] = cur["status"]
        usage = cur.get("usage") or {}
        o.prompt_tokens = int(usage.get("input_tokens", 0))
        o.completion_tokens = int(usage.get("output_tokens", 0))
        # incomplete: it ended at max_output_tokens, an answer like any other.
        o.status = "ok" if cur["status"] in ("completed", "incomplete") else "error"
        o.error = "" if o.status == "ok" else str(cur.get("error") or cur["status"])
    except Exception as exc:
        res["error"] = repr(exc)
        o.status, o.error = "error", repr(exc)[:200]
    finally:
        o.t1 = run.now()
        with contextlib.suppress(Exception):
            await c.close()
    return res


async def key_creator(run: Run) -> None:
    """A key created every second or so; the ids of those acknowledged are kept."""
    i = 0
    while time.monotonic() < run.stop_at:
        i += 1
        try:
            async with asyncio.timeout(10):
                _, key_id = await _create_key(run.stack.cluster, f"nemesis-made-{i}")
            run.acked_keys.append(key_id)
        except Exception:
            pass  # not acknowledged: nothing is promised about it
        await asyncio.sleep(1.0)


# -- the faults ------------------------------------------------------------------------------
def choose(run: Run, kinds: list[str]) -> tuple[str, Proc | int]:
    """The next fault: its kind and its target (a process, or a node's index)."""
    kind = run.fault_rng.choice(kinds)
    if kind in ("kill", "pause"):
        return kind, run.fault_rng.choice(run.stack.procs)
    return kind, run.fault_rng.randrange(run.cfg.nodes)


async def inject(run: Run, kind: str, what: Proc | int) -> str:
    """Inject one fault of ``kind`` on ``what`` and heal it; what it hit."""
    cfg, st = run.cfg, run.stack
    cl = st.cluster
    if isinstance(what, Proc):
        p = what
        target = p.name
        run.windows.append({"kind": kind, "target": target, "t": run.now()})
        run.say(f"fault {kind} {target} (host {p.host})")
        if kind == "kill":
            p.held = True
            p.kill()
            await asyncio.sleep(0.3)
            p.start(st.log_dir)
            p.held = False
        else:
            p.signal(signal.SIGSTOP)
            await asyncio.sleep(cfg.pause_s)
            p.signal(signal.SIGCONT)
        return target
    i = what
    target = f"node{i}"
    run.windows.append({"kind": kind, "target": target, "t": run.now()})
    run.say(f"fault {kind} {target}")
    if kind == "nats_kill":
        cl.kill(i)
        await asyncio.sleep(cfg.down_s)
        cl.start_node(i)
    elif kind == "nats_pause":
        cl.signal(i, signal.SIGSTOP)
        await asyncio.sleep(cfg.pause_s)
        cl.signal(i, signal.SIGCONT)
    elif kind == "nats_partition":
        assert cl.hostset is not None
        cl.hostset.cut(cl.hosts[i])
        await asyncio.sleep(cfg.partition_s)
        cl.hostset.heal(cl.hosts[i])
    elif kind == "host_crash":
        victims = [p for p in st.procs if p.host == i]
        for p in victims:
            p.held = True
            p.kill()
        cl.kill(i)
        if cfg.lost_cache:
            reverted = cl.revert_store(i)
            kept = "reverted to the last sync point" if reverted else "emptied (no sync point)"
        else:  # every acknowledged write was synced: the disk holds what the node had
            kept = "as synced (sync_interval: always)"
        run.say(f"  host {i} crashed: {', '.join(p.name for p in victims)} and node{i}; {kept}")
        await asyncio.sleep(cfg.down_s)
        cl.start_node(i)
        for p in victims:
            p.start(st.log_dir)
            p.held = False
    else:
        raise ValueError(kind)
    return target


async def scheduler(run: Run, kinds: list[str]) -> None:
    cfg = run.cfg
    await asyncio.sleep(cfg.warmup_s)
    next_at = time.monotonic()
    upcoming = choose(run, kinds)
    while True:
        if next_at + cfg.fault_every_s > run.stop_at:
            return
        await inject(run, *upcoming)
        # The next fault is chosen now; a host to crash gets its sync point now, a fault
        # interval before its crash (the node pauses while its store is copied aside; only
        # the node about to crash is copied, the others' copies would never be used).
        upcoming = choose(run, kinds)
        kind, node = upcoming
        if kind == "host_crash" and isinstance(node, int) and cfg.lost_cache:
            took = await asyncio.to_thread(run.stack.cluster.sync_point, node)
            run.say(f"  sync point of node{node}'s store ({took:.2f} s paused for the copy)")
        next_at += cfg.fault_every_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


# -- the invariants --------------------------------------------------------------------------
async def check_spend(run: Run) -> dict[str, Any]:
    """Each key's spend against the usage of its answered requests; holds left."""
    from auth.budgets import BUCKET, Budget, SpendBook
    from bus_schemas import subjects

    out: dict[str, Any] = {"keys": {}, "violations": []}
    migrated = _migrated_by_key(run)
    labels = _records_by_label(run)
    nc = await run.stack.cluster.admin(0)
    try:
        # Reports kept for a limiter that died are settled by another within its ack wait.
        out["spend_reports_settled"] = await _consumer_settled(
            nc, subjects.SPEND_STREAM, subjects.SPEND_CONSUMER, 60.0
        )
        if not out["spend_reports_settled"]:
            out["violations"].append("spend reports still unsettled in their stream after 60 s")
        kv = await nc.jetstream().key_value(BUCKET)
        now = time.time()
        for name, (_, key_id) in run.keys.items():
            mine = [o for o in run.outcomes if o.key == name]
            settled = sum(
                o.prompt_tokens * PRICE_IN + o.completion_tokens * PRICE_OUT
                for o in mine
                if o.status == "ok"
            )
            slack = sum(o.max_cost for o in mine if o.status != "ok")
            # A NATS client's migrated request: its lost attempt is charged what its worker
            # produced, which may be more than its caller got (a client's count is never a
            # price, issue 64), at most the attempt's whole cost per migration.
            moved = sum(
                o.max_cost * max((m for _, m in labels.get(o.rid, ())), default=0)
                for o in mine
                if o.status == "ok" and o.via == "nats"
            )
            if name == "jobs":
                # Batch lines and the background response run in the bridges: a moved
                # attempt's lost part is charged what its worker produced (it may have gone
                # on to the end when the cancel was lost with a node), at most the job's
                # largest request's whole cost (the background response's) per migration
                # (seed 55: 576 µ$ over, 6 moved).
                moved += migrated.get(key_id, 0) * (64 * PRICE_IN + 200 * PRICE_OUT)
            slack += moved
            # A request admitted more than once (a NATS client that got no accept in time
            # sends it again, and ingress gives each admission an id of its own): each copy
            # its caller cancelled unread is charged what it ran, at most its whole cost.
            copies = sum(
                o.max_cost * max(0, len({rid for rid, _ in labels.get(o.rid, ())}) - 1)
                for o in mine
                if o.status == "ok"
            )
            slack += copies
            try:
                entry = await _retrying("spend entry", lambda k=key_id: kv.get(f"k.{k}.total"), 30)
                d = json.loads(entry.value or b"{}")
            except Exception as exc:
                d = {"error": repr(exc)}
            spent = int(d.get("spent", 0))
            held = {k: v for k, v in (d.get("held") or {}).items() if float(v[1]) > now}
            # A request that failed (its worker died with it, and it was not moved, or its
            # caller died too) leaves its attempt's hold until the request's deadline: no
            # report comes. Such a hold must stop counting then; an answered request's must
            # be settled by its report.
            # Holds are named by the gateway's request ids: those of each answered request's
            # records (and the harness's own id, where a record is missing).
            answered = {o.rid for o in mine if o.status == "ok"}
            answered |= {rid for o in answered for rid, _ in labels.get(o, ())}
            of_answered = {k: v for k, v in held.items() if k.partition("#")[0] in answered}
            expiring = {k: v for k, v in held.items() if k not in of_answered}
            row: dict[str, Any] = {
                "spent": spent,
                "answered_usage_cost": settled,
                "unanswered_max_cost": slack - moved,
                "migrated_nats_max_extra": moved,
                "holds_left": len(of_answered),
                "holds_of_failed_requests": len(expiring),
                "requests": len(mine),
                "answered": sum(o.status == "ok" for o in mine),
                # Requests moved to another replica mid-answer (telemetry's record).
                "migrated": migrated.get(key_id, 0),
            }
            out["keys"][name] = row
            if spent < settled:
                out["violations"].append(
                    f"{name}: spent {spent} < the usage of its answered requests {settled} "
                    f"(undercharged by {settled - spent})"
                )
            elif spent > settled + slack:
                out["violations"].append(
                    f"{name}: spent {spent} > answered usage {settled} + the most its "
                    f"unanswered requests could cost {slack} (overcharged)"
                )
            if of_answered:
                out["violations"].append(
                    f"{name}: {len(of_answered)} holds of answered requests left after every "
                    f"request ended: {sorted(of_answered)[:5]}"
                )
            if expiring:
                # Past their deadlines they must not count against the budget any more
                # (checked for those due within a request's deadline from now).
                by_rid = {o.rid: o for o in mine}
                row["failed_holds"] = {
                    k: {
                        "due_in_s": round(float(v[1]) - now, 1),
                        "via": getattr(by_rid.get(k.partition("#")[0]), "via", ""),
                        "error": getattr(by_rid.get(k.partition("#")[0]), "error", ""),
                    }
                    for k, v in expiring.items()
                }
                due = [
                    float(v[1]) for v in expiring.values() if v[1] <= now + run.cfg.deadline_s + 5
                ]
                last = max(due, default=now)
                await asyncio.sleep(max(0.0, last - time.time()) + 0.5)
                book = await SpendBook(nc).open()
                _, in_flight = await book.spent(Budget(f"k.{key_id}", "total", None, None))
                row["held_after_their_deadlines"] = in_flight
                if in_flight:
                    out["violations"].append(
                        f"{name}: {in_flight} µ$ still held past every request's deadline"
                    )
    finally:
        await nc.close()
    return out


async def _consumer_settled(nc: Any, stream: str, consumer: str, timeout: float) -> bool:
    """Until a durable consumer has nothing pending or unacknowledged (bounded): what a
    killed consumer had taken comes back within its ack wait, and is done then."""
    js = nc.jetstream(timeout=5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            info = await js.consumer_info(stream, consumer)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return True
        await asyncio.sleep(0.2)
    return False


def _store_rows(run: Run, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query of the run's telemetry store (read-only); none without a store."""
    db = run.stack.telemetry_db
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.Error:
        return []
    finally:
        con.close()


def _records_by_label(run: Run) -> dict[str, list[tuple[str, int]]]:
    """Each client request id (the label the harness gave its requests) -> the gateway's ids
    its records were stored under and the migrations each record saw (the gateway gives every
    request an id of its own; a migration it cannot prove by a ticket gets another)."""
    out: dict[str, list[tuple[str, int]]] = {}
    sql = "SELECT client_request_id, request_id, COALESCE(migrations, 0) FROM requests"
    for label, rid, migrations in _store_rows(run, sql):
        if label:
            out.setdefault(str(label), []).append((str(rid), int(migrations)))
    return out


def _migrated_by_key(run: Run) -> dict[str, int]:
    """Requests of the run that moved to another replica mid-answer, per key id (from the
    telemetry store's records; empty when there is none)."""
    sql = "SELECT principal, COUNT(*) FROM requests WHERE migrations > 0 GROUP BY principal"
    return {str(p): int(n) for p, n in _store_rows(run, sql)}


async def check_keys(run: Run) -> dict[str, Any]:
    from auth.store import KeyStore
    from bus_schemas import errors as E

    ids = [kid for _, kid in run.keys.values()] + run.acked_keys
    missing: list[str] = []
    nc = await run.stack.cluster.admin(0)
    try:
        store = await _retrying("key store", lambda: KeyStore(nc).open(watch=False), 30)
        for kid in ids:
            try:
                await _retrying(
                    f"key {kid}",
                    lambda kid=kid: store.get(kid),
                    15,
                )
            except RuntimeError as exc:
                if isinstance(exc.__cause__, E.NotFound):
                    missing.append(kid)
                else:
                    missing.append(f"{kid} ({exc.__cause__!r})")
    finally:
        await nc.close()
    return {"checked": len(ids), "created_during_run": len(run.acked_keys), "missing": missing}


async def _records_in_stream(nc: Any, missing: set[str]) -> dict[str, Any]:
    """Where the records of requests missing from the store went: how many of them the
    records' stream holds (then the consumer lost them) and by which publisher, read with
    an ephemeral ordered consumer from the stream's start."""
    from bus_schemas import codec
    from telemetry import records as R

    js = nc.jetstream(timeout=5)
    found: dict[str, set[str]] = {}
    seen = 0
    try:
        info = await js.stream_info(R.STREAM)
        last = info.state.last_seq
        sub = await js.subscribe(R.subject(), ordered_consumer=True, stream=R.STREAM)
        try:
            while seen < last:
                msg = await sub.next_msg(timeout=5)
                seen = msg.metadata.sequence.stream
                with contextlib.suppress(Exception):
                    for rec in R.batch(codec.decode_map(msg.data)):
                        rid = rec.get("client_request_id") if isinstance(rec, dict) else None
                        if rid in missing:
                            found.setdefault(rid, set()).add(str(rec.get("source")))
        finally:
            await sub.unsubscribe()
    except Exception as exc:
        return {"error": repr(exc), "read_to_seq": seen}
    by: Counter[str] = Counter("+".join(sorted(v)) for v in found.values())
    return {
        "in_stream": len(found),
        "not_in_stream": len(missing) - len(found),
        "in_stream_by_source": dict(by),
        "not_in_stream_sample": sorted(missing - set(found))[:5],
    }


def check_records(run: Run) -> dict[str, Any]:
    """Every answered request's record in the telemetry store once (by the client's request
    id, the label its records carry: the gateway gives each request an id of its own)."""
    rids = [o.rid for o in run.outcomes if o.via in ("http", "nats") and o.status == "ok"]
    db = run.stack.telemetry_db
    if not db.exists():
        return {"store": str(db), "error": "no telemetry store", "answered": len(rids)}
    labels = _records_by_label(run)
    missing = [r for r in rids if not labels.get(r)]
    # A request has a row per gateway id it was given (a resend or a migration no ticket
    # proved is given another); one id stored twice is a record stored twice.
    repeated = [r for r in rids if len({i for i, _ in labels.get(r, ())}) != len(labels.get(r, ()))]
    return {
        "store": "sqlite (telemetry/store.py, one row per request, by its client's label)",
        "answered": len(rids),
        "stored": len(rids) - len(missing),
        "missing": len(missing),
        "missing_sample": missing[:5],
        "missing_ids": missing,
        "repeated": len(repeated),
    }


async def invariants(
    run: Run, batch: dict[str, Any], background: dict[str, Any]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, violations: list[str], detail: Any = None, known: bool = False) -> None:
        out.append(
            {
                "name": name,
                "ok": not violations,
                "violations": len(violations),
                "examples": violations[:5],
                "detail": detail,
                **({"known_gap": True} if known else {}),
            }
        )

    cfg = run.cfg
    hung = [o for o in run.outcomes if o.status in ("hung", "open")]
    late = [
        o
        for o in run.outcomes
        if o.via in ("http", "nats") and o.status != "hung" and o.t1 - o.t0 > cfg.deadline_s + 5
    ]
    add(
        "every request ended within its deadline",
        [f"{o.rid} ({o.via}, window {o.window}): {o.status} {o.error}" for o in hung + late],
        {"hung": len(hung), "late": len(late)},
    )
    bad = [o for o in run.outcomes if not o.text_ok]
    add(
        "no streamed text has a gap or a repeat",
        [f"{o.rid} ({o.via}, {o.status}): {o.text_problem}" for o in bad]
        + [f"batch line {cid}: wrong text" for cid in batch.get("bad_text", [])],
    )
    bv = []
    if "error" in batch:
        bv.append(f"the batch did not end: {batch['error']}")
    for k in ("missing", "repeated", "unknown"):
        if batch.get(k):
            bv.append(f"batch lines {k}: {batch[k][:10]}")
    add("every batch line answered exactly once", bv, batch)
    bgv = [f"background response: {background['error']}"] if "error" in background else []
    add("the background response ended", bgv, background)
    spend = await check_spend(run)
    add("spend equals settled usage, no hold left", spend["violations"], spend["keys"])
    from bus_schemas import subjects

    nc = await run.stack.cluster.admin(0)
    try:  # records a killed telemetry service had taken are stored by the next one
        settled = await _consumer_settled(
            nc, subjects.RECORDS_STREAM, subjects.RECORDS_CONSUMER, 60
        )
        rec = {**check_records(run), "records_consumer_settled": settled}
        if rec.get("missing"):
            rec["missing_where"] = await _records_in_stream(nc, set(rec["missing_ids"]))
    finally:
        await nc.close()
    rec.pop("missing_ids", None)
    recv = []
    if rec.get("error"):
        recv.append(rec["error"])
    if rec.get("missing"):
        recv.append(f"{rec['missing']} answered requests have no record: {rec['missing_sample']}")
    if rec.get("repeated"):
        recv.append(f"{rec['repeated']} request ids stored more than once")
    add("every usage record stored once", recv, rec)
    keys = await check_keys(run)
    add(
        "keys created and acknowledged still exist",
        [f"key {k} is gone" for k in keys["missing"]],
        keys,
    )
    return out


def per_kind(run: Run) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for w in run.windows:
        r = rows.setdefault(
            w["kind"], {"faults": 0, "sent": 0, "completed": 0, "failed": 0, "hung": 0}
        )
        r["faults"] += w["kind"] != "none"
    for o in run.outcomes:
        if o.via not in ("http", "nats"):
            continue
        r = rows[run.windows[o.window]["kind"]]
        r["sent"] += 1
        r["completed"] += o.status == "ok"
        r["failed"] += o.status == "error"
        r["hung"] += o.status in ("hung", "open")
    for r in rows.values():
        r["availability"] = round(r["completed"] / r["sent"], 4) if r["sent"] else None
    return rows


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{'fault kind':<16}{'faults':>7}{'sent':>7}{'done':>7}{'failed':>7}"
        f"{'hung':>6}{'avail':>8}"
    )
    for kind, r in report["per_kind"].items():
        av = "-" if r["availability"] is None else f"{r['availability']:.3f}"
        print(
            f"{kind:<16}{r['faults']:>7}{r['sent']:>7}{r['completed']:>7}{r['failed']:>7}"
            f"{r['hung']:>6}{av:>8}"
        )
    print("\ninvariants:")
    for inv in report["invariants"]:
        mark = "ok  " if inv["ok"] else "FAIL"
        print(f"  {mark} {inv['name']}" + ("" if inv["ok"] else f": {inv['violations']}"))
        for ex in inv["examples"]:
            print(f"         {ex}")
    for when, rows in report["unplanned_exits"].items():
        for x in rows:
            print(f"unplanned exit ({when}): {x['process']} rc={x['rc']} at {x['t']} s")
    errs = report["errors"]
    if errs:
        print("\nerrors seen:", ", ".join(f"{k} x{v}" for k, v in errs.items()))
    print(f"\nseed {report['seed']}; {report['violations']} invariant violations")


# -- the run ---------------------------------------------------------------------------------
async def run_nemesis(cfg: Config) -> dict[str, Any]:
    """The whole run: start, load and faults, invariants; the report (also written to
    ``cfg.out`` when set)."""
    seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
    rng = random.Random(seed)
    kinds = list(cfg.kinds)
    skipped: dict[str, str] = {}
    if "nats_partition" in kinds and not available():
        kinds.remove("nats_partition")
        skipped["nats_partition"] = "no network namespaces here (needs root and ip)"
    if cfg.nodes < 2:
        for k in ("host_crash",):
            if k in kinds:
                kinds.remove(k)
                skipped[k] = "one node: a reverted store has no peer to catch up from"
    if not kinds:
        raise ValueError("no fault kind left to inject")
    folder = Path(cfg.run_dir or tempfile.mkdtemp(prefix="tokenbus-nemesis-"))
    folder.mkdir(parents=True, exist_ok=True)
    if not cfg.quiet:
        print(f"nemesis: seed {seed}, kinds {kinds}, skipped {skipped or 'none'}, logs {folder}")
    hosts = Hosts().start() if "nats_partition" in kinds else None
    stack: Stack | None = None
    lb: Balancer | None = None
    try:
        stack = Stack(cfg, folder, hosts)
        stack.start()
        await _routed(stack.cluster)
        # The key store replicated on every node before anything opens it.
        from auth.store import BUCKET as KEYS

        nc = await stack.cluster.admin(0)
        try:
            await nc.jetstream().create_key_value(
                bucket=KEYS, history=1, replicas=min(3, cfg.nodes)
            )
        finally:
            await nc.close()
        run = Run(cfg, stack, rng)
        limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 1000}
        budget = {"budget_usd": 1000.0, "budget_period": "total"}
        for name in ("alpha", "beta", "gamma", "jobs"):
            run.keys[name] = await _create_key(stack.cluster, name, **limits, **budget)
        stack.start_procs()
        exits: list[dict[str, Any]] = []
        supervisor = asyncio.create_task(stack.supervise(exits, time.monotonic()))
        await _ready(stack, run.keys["alpha"][0])
        if cfg.balancer and len(stack.bridge_ports) > 1:
            lb = Balancer.of(stack.bridge_ports, check_every_s=0.5)
            run.http_bases = [f"http://127.0.0.1:{await lb.start()}"]
        start_exits = len(exits)
        run.t_start = time.monotonic()
        run.stop_at = time.monotonic() + cfg.duration_s
        run.say(f"stack ready: {len(stack.procs)} processes on {cfg.nodes} nodes")
        loaders = [
            nats_client_loop(run, ("alpha", "beta", "gamma")[i % 3], i % cfg.nodes)
            for i in range(cfg.nats_clients)
        ] + [
            http_client_loop(run, ("beta", "gamma", "alpha")[i % 3], i)
            for i in range(cfg.http_clients)
        ]
        tasks = [asyncio.create_task(x) for x in loaders]
        tasks.append(asyncio.create_task(key_creator(run)))
        batch_t = asyncio.create_task(batch_job(run, "jobs"))
        bg_t = asyncio.create_task(background_job(run, "jobs"))
        await scheduler(run, kinds)
        await asyncio.gather(*tasks, return_exceptions=True)
        batch, background = await batch_t, await bg_t
        run.say("load over; checking invariants")
        await asyncio.sleep(2.0)  # the last usage reports and records land
        supervisor.cancel()
        invs = await invariants(run, batch, background)
        errors = Counter(o.error.split(":")[0] for o in run.outcomes if o.status == "error")
        report: dict[str, Any] = {
            "tool": "tokenbus bench --nemesis",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "seed": seed,
            "config": {k: v for k, v in asdict(cfg).items() if k != "extra_env"},
            "kinds": kinds,
            "skipped_kinds": skipped,
            "faults": run.windows[1:],
            "per_kind": per_kind(run),
            "requests": {
                "sent": sum(o.via in ("http", "nats") for o in run.outcomes),
                "completed": sum(
                    o.via in ("http", "nats") and o.status == "ok" for o in run.outcomes
                ),
            },
            "errors": dict(errors.most_common()),
            # Processes that ended without a fault and were restarted (during the start, then
            # during the run): not an invariant, a finding each.
            "unplanned_exits": {"start": exits[:start_exits], "run": exits[start_exits:]},
            "invariants": invs,
            "violations": sum(i["violations"] for i in invs),
            "hung": sum(o.status in ("hung", "open") for o in run.outcomes),
            # HTTP clients' connections the balancer tried on another bridge (refused by a
            # crashed or restarting one), and those no bridge took.
            "balancer": None if lb is None else {"retried": lb.retried, "refused": lb.refused},
            "logs": str(folder),
        }
        if cfg.out:
            Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out).write_text(json.dumps(report, indent=2))
        if not cfg.quiet:
            print_table(report)
        return report
    finally:
        if lb is not None:
            await lb.stop()
        if stack is not None:
            stack.stop()
        if hosts is not None:
            hosts.stop()


async def run_from_args(a: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in a.nemesis_faults.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: unknown fault kinds {unknown}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    out = a.out or f"bench-results/nemesis-{time.strftime('%Y%m%d-%H%M%S')}.json"
    cfg = Config(
        duration_s=a.nemesis_duration,
        fault_every_s=a.fault_every,
        nodes=a.nemesis_nodes,
        seed=a.nemesis_seed,
        kinds=kinds,
        model=a.model,
        out=out,
        lost_cache=a.nemesis_lost_cache,
        balancer=not a.nemesis_no_balancer,
    )
    report = await run_nemesis(cfg)
    print(f"results: {out}")
    return 0 if report["violations"] == 0 and report["hung"] == 0 else 1
