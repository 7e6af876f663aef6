"""``tokenbus bench --spawn``'s own stack: an embedded nats-server (locked with ``--locked``),
the stages, the workers (``--replica``), the bridge, the direct engine server and the peers;
what the scenarios (tenants, kvbench, pdbench, ...) start too, with :func:`spawned`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from services.config import BridgeSettings, Settings
from tokenbus.evaluation import peers
from tokenbus.evaluation.bench_requests import Target
from tokenbus.launcher import free_port


async def wait_http(url: str, timeout: float = 30.0) -> None:
    """Until ``url`` answers 200 (a readiness endpoint), or raise after ``timeout``."""
    from tokenbus.launcher import wait_ready

    if not await wait_ready(url, timeout):
        raise RuntimeError(f"{url} did not become ready")


async def _wait_replicas(
    url: str, n: int, timeout: float = 30.0, login: dict[str, str] | None = None
) -> None:
    """Until ``n`` replicas have sent heartbeats (and the routers heard them: two beats)."""
    import nats as nats_mod

    from bus_schemas import codec, subjects

    seen: dict[str, int] = {}
    nc = await nats_mod.connect(url, **(login or {}))
    try:

        async def on_beat(msg: Any) -> None:
            rid = str(codec.decode_map(msg.data).get("replica", ""))
            seen[rid] = seen.get(rid, 0) + 1

        await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_beat)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(seen) >= n and all(v >= 2 for v in seen.values()):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"only {len(seen)} of {n} replicas came up")
    finally:
        await nc.drain()


async def bench_key(
    url: str, login: dict[str, str] | None = None, name: str = "bench", **fields: Any
) -> str:
    """A key whose limits are far above what a run can use, so every stage does its work;
    ``fields`` are more of its settings (a weight, a service tier)."""
    import nats

    from auth.store import KeyStore

    nc = await nats.connect(url, **(login or {}))
    try:
        store = await KeyStore(nc).open(watch=False)
        limits: dict[str, Any] = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}
        key, _ = await store.create(name, **{**limits, **fields})
    finally:
        await nc.drain()
    return key


async def spawn_stack(a: argparse.Namespace, sup: Any) -> tuple[list[Target], Any]:
    from services.supervisor import Process
    from tokenbus.launcher import nats_server_binary

    nats_port, bridge_port, direct_port = free_port(), free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="tokenbus-bench-")
    from services.natsconf import generate, jetstream_block

    # The sync policy a deployment runs (services.config.NATS_SYNC), or --nats-sync's.
    sync = getattr(a, "nats_sync", None) or Settings().nats_sync
    js_conf = Path(tmp) / "js.conf"
    js_conf.write_text(jetstream_block(tmp, sync))
    server_args = ["-c", str(js_conf), "-a", "127.0.0.1", "-p", str(nats_port)]
    users: Path | None = None
    stages = [s for s in a.pipeline.split(",") if s and s != "route"]
    if getattr(a, "locked", False):
        conf, users = generate(
            Path(tmp) / "locked",
            port=nats_port,
            store_dir=tmp,
            callout="auth" in stages,
            sync=sync,
        )
        server_args = ["-c", str(conf)]
    nats = Process("nats-server", [nats_server_binary(), *server_args], log=Path(tmp) / "nats.log")
    nats.start()
    try:
        ports = (nats_port, bridge_port, direct_port)
        return await _spawn_on(a, sup, nats, ports, tmp, users, stages)
    except BaseException:
        # Stopped while it started (Ctrl-C during a vLLM start, a peer that never came
        # up): the supervisor's children first, while their bus still runs (stopped after
        # it, each drained against a server that was gone until its SIGKILL), then the
        # server. The caller's stop of the supervisor then finds nothing left.
        await sup.stop(10)
        await stop_nats(nats)
        raise


async def stop_nats(nats: Any) -> None:
    """Stop the run's nats-server (a :class:`services.supervisor.Process`), if it still runs."""
    if nats is not None and nats.alive():
        await nats.stopped(10)


async def _spawn_on(
    a: argparse.Namespace,
    sup: Any,
    nats: Any,
    ports: tuple[int, int, int],
    tmp: str,
    users: Path | None,
    stages: list[str],
) -> tuple[list[Target], Any]:
    """The rest of :func:`spawn_stack`, once its nats-server is started: the stack's
    processes, the engine server and the peers (``ports``: nats, bridge, engine server)."""
    from services.natsconf import role_login
    from services.supervisor import Child
    from tokenbus.launcher import as_role, bridge_children, cli_argv, port_open

    nats_port, bridge_port, direct_port = ports
    for _ in range(100):
        if port_open("127.0.0.1", nats_port):
            break
        await asyncio.sleep(0.05)
    url = f"nats://127.0.0.1:{nats_port}"
    env = {
        "TOKENBUS_NATS_URL": url,
        "TOKENBUS_LOG_LEVEL": "warning",
        "TOKENBUS_INGRESS__PIPELINE": json.dumps(a.pipeline.split(",")),
    }
    sim = [
        "--model",
        a.model,
        "--sim-prefill-ms",
        str(a.sim_prefill_ms),
        "--sim-decode-ms",
        str(a.sim_decode_ms),
        "--sim-max-running",
        str(a.sim_max_running),
        "--max-concurrency",
        str(a.sim_max_running),
    ]

    if a.routing:
        env["TOKENBUS_ROUTER"] = a.routing
    elif getattr(a, "budget_usd", None):
        # Spend on the request path: the model priced, every request reserved and settled.
        env["TOKENBUS_ROUTER__PRICE"] = json.dumps({"input": 1.0, "output": 2.0})
    env["TOKENBUS_TELEMETRY__ENABLED"] = "true" if a.telemetry == "on" else "false"
    if getattr(a, "prompt_bytes", None):  # the prompt-size axis: a context that takes them
        env["TOKENBUS_WORKER__SIM__MAX_MODEL_LEN"] = str(10**9)
    if a.telemetry == "on":
        a.telemetry_db = str(Path(tmp) / "telemetry.db")
        tel_env = {
            **env,
            "TOKENBUS_TELEMETRY__DB_PATH": a.telemetry_db,
            "TOKENBUS_TELEMETRY__METRICS_PORT": "0",
        }
        await sup.add(
            Child("telemetry", cli_argv("serve", "telemetry"), as_role(tel_env, users, "telemetry"))
        )
    for name in ["ingress", *stages, "router"]:
        await sup.add(Child(name, cli_argv("serve", name), as_role(env, users, name)))
    login = role_login(users, "admin") if users is not None else {}
    budget = {"budget_usd": a.budget_usd} if getattr(a, "budget_usd", None) else {}
    key = await bench_key(url, login, **budget) if "auth" in stages else None
    engine = f"http://127.0.0.1:{direct_port}"
    # The workers' engine: the direct server over HTTP (as a peer reaches it), or in-process.
    backend = (
        [
            *("--backend", "openai", "--model", a.model, "--upstream-url", f"{engine}/v1"),
            *("--max-concurrency", str(a.sim_max_running)),
        ]
        if a.upstream
        else sim
    )
    direct = (cli_argv("serve", "openai-http", "--port", str(direct_port), *sim), env)
    worker_env = dict(env)
    if a.sim_decode_ms_per_seq:
        worker_env["TOKENBUS_WORKER__SIM__DECODE_MS_PER_SEQ"] = str(a.sim_decode_ms_per_seq)
    ready_s = 30.0
    ready = f"{engine}/ready"  # the engine server's readiness
    if a.engine == "vllm-scripted":
        from tokenbus.evaluation import vllm_scripted

        vs = vllm_scripted.prepare(a, Path(tmp), direct_port)
        direct = (vs.direct_argv, vs.direct_env)
        if not a.upstream:
            backend = vs.worker_args
        worker_env |= vs.worker_env
        ready_s = 300.0  # vLLM's start: its imports, the renderer's warm-up
        ready = f"{engine}/health"  # vllm serve's
    if not a.no_direct:
        await sup.add(Child("direct", direct[0], {**worker_env, **direct[1]}))
    if a.upstream:
        await wait_http(ready, ready_s)
    for i, (extra_args, extra_env) in enumerate(replica_specs(a.replica)):
        await sup.add(
            Child(
                f"worker-{i}",
                cli_argv("serve", "worker", "--replica", f"bench-{i}", *backend, *extra_args),
                as_role({**worker_env, **extra_env}, users, "worker"),
            )
        )
    bridges = BridgeSettings(port=bridge_port, processes=a.bridge_processes)
    bridge_env = as_role(env, users, "bridge")
    for child in bridge_children(bridges, bridge_env):
        await sup.add(child)
    launches = []
    for spec in a.peer:
        name, binary = peers.parse(spec)
        launch = peers.launch(name, binary, engine, a.model, free_port(), Path(tmp), free_port())
        for companion, argv in launch.companions:
            await sup.add(Child(companion, argv, {}))
        await sup.add(Child(name, launch.argv, {}))
        launches.append(launch)
    await wait_http(f"http://127.0.0.1:{bridge_port}/ready")
    await _wait_replicas(url, len(replica_specs(a.replica)), timeout=ready_s, login=login)
    if not a.no_direct:
        await wait_http(ready, ready_s)
    for launch in launches:
        await wait_http(launch.ready_url, timeout=max(120.0, ready_s))
    pids = {c.name: c.proc.pid for c in sup.children if c.proc is not None}
    others = {"direct", *(p.name for p in launches)}
    others |= {c for p in launches for c, _ in p.companions}
    # Every tokenbus process, its nats-server included.
    stack_pids = {k: v for k, v in pids.items() if k not in others} | {"nats-server": nats.pid}
    targets = [
        Target(
            "tokenbus-http", "http", f"http://127.0.0.1:{bridge_port}/v1", stack_pids, api_key=key
        )
    ]
    if a.nats_too:
        # On the locked bus a NATS client logs in with the run's key (auth callout), or as
        # the client role when keys are off.
        client_login: dict[str, Any] = {}
        if users is not None and key:
            client_login = {"api_key": key}
        elif users is not None:
            client_login = role_login(users, "client")
        targets.append(
            Target("tokenbus-nats", "nats", url, stack_pids, api_key=key, login=client_login)
        )
    for launch in launches:
        peer_pids = {n: pids[n] for n in (launch.name, *(c for c, _ in launch.companions))}
        if a.engine != "sim" and not a.no_direct:
            # vLLM's front end is in the engine server: Python every path pays, counted in each.
            peer_pids["direct"] = pids["direct"]
        targets.append(Target(launch.name, "http", launch.base_url, peer_pids, launch.api_key))
    if not a.no_direct:
        targets.append(
            Target(
                "direct", "http", f"http://127.0.0.1:{direct_port}/v1", {"direct": pids["direct"]}
            )
        )
    return targets, nats


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in this process' environment while children start (they inherit it):
    settings :func:`spawn_stack` has no flag for."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.asynccontextmanager
async def spawned(
    a: argparse.Namespace, env: dict[str, str] | None = None, logs: str = "tokenbus-bench-logs-"
) -> AsyncIterator[tuple[list[Target], Any]]:
    """:func:`spawn_stack` under a supervisor of its own, ``env`` in the environment its
    children start with: (targets, supervisor). Every child is stopped on the way out, and
    after a start that failed, whose logs are named."""
    from services.supervisor import Supervisor

    sup = Supervisor(Path(tempfile.mkdtemp(prefix=logs)), echo=False)
    with environ(env or {}):
        try:
            targets, nats = await spawn_stack(a, sup)
        except BaseException:
            await sup.stop(10)
            print(f"logs: {sup.log_dir}", file=sys.stderr)
            raise
    try:
        yield targets, sup
    finally:
        await sup.stop(10)
        await stop_nats(nats)


_REPLICA_FLAGS = {
    "tp": "--tp",
    "pool": "--pool",
    "max_running": "--sim-max-running",
    "max_concurrency": "--max-concurrency",
    "role": "--pd-role",
}
_REPLICA_SIM = ("decode_ms_per_seq", "tp_efficiency", "tp_comm_ms")


def replica_specs(specs: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """``N:key=value,...`` -> per worker (extra flags, extra env); one plain worker if none."""
    if not specs:
        return [([], {})]
    out: list[tuple[list[str], dict[str, str]]] = []
    for spec in specs:
        count, _, rest = spec.partition(":")
        if not count.strip().isdigit() or int(count) < 1:
            raise SystemExit(f"--replica wants N:KEY=VALUE,..., got {spec!r}")
        flags: list[str] = []
        env: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            k, sep, v = pair.partition("=")
            if not sep:
                raise SystemExit(f"--replica: {pair!r} is not KEY=VALUE")
            if k in _REPLICA_FLAGS:
                flags += [_REPLICA_FLAGS[k], v]
            elif k in _REPLICA_SIM:
                env[f"TOKENBUS_WORKER__SIM__{k.upper()}"] = v
            elif k == "flow":
                if v not in ("on", "off"):
                    raise SystemExit(f"--replica: flow is on or off, got {v!r}")
                env["TOKENBUS_WORKER__FLOW__ENABLED"] = "true" if v == "on" else "false"
            else:
                raise SystemExit(f"--replica: unknown key {k!r}")
        out += [(flags, env)] * int(count)
    return out
