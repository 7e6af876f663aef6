"""The compose stack on a real Docker engine, as an operator runs it: up on the locked bus,
the first key, a streamed completion, NATS refusing anonymous clients, workers scaled to 4, a
worker container and a NATS node killed under load with no failed request, down and up with
the keys kept.

Needs a Docker engine and the compose file's base images (``python:3.11-slim``, and
``nats:2.15.1-alpine`` or the local ``nats:2.10`` of ``../shared/tools/local-docker.sh``, which
holds the venv's pinned nats-server); skipped with the reason otherwise. Run them alone with
``pytest -m compose``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from openai import AsyncOpenAI, AuthenticationError

from tests.support.ports import free_port
from tests.support.repo import ROOT
from tokenbus.client import Client

pytestmark = [pytest.mark.stack, pytest.mark.compose, pytest.mark.timeout(900)]

MODEL = "tokenbus-sim"
NATS_IMAGE = "nats:2.15.1-alpine"  # compose/docker-compose.yml (tests/test_versions.py)
FILES = ROOT / "compose"
KEY = re.compile(r"^(tb-[0-9a-f]{12}_\S+)$", re.M)


def _run(cmd: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _engine() -> tuple[list[str] | None, str]:
    """The compose command, or None and why these tests cannot run here."""
    if shutil.which("docker") is None:
        return None, "no docker command"
    try:
        if _run(["docker", "info"], timeout=15).returncode != 0:
            return None, "no Docker engine reachable (docker info failed)"
    except subprocess.TimeoutExpired:
        return None, "no Docker engine reachable (docker info hung)"
    if _run(["docker", "compose", "version"]).returncode == 0:
        compose = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        compose = ["docker-compose"]
    else:
        return None, "neither `docker compose` nor docker-compose is installed"

    def have(image: str) -> bool:
        return _run(["docker", "image", "inspect", image]).returncode == 0

    if not have("python:3.11-slim"):
        return None, "base image python:3.11-slim missing (../shared/tools/local-docker.sh)"
    if not have(NATS_IMAGE):
        if not have("nats:2.10"):
            return None, f"image {NATS_IMAGE} missing (../shared/tools/local-docker.sh)"
        # The local stand-in (a nats-server binary on Debian, with curl for the health check).
        # The local image holds the venv's nats-server binary: the pinned version.
        _run(["docker", "tag", "nats:2.10", NATS_IMAGE])
    return compose, ""


@pytest.fixture(scope="module")
def compose() -> list[str]:
    cmd, why = _engine()
    if cmd is None:
        pytest.skip(why)
    built = _run(
        ["docker", "build", "-q", "--network", "host", "-t", "tokenbus:latest", str(ROOT)],
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    return cmd


class Stack:
    """One compose project (its own name, ports and volumes)."""

    def __init__(self, compose: list[str], files: list[str]) -> None:
        self.project = f"tbtest{uuid.uuid4().hex[:8]}"
        self.cmd = [*compose, "-p", self.project]
        for f in files:
            self.cmd += ["-f", str(FILES / f)]
        self.http_port, self.nats_port = free_port(), free_port()
        self.env = os.environ | {
            "TOKENBUS_HTTP_PORT": str(self.http_port),
            "TOKENBUS_NATS_PUBLIC_PORT": str(self.nats_port),
            "TOKENBUS_METRICS_PORT": str(free_port()),
        }

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return _run([*self.cmd, *args], timeout=timeout, env=self.env)

    def up(self, *args: str) -> None:
        r = self("up", "-d", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        self.wait_healthy()

    def containers(self, service: str | None = None) -> list[str]:
        r = self("ps", "-q", *([service] if service else []))
        return r.stdout.split()

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {}
            for cid in self.containers():
                r = _run(["docker", "inspect", cid])
                info = json.loads(r.stdout)[0]
                st = info["State"]
                name = info["Name"].lstrip("/")
                if "_init_" in name or "-init-" in name:
                    states[name] = (
                        "ok" if st["Status"] == "exited" and not st["ExitCode"] else st["Status"]
                    )
                else:
                    states[name] = (st.get("Health") or {}).get("Status", st["Status"])
            if states and all(s in ("ok", "healthy") for s in states.values()):
                return
            time.sleep(2)
        logs = self("logs", "--tail", "20").stdout[-4000:]
        raise AssertionError(f"not healthy in {timeout} s: {states}\n{logs}")

    def create_key(self, name: str = "test") -> str:
        r = self("run", "--rm", "cli", "keys", "create", "--name", name)
        m = KEY.search(r.stdout)
        assert r.returncode == 0 and m, r.stdout + r.stderr
        return m.group(1)

    def ca(self, folder: Path) -> str:
        r = self("run", "--rm", "--entrypoint", "cat", "cli", "/config/tls/ca.pem")
        assert r.returncode == 0 and "BEGIN CERTIFICATE" in r.stdout, r.stderr
        path = folder / "ca.pem"
        path.write_text(r.stdout[r.stdout.index("-----BEGIN") :])
        return str(path)

    def down(self, *args: str) -> None:
        self("down", "--remove-orphans", *args, timeout=300)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"


@pytest.fixture(scope="module")
def stack(compose: list[str]) -> Iterator[Stack]:
    s = Stack(compose, ["docker-compose.yml", "nats-public.yml"])
    try:
        s.up()
        yield s
    finally:
        s.down("-v")


async def _stream(client: AsyncOpenAI, max_tokens: int) -> int:
    """The completion tokens of one streamed request (raises on any failure)."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    assert finish == "length", finish
    return tokens


async def _serves(base_url: str, key: str, tokens: int) -> None:
    """One streamed request with ``key`` comes back whole."""
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    try:
        assert await _stream(client, tokens) == tokens
    finally:
        await client.close()


async def _load_with_a_kill(base_url: str, key: str, kill: list[str], n: int = 32) -> None:
    """``n`` streams of 300 tokens (about 3 s each); once all have begun, kill the
    containers ``kill``; every stream must end whole."""
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    try:
        tasks = [asyncio.create_task(_stream(client, 300)) for _ in range(n)]
        await asyncio.sleep(1.0)
        for cid in kill:
            await asyncio.to_thread(_run, ["docker", "kill", cid])
        done = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await client.close()
    failed = [d for d in done if isinstance(d, BaseException)]
    assert not failed, failed[:3]
    assert done == [300] * n


async def test_the_first_key_serves_a_streamed_completion_and_models_need_it(
    stack: Stack,
) -> None:
    key = stack.create_key("first")
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{stack.base_url}/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.get(f"{stack.base_url}/models", headers={"Authorization": f"Bearer {key}"})
        assert [m["id"] for m in r.json()["data"]] == [MODEL]
    await _serves(stack.base_url, key, 7)


async def test_nats_takes_tls_clients_with_a_key_only(stack: Stack, tmp_path: Path) -> None:
    ca = stack.ca(tmp_path)
    url = f"tls://localhost:{stack.nats_port}"
    import ssl

    ctx = ssl.create_default_context(cafile=ca)
    for opts in ({}, {"token": "tb-000000000000_" + "x" * 43}, {"user": "worker"}):
        with pytest.raises(Exception) as ei:
            nc = await nats.connect(
                url, tls=ctx, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0,
                **opts,
            )  # fmt: skip
            await nc.close()
        assert "authorization" in str(ei.value).lower() or "auth" in repr(ei.value).lower()
    with pytest.raises(Exception):  # noqa: B017 - plain TCP to a TLS-only server
        await nats.connect(
            f"nats://localhost:{stack.nats_port}", connect_timeout=3, allow_reconnect=False
        )
    key = stack.create_key("nats-client")
    client = await Client.connect(url, api_key=key, tls_ca=ca)
    try:
        out = await client.chat_completion(MODEL, [{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.usage.completion_tokens == 3
        # A key client may not go around the pipeline to a worker.
        with pytest.raises(Exception):  # noqa: B017
            await client.nc.request(f"tb.v1.engine.{MODEL}.any.generate", b"{}", timeout=2)
    finally:
        await client.close()


async def test_workers_scale_to_four_live_replicas(stack: Stack) -> None:
    stack.up("--scale", "worker=4", "--no-recreate")
    assert len(stack.containers("worker")) == 4
    deadline = time.monotonic() + 30
    rows: list[Any] = []
    while time.monotonic() < deadline:
        r = stack("run", "--rm", "cli", "status", "--json")
        if r.returncode == 0:
            rows = json.loads(r.stdout[r.stdout.index("{") :])["replicas"]
            if len(rows) == 4:
                break
        await asyncio.sleep(2)
    assert len(rows) == 4 and {r["model"] for r in rows} == {MODEL}, rows


async def test_a_worker_killed_under_load_fails_no_request(stack: Stack) -> None:
    key = stack.create_key("load")
    workers = stack.containers("worker")
    assert len(workers) >= 2
    try:
        await _load_with_a_kill(stack.base_url, key, [workers[0]])
    finally:
        stack.up()  # a killed container stays down (unless-stopped); up brings it back


def _rolling_restart(stack: Stack, service: str) -> None:
    """docs/deploy.md's upgrade: one copy at a time, stopped (it drains), removed, replaced,
    and healthy before the next."""
    for cid in stack.containers(service):
        assert _run(["docker", "stop", "-t", "35", cid], timeout=60).returncode == 0
        assert _run(["docker", "rm", cid]).returncode == 0
        r = stack("up", "-d", "--no-recreate", service)
        assert r.returncode == 0, r.stderr[-2000:]
        stack.wait_healthy()


async def test_a_rolling_restart_of_the_stages_under_load_fails_no_request(
    stack: Stack, tmp_path: Path
) -> None:
    key = stack.create_key("rolling")
    ca = stack.ca(tmp_path)
    http = AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)
    bus = await Client.connect(f"tls://localhost:{stack.nats_port}", api_key=key, tls_ca=ca)
    done = asyncio.Event()
    served = {"http": 0, "nats": 0}
    failures: list[BaseException] = []

    async def over_http() -> None:
        while not done.is_set():
            try:
                assert await _stream(http, 30) == 30
                served["http"] += 1
            except BaseException as exc:
                failures.append(exc)

    async def over_nats() -> None:
        while not done.is_set():
            try:
                out = await bus.chat_completion(
                    MODEL, [{"role": "user", "content": "hi"}], max_tokens=30
                )
                assert out.usage.completion_tokens == 30
                served["nats"] += 1
            except BaseException as exc:
                failures.append(exc)

    clients = [asyncio.create_task(f()) for f in (over_http, over_nats) for _ in range(4)]
    try:
        # The NATS clients' path crosses every stage; the bridge's runs auth, limits and the
        # filter in-process and crosses the router.
        for service in ("ingress", "auth", "ratelimit", "filter", "router", "worker"):
            await asyncio.to_thread(_rolling_restart, stack, service)
    finally:
        done.set()
        await asyncio.gather(*clients)
        await http.close()
        await bus.close()
    assert not failures, failures[:3]
    assert served["http"] > 20 and served["nats"] > 20, served


async def test_down_and_up_keeps_the_keys(stack: Stack) -> None:
    key = stack.create_key("kept")
    stack.down()
    stack.up()
    await _serves(stack.base_url, key, 4)


async def test_a_volume_backup_restores_the_keys(stack: Stack, tmp_path: Path) -> None:
    """docs/deploy.md's volume copy: NATS stopped, data and config tarred; the stack removed
    with its volumes, the copy restored into new ones; the old key still serves."""
    key = stack.create_key("backed-up")
    vols = [f"{stack.project}_nats-data:/data", f"{stack.project}_config:/config"]
    mounts = [a for v in [*vols, f"{tmp_path}:/backup"] for a in ("-v", v)]
    tar = ["docker", "run", "--rm", *mounts, "python:3.11-slim", "tar"]
    assert stack("stop", "nats").returncode == 0
    r = _run([*tar, "czf", "/backup/bus.tgz", "/data", "/config"], timeout=120)
    assert r.returncode == 0, r.stderr
    stack.down("-v")
    # Fresh volumes, filled from the copy before anything starts.
    for v in vols:
        _run(["docker", "volume", "create", v.split(":")[0]])
    r = _run([*tar, "xzf", "/backup/bus.tgz", "-C", "/"], timeout=120)
    assert r.returncode == 0, r.stderr
    stack.up()
    await _serves(stack.base_url, key, 4)


async def test_losing_a_nats_node_of_the_cluster_under_load_fails_no_request(
    compose: list[str],
) -> None:
    s = Stack(compose, ["docker-compose.yml", "cluster.yml"])
    try:
        s.up()
        key = s.create_key("cluster")
        node = s.containers("nats-1")
        assert len(node) == 1
        await _load_with_a_kill(s.base_url, key, node)
        # The bus still serves new requests and new keys with one node gone. A new key
        # reaches the bridge through its watch of the key bucket, which may be reconnecting
        # to another node just now: it must be served within seconds, not at once.
        again = s.create_key("after")
        deadline = time.monotonic() + 15
        while True:
            try:
                await _serves(s.base_url, again, 5)
                break
            except AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(Exception):
            s.down("-v")
