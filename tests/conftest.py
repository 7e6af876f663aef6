"""Shared fixtures: a real nats-server on a random port, services in-process, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from auth.limits import WINDOW_S
from auth.store import KeyStore
from bus_schemas import codec, subjects
from services import config
from services import logging as tlog
from services.natsconf import jetstream_block
from services.runtime import servers
from tokenbus import Client
from tokenbus.launcher import free_port as launcher_free_port
from tokenbus.launcher import nats_server_binary, port_open

tlog.setup("warning")

# The simulated model's context (8192 tokens by default) would refuse the very long streams
# many tests use to keep a request running; the tests of the context limit set their own.
os.environ.setdefault("TOKENBUS_WORKER__SIM__MAX_MODEL_LEN", str(10**9))

ROOT = Path(__file__).resolve().parent.parent


# The test files that take longest (seconds of one worker, measured with --durations=0 in
# `make test`'s run: docs/testing.md), in that order. `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder): these go out first,
# so that none of them is still running alone on one worker when the others are done.
SLOWEST_FILES = [
    "test_cli.py",  # 176
    "test_conformance_openapi.py",  # 173
    "test_stalls.py",  # 149
    "test_fuzz_openapi.py",  # 95
    "test_chaos.py",  # 92
    "test_migration.py",  # 79
    "test_readme.py",  # 72
    "test_upstream_caps.py",  # 64
    "test_flow_e2e.py",  # 63
    "test_processes.py",  # 55
    "test_fuzz_nats.py",  # 52
    "test_bench_tenants.py",  # 36
    "test_cluster.py",  # 35
    "test_batches.py",  # 33
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first (:data:`SLOWEST_FILES`), every other file after them in its
    usual order; the tests of a file keep theirs (a sort that keeps equal keys in place)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    check: bool = False,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``tokenbus <args>`` (as ``python -m tokenbus.cli``) the way a user would."""
    return subprocess.run(
        [sys.executable, "-m", "tokenbus.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=timeout,
        check=check,
    )


def children_of(pid: int) -> dict[int, str]:
    """The live processes whose parent is ``pid``, with their command lines (from /proc):
    a test ends only the processes it started, never a match of a pattern across the
    machine, which on a shared host may be another stack's."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        # The parent is the second field after the command name, which may hold spaces.
        if int(stat.rpartition(")")[2].split()[1]) == pid and cmd:
            out[int(entry.name)] = cmd
    return out


def child_matching(pid: int, needle: str) -> int | None:
    """The child of ``pid`` whose command line holds ``needle``, if one is alive."""
    return next((c for c, cmd in children_of(pid).items() if needle in cmd), None)


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on, for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    """A port for a server a test starts (:func:`tokenbus.launcher.free_port`: outside the
    ephemeral range, so no client's connection takes it before the server binds it)."""
    return launcher_free_port()


def wait_port(
    port: int,
    timeout: float = 10,
    host: str = "127.0.0.1",
    proc: subprocess.Popen[bytes] | None = None,
) -> bool:
    """Until something listens on ``port`` (a server just started): True; False as soon as
    ``proc`` (the server) exited. Raises when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")


def spawn_nats(
    port: int, *args: str, prefix: Sequence[str] = (), host: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    """A nats-server process with ``args``, once it listens on ``host``:``port``
    (``prefix``: what runs it elsewhere, ``ip netns exec <host>``)."""
    # Until it listens, or it exits (a port taken, a bad config: said with its own words),
    # or a minute passes (a loaded machine starting a JetStream store).
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [*prefix, nats_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            if wait_port(port, 60, host, proc):
                return proc
        except RuntimeError:
            pass
        proc.kill()
        proc.wait(5)
        err.seek(0)
        said = err.read().decode(errors="replace")[-2000:]
        raise RuntimeError(f"nats-server did not listen on {host}:{port}: {said}")


TEST_SYNC = "2m"  # the test servers' JetStream sync interval (NatsServer.start)


class NatsServer:
    """A real nats-server process with JetStream, on a free port."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        # JetStream from the block the configs tokenbus writes have, but syncing lazily
        # (nats-server's own 2 minutes): no test loses a machine's page cache (the nemesis
        # bench simulates that itself), so a sync per write would only load the shared disk
        # under four workers. That the configs tokenbus writes sync every write is
        # tests/test_durability.py's to check.
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir.parent / f"{self.data_dir.name}.conf"
        conf.write_text(jetstream_block(str(self.data_dir), TEST_SYNC))
        args = ("-c", str(conf), "-a", "127.0.0.1", "-p", str(self.port))
        self.proc = spawn_nats(self.port, *args)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield srv
    srv.stop()


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of this test's own, for tests that need an empty bus."""
    srv = NatsServer(tmp_path / "nats").start()
    yield srv
    srv.stop()


def new_model() -> str:
    """A model name of its own, so tests sharing a bus do not see each other."""
    return f"m-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def model() -> str:
    """A model name of this test's own."""
    return new_model()


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A tokenbus client connected to the shared bus (closed after the test)."""
    c = await Client.connect(nats_server.url)
    async with c:
        yield c


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A bare NATS connection to the shared bus, for what the client never sends."""
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.drain()


@contextlib.asynccontextmanager
async def key_store(url: str, *, watch: bool = True) -> AsyncIterator[KeyStore]:
    """The API-key store on the bus at ``url``, on a connection of its own, for the block."""
    conn = await nats.connect(url)
    try:
        store = await KeyStore(conn).open(watch=watch)
        try:
            yield store
        finally:
            await store.close()
    finally:
        await conn.drain()


@pytest.fixture
async def keys(nats_server: NatsServer) -> AsyncIterator[KeyStore]:
    """The API-key store on the shared bus (its connection is ``keys.nc``)."""
    async with key_store(nats_server.url) as store:
        yield store


def settings(url: str, **over: Any) -> config.Settings:
    over.setdefault("log_level", "warning")
    over.setdefault("ingress", {"pipeline": ["route"]})
    over.setdefault("drain_timeout_s", 10.0)
    return config.load(nats_url=url, **over)


@contextlib.asynccontextmanager
async def stack(
    url: str,
    model: str,
    *,
    workers: int = 2,
    with_ingress: bool = True,
    with_router: bool = True,
    auths: int = 0,
    ratelimits: int = 0,
    filters: int = 0,
    worker: dict[str, Any] | None = None,
    **over: Any,
) -> AsyncIterator[dict[str, Any]]:
    """Ingress, router and sim workers (and ``auths`` auth stages, which then sit in the
    pipeline) in this process: the integration tests' bus."""
    from auth.service import Auth
    from engine_worker.worker import Worker
    from gateway.ingress import Ingress
    from router.service import Router

    w = {"model": model, "heartbeat_interval_s": 0.2, **(worker or {})}
    from auth.ratelimit import RateLimit

    svcs: dict[str, Any] = {"workers": [], "auth": [], "ratelimit": [], "filter": []}
    from filter.service import Filter

    if auths or ratelimits or filters:
        stages = (
            ["auth"] * bool(auths)
            + ["ratelimit"] * bool(ratelimits)
            + ["filter"] * bool(filters)
            + ["route"]
        )
        over.setdefault("ingress", {"pipeline": stages})
    async with contextlib.AsyncExitStack() as es:
        for _ in range(auths):
            svcs["auth"].append(await es.enter_async_context(Auth(settings(url, **over))))
        for _ in range(filters):
            svcs["filter"].append(await es.enter_async_context(Filter(settings(url, **over))))
        for _ in range(ratelimits):
            svcs["ratelimit"].append(await es.enter_async_context(RateLimit(settings(url, **over))))
        if with_ingress:
            svcs["ingress"] = await es.enter_async_context(Ingress(settings(url, **over)))
        if with_router:
            svcs["router"] = await es.enter_async_context(Router(settings(url, **over)))
        for i in range(workers):
            ws = settings(url, worker={**w, "replica": f"{model}-w{i}"}, **over)
            svcs["workers"].append(await es.enter_async_context(Worker(ws)))
        if with_router and workers:
            await wait_for(lambda: len(svcs["router"].registry.live(model)) == workers)
        yield svcs


async def wait_for(
    cond: Any, timeout: float = 30.0, interval: float = 0.02, what: str = "condition not met"
) -> None:
    """Until ``cond()`` is true (a coroutine it returns is awaited: a look over the network),
    at most ``timeout`` seconds: a bound for a loaded machine (four test workers on two
    cores), not a measure; it returns as soon as the condition holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} in time")


def wait_until(
    cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> None:
    """:func:`wait_for` for a test that is not a coroutine: until ``cond()`` is true, at most
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met in time")
        time.sleep(interval)


async def wait_started(
    nc: NATS,
    services: dict[str, int],
    model: str = "",
    replicas: int = 0,
    timeout: float = 30,
) -> None:
    """Until ``services[name]`` instances of each tokenbus service ``name`` answer discovery
    (``$SRV.PING``: a service answers once its setup is done, its key cache loaded and its
    subscriptions made), then until each of them (the queue groups' members) and
    ``replicas`` replicas of ``model`` have beaten once more: every service has heard every
    member and every replica, as the router that routes to them must."""
    pongs: dict[str, set[str]] = {name: set() for name in services}
    heard: dict[str, float] = {}  # member id or replica -> when last heard

    async def on_pong(msg: Msg) -> None:
        info = json.loads(msg.data)
        name = str(info.get("name", "")).removeprefix("tokenbus-")
        if name in pongs:
            pongs[name].add(str(info["id"]))

    async def on_member(msg: Msg) -> None:
        heard[str(codec.decode_map(msg.data).get("id"))] = time.monotonic()

    async def on_heartbeat(msg: Msg) -> None:
        hb = codec.decode_map(msg.data)
        if model and hb.get("model") == model and not hb.get("draining"):
            heard[f"replica:{hb.get('replica')}"] = time.monotonic()

    inbox = nc.new_inbox()
    subs = [
        await nc.subscribe(inbox, cb=on_pong),
        await nc.subscribe(subjects.members_wildcard(), cb=on_member),
        await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_heartbeat),
    ]
    deadline = time.monotonic() + timeout
    try:
        while not all(len(pongs[name]) >= n for name, n in services.items()):
            assert time.monotonic() < deadline, f"not every service started: {pongs}"
            await nc.publish("$SRV.PING", b"", reply=inbox)
            await asyncio.sleep(0.1)
        since = time.monotonic()
        members = set().union(*pongs.values())

        def fresh() -> bool:
            new = {k for k, at in heard.items() if at > since}
            reps = sum(k.startswith("replica:") for k in new)
            return members <= new and reps >= replicas

        while not fresh():
            assert time.monotonic() < deadline, f"not every member and replica beat: {heard}"
            await asyncio.sleep(0.05)
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def wait_for_key(svcs: dict[str, Any], key_id: str) -> None:
    """Until every in-process auth stage of ``svcs`` has the key in its cache."""
    await wait_for(
        lambda: all(key_id in a.keys._cache for a in svcs["auth"]),
        timeout=2,
        interval=0.01,
        what="the key never reached every auth instance",
    )


async def fresh_window(margin: float = 8.0) -> None:
    """Start a test well inside a one-minute rate-limit window, so all its requests count
    in one."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < margin:
        await asyncio.sleep(left + 0.1)


class Proc:
    """A real tokenbus process (``python -m tokenbus.cli ...``) with its output in a file."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log_dir: Path,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        # ``prefix``: what runs it elsewhere (``ip netns exec <host>``, which execs it: the
        # pid is still the process's own).
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tokenbus.cli", *args],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15) -> int:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return int(self.proc.returncode)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Procs:
    """Starts and always stops the processes of one test (``with Procs(...) as procs``)."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.url = url
        self.log_dir = log_dir
        self.env = {
            "TOKENBUS_NATS_URL": url,
            "TOKENBUS_LOG_LEVEL": "info",
            "TOKENBUS_DRAIN_TIMEOUT_S": "15",
            "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            # The safety stages are tested where a test starts them.
            "TOKENBUS_INGRESS__PIPELINE": '["route"]',
        }
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> Proc:
        p = Proc(name, list(args), {**self.env, **(env or {})}, self.log_dir, prefix)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def all_alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def start_worker(
    procs: Procs, model: str, i: int | str, *args: str, env: dict[str, str] | None = None
) -> Proc:
    """A worker process ``worker-<i>`` serving ``model`` as replica ``<model>-<i>``."""
    cmd = ("serve", "worker", "--model", model, "--replica", f"{model}-{i}", *args)
    return procs.start(f"worker-{i}", *cmd, env=env)


class ProcStack:
    """The processes :func:`start_stack` started, by role, and the bridge's address."""

    def __init__(
        self, procs: Procs, model: str, roles: dict[str, list[Proc]], port: int | None
    ) -> None:
        self.procs = procs
        self.model = model
        self.roles = roles
        self.port = port

    @property
    def workers(self) -> list[Proc]:
        return self.roles.get("worker", [])

    @property
    def bridge(self) -> Proc:
        return self.roles["bridge"][0]

    @property
    def base(self) -> str:
        """The bridge's HTTP root."""
        return f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The openai SDK pointed at the bridge, without retries (they would hide errors)."""
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0)

    def http(self, path: str = "", **kw: Any) -> httpx.AsyncClient:
        """An httpx client for the bridge, rooted at ``path`` (``"/v1"``: the OpenAI API)."""
        return httpx.AsyncClient(base_url=self.base + path, **kw)

    def all_alive(self) -> bool:
        return self.procs.all_alive()


async def start_stack(
    procs: Procs,
    model: str,
    *services: str,
    workers: int = 1,
    worker_args: Sequence[str] = (),
    bridge: bool = True,
    bridge_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    env_for: Callable[[str, int], dict[str, str]] | None = None,
    heartbeats: bool = True,
    settle: float = 0.0,
    login: dict[str, Any] | None = None,
) -> ProcStack:
    """Real processes: ``services`` (``"ingress"``, ``"router"``, a stage; a name given twice
    runs twice), ``workers`` workers of ``model`` (:func:`start_worker`, ``worker_args``
    added), then the HTTP bridge on a free port. Each gets ``env`` and, over it,
    ``env_for(role, index)``. Returns once every replica heartbeats on the bus (unless
    ``heartbeats`` is off), every queue-group member has started and heard the others, the
    bridge is ready, and ``settle`` seconds more have passed (for what the test's services
    learn next). ``login``: nats-py's connect options for those waits (the admin role on a
    locked bus, whose anonymous client may listen to nothing)."""

    def env_of(role: str, i: int) -> dict[str, str]:
        return {**(env or {}), **(env_for(role, i) if env_for else {})}

    roles: dict[str, list[Proc]] = {}
    for role in services:
        i = len(roles.setdefault(role, []))
        name = f"{role}-{i}" if services.count(role) > 1 else role
        roles[role].append(procs.start(name, "serve", role, env=env_of(role, i)))
    roles["worker"] = [
        start_worker(procs, model, i, *worker_args, env=env_of("worker", i)) for i in range(workers)
    ]
    port = None
    if bridge:
        port = free_port()
        cmd = ("serve", "bridge", "--port", str(port), *bridge_args)
        roles["bridge"] = [procs.start("bridge", *cmd, env=env_of("bridge", 0))]
    stack = ProcStack(procs, model, roles, port)
    if heartbeats and workers:
        await wait_replicas(procs.url, model, workers, **(login or {}))
    # Every queue-group member started (ingress, router, the stages) answers discovery once
    # its setup is done, then beats: until each has, not a guess at how long a start takes
    # on a loaded machine (a router slower than a 2 s settle once made "no route service").
    members: dict[str, int] = {}
    for role in services:
        if role in MEMBER_ROLES:
            members[role] = members.get(role, 0) + 1
    if heartbeats and members:
        nc = await nats.connect(servers(procs.url), dont_randomize=True, **(login or {}))
        # A router routes only to replicas it heard beat after it started (an idle one
        # beats every 2 s): until each has beaten once more, not a guess either.
        routed = workers if heartbeats and "router" in members else 0
        try:
            await wait_started(nc, members, model=model, replicas=routed, timeout=60)
        finally:
            await nc.drain()
    if bridge:
        await wait_http(f"{stack.base}/ready")
    await asyncio.sleep(settle)
    return stack


# The services whose instances are members of a queue group (services/members.py): they
# answer discovery as ``tokenbus-<role>`` and beat on the members' subjects.
MEMBER_ROLES = frozenset(("ingress", "router", "auth", "ratelimit", "filter"))


@pytest.fixture
def procs(nats_server: NatsServer, tmp_path: Path) -> Iterator[Procs]:
    with Procs(nats_server.url, tmp_path) as ps:
        yield ps


async def live_replicas(
    url: str, model: str, wait: float = 0.6, **login: Any
) -> dict[str, dict[str, Any]]:
    """Replicas of ``model`` heard on the bus within ``wait`` seconds (latest heartbeat each);
    ``url`` may name several nodes of a cluster, the first preferred. ``login``: nats-py's
    connect options (the admin role on a locked bus)."""
    nc = await nats.connect(servers(url), dont_randomize=True, **login)
    seen: dict[str, dict[str, Any]] = {}

    async def cb(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        if hb.get("model") == model:
            seen[hb["replica"]] = hb

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
    await asyncio.sleep(wait)
    await nc.drain()
    return seen


async def wait_replicas(url: str, model: str, n: int, timeout: float = 60, **login: Any) -> None:
    # What each replica said last, over every look: an idle replica beats only every few
    # seconds, so n of them need not all beat within one short look.
    deadline = time.monotonic() + timeout
    heard: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        heard.update(await live_replicas(url, model, 0.5, **login))
        if len([r for r in heard.values() if not r.get("draining")]) >= n:
            return
    raise AssertionError(f"{n} replicas of {model} did not appear")


async def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not ready")


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not ended within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Upstream:
    """The fake OpenAI-compatible upstream (``tests/fakes/upstream.py``), a real process on a
    free port, recording what it receives."""

    def __init__(self, log_dir: Path, flavor: str = "vllm") -> None:
        self.port = free_port()
        self._log = open(log_dir / "upstream.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fakes.upstream",
                "--port",
                str(self.port),
                "--flavor",
                flavor,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_port(self.port, 20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def last_request(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{self.url}/last_request")
            r.raise_for_status()
            body: dict[str, Any] = r.json()
            return body

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


class FuzzStack:
    """A stack for the HTTP fuzz tests: its base URL, a key with room to spare, the model."""

    def __init__(self, stack: ProcStack, key: str) -> None:
        self.base, self.key, self.model, self.procs = stack.base, key, stack.model, stack.procs

    def assert_serving(self) -> None:
        """Every process alive, and a plain chat request answered 200."""
        assert all(p.alive() for p in self.procs.procs)
        assert_chat_served(self.base, self.model, self.key)


def assert_chat_served(base: str, model: str, key: str | None = None) -> None:
    """A plain two-token chat request to the bridge at ``base`` is answered 200 (the check
    that a stack still serves after hostile input)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=base, timeout=30) as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=headers,
        )
    assert r.status_code == 200, r.text


@contextlib.asynccontextmanager
async def open_fuzz_stack(
    nats_url: str, tmp: Path, env: dict[str, str], worker_args: tuple[str, ...], **limits: int
) -> AsyncIterator[FuzzStack]:
    """Every stage on (auth, ratelimit, filter, route), one sim worker, a key with
    ``limits``, and the bridge settings in ``env``."""
    async with key_store(nats_url, watch=False) as keys:
        key, _ = await keys.create(tmp.name, **limits)
    pipeline = {"TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]'}
    with Procs(nats_url, tmp) as procs:
        stack = await start_stack(
            procs,
            new_model(),
            *("ingress", "auth", "ratelimit", "filter", "router"),
            worker_args=worker_args,
            env={**pipeline, **env},
            settle=0.5,
        )
        yield FuzzStack(stack, key)
