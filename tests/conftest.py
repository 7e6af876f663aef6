"""Shared fixtures: a real nats-server on a random port, services in-process, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus_schemas import codec, subjects
from services.kit import config
from services.kit import logging as tlog
from tokenbus.launcher import nats_server_binary

tlog.setup("warning")

ROOT = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``tokenbus <args>`` (as ``python -m tokenbus.cli``) the way a user would."""
    return subprocess.run(
        [sys.executable, "-m", "tokenbus.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=check,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.data_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.02)
        raise RuntimeError("nats-server did not start")

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


@pytest.fixture
def model() -> str:
    """A model name of this test's own, so tests sharing a bus do not see each other."""
    return f"m-{uuid.uuid4().hex[:8]}"


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
    from router.service import Router
    from services.gateway.ingress import Ingress

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


async def wait_for(cond: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


class Proc:
    """A real tokenbus process (``python -m tokenbus.cli ...``) with its output in a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenbus.cli", *args],
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
    """Starts and always stops the processes of one test."""

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

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, list(args), {**self.env, **(env or {})}, self.log_dir)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def start_workers(
    procs: Procs, model: str, n: int, *args: str, env: dict[str, str] | None = None
) -> list[Proc]:
    """``n`` sim worker processes ``w0..w<n-1>`` serving ``model`` as replicas
    ``<model>-0..``."""
    return [
        procs.start(
            f"w{i}",
            "serve",
            "worker",
            "--model",
            model,
            "--replica",
            f"{model}-{i}",
            *args,
            env=env,
        )
        for i in range(n)
    ]


@pytest.fixture
def procs(nats_server: NatsServer, tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(nats_server.url, tmp_path)
    yield ps
    ps.stop_all()


async def live_replicas(url: str, model: str, wait: float = 0.6) -> dict[str, dict[str, Any]]:
    """Replicas of ``model`` heard on the bus within ``wait`` seconds (latest heartbeat each)."""
    nc = await nats.connect(url)
    seen: dict[str, dict[str, Any]] = {}

    async def cb(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        if hb.get("model") == model:
            seen[hb["replica"]] = hb

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
    await asyncio.sleep(wait)
    await nc.drain()
    return seen


async def wait_replicas(url: str, model: str, n: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = await live_replicas(url, model, 0.5)
        if len([r for r in live.values() if not r.get("draining")]) >= n:
            return
    raise AssertionError(f"{n} replicas of {model} did not appear")


async def wait_http(url: str, timeout: float = 20) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not ready")
