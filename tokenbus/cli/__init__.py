"""The ``tokenbus`` command line: up, serve, status, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from services.lean_imports import import_bus_libraries

import_bus_libraries()  # before anything imports nats-py or structlog (services/lean_imports.py)

from services import config as cfgmod  # noqa: E402
from services import logging as tlog  # noqa: E402

SERVICES = (
    "bridge",
    "ingress",
    "auth",
    "ratelimit",
    "filter",
    "router",
    "worker",
    "telemetry",
    "openai-http",
)


def _worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--backend", choices=["sim", "openai", "vllm"])
    g.add_argument("--model", help="model name served (default tokenbus-sim)")
    g.add_argument("--replica", help="replica id (default: generated)")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--tp", type=int, help="tensor parallel degree (sim: models the speed-up)")
    g.add_argument("--pool", help="pool tag for tiered routing")
    g.add_argument(
        "--pd-role",
        choices=["both", "prefill", "decode"],
        help="prefill/decode disaggregation: this replica's role (docs/disaggregation.md)",
    )
    g.add_argument(
        "--endpoints",
        help="request kinds served, comma-separated: chat,completions,embeddings "
        "(default: what the backend serves; an embedding upstream: --endpoints embeddings)",
    )
    g.add_argument(
        "--upstream-url", help="openai backend: upstream base URL, e.g. http://h:8000/v1"
    )
    g.add_argument("--upstream-model", help="openai backend: model name upstream")
    g.add_argument("--upstream-api-key", help="openai backend: bearer token for the upstream")
    g.add_argument("--gpus", help="vllm backend: CUDA_VISIBLE_DEVICES, e.g. 0,1")
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm backend: any `vllm serve` option by name (repeatable): engine args "
        "(tensor_parallel_size=2, max_model_len=32k) and front-end options "
        "(tool_call_parser=hermes, enable_auto_tool_choice=true); see docs/vllm.md",
    )
    g.add_argument("--sim-prefill-ms", type=float)
    g.add_argument("--sim-decode-ms", type=float)
    g.add_argument("--sim-decode-ms-per-seq", type=float)
    g.add_argument("--sim-max-running", type=int)
    g.add_argument(
        "--sim-kv-cache-blocks",
        type=int,
        help="sim backend: blocks in its prefix cache (0: prefix caching and KV events off)",
    )
    g.add_argument("--sim-block-size", type=int, help="sim backend: tokens per KV-cache block")
    g.add_argument(
        "--sim-chunked-prefill-tokens",
        type=int,
        help="sim backend: tokens per engine step, prompts prefilled in chunks beside the "
        "decodes (vLLM's max_num_batched_tokens; 0: prefill beside decode, no slow-down)",
    )
    g.add_argument("--sim-prefill-ms-per-token", type=float)


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        try:
            out[k.replace("-", "_")] = json.loads(v)
        except ValueError:
            out[k.replace("-", "_")] = v
    return out


def _worker_overrides(a: argparse.Namespace) -> dict[str, Any]:
    w: dict[str, Any] = {
        "backend": a.backend,
        "model": a.model,
        "replica": a.replica,
        "max_concurrency": a.max_concurrency,
        "tp": a.tp,
        "pool": a.pool,
        "pd_role": a.pd_role,
        "endpoints": [e.strip() for e in a.endpoints.split(",") if e.strip()]
        if a.endpoints
        else None,
        "sim": {
            "prefill_ms": a.sim_prefill_ms,
            "decode_ms": a.sim_decode_ms,
            "decode_ms_per_seq": a.sim_decode_ms_per_seq,
            "max_running": a.sim_max_running,
            "kv_cache_blocks": a.sim_kv_cache_blocks,
            "block_size": a.sim_block_size,
            "chunked_prefill_tokens": a.sim_chunked_prefill_tokens,
            "prefill_ms_per_token": a.sim_prefill_ms_per_token,
        },
        "openai": {
            "upstream_url": a.upstream_url,
            "upstream_model": a.upstream_model,
            "api_key": a.upstream_api_key,
        },
        "vllm": {"gpus": a.gpus},
    }
    if a.engine_arg:
        w["vllm"]["engine_args"] = _engine_args(a.engine_arg)
    return w


def _https_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", help="bridge: serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", help="bridge: the certificate's private key (PEM)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenbus", description="LLM serving on NATS")
    p.add_argument("--config", help="TOML config file (default ./tokenbus.toml if present)")
    p.add_argument("--nats-url", help="NATS server URL (env TOKENBUS_NATS_URL)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run the whole stack locally (embedded NATS, sim workers)")
    up.add_argument("--workers", type=int, help="sim workers to start (default 2)")
    up.add_argument("--host", help="bridge address (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="bridge port (default 8000)")
    up.add_argument("--bridge-processes", type=int, help="bridge processes (default 1)")
    up.add_argument("--nats-port", type=int, help="embedded nats-server port (default 4222)")
    up.add_argument("--data-dir", help="JetStream data and logs (default .tokenbus)")
    _https_flags(up)
    _worker_flags(up)

    sv = sub.add_parser("serve", help="run one service (for containers and scaling out)")
    sv.add_argument("service", choices=SERVICES)
    sv.add_argument("--host", help="bridge / openai-http: address")
    sv.add_argument("--port", type=int, help="bridge / openai-http: port")
    sv.add_argument("--processes", type=int, help="bridge: processes sharing the port")
    sv.add_argument("--reuse-port", action="store_true", help="bridge: bind with SO_REUSEPORT")
    _https_flags(sv)
    _worker_flags(sv)

    st = sub.add_parser(
        "status",
        help="replicas on the bus and their load (QUEUED: requests waiting for an engine "
        "slot, priority/default/flex; --json: per class and per flow)",
    )
    st.add_argument("--json", action="store_true")
    st.add_argument(
        "--wait",
        type=float,
        default=2.5,
        help="seconds to listen for heartbeats (idle replicas beat every 2 s)",
    )

    from tokenbus.evaluation import options as bench_options

    bench_options.add_parser(sub)

    from tokenbus.cli import keys_cli

    keys_cli.add_parser(sub)

    from tokenbus.cli import router_cli

    router_cli.add_parser(sub)
    from tokenbus.cli import adapters_cli

    adapters_cli.add_parser(sub)

    from tokenbus.cli import audit_cli

    audit_cli.add_parser(sub)

    from tokenbus.cli import batches_cli

    batches_cli.add_parser(sub)

    from tokenbus.cli import backup as backup_cli

    backup_cli.add_parsers(sub)

    from tokenbus.cli import compose as compose_cli

    compose_cli.add_parser(sub)

    from tokenbus.cli import deploy as deploy_cli

    deploy_cli.add_parsers(sub)

    rp = sub.add_parser("report", help="summary table and plots from the telemetry store")
    rp.add_argument("--db", help="SQLite store (default: telemetry.db_path)")
    rp.add_argument("--out", default="tokenbus-report", help="folder for the files")
    rp.add_argument("--since", type=float, default=0, help="only the last N seconds")
    rp.add_argument("--bucket", type=float, default=10.0, help="seconds per time bucket")

    nc_ = sub.add_parser("nats-config", help="write a locked-down nats-server config")
    nc_.add_argument("--out", default=".tokenbus/nats-locked", help="folder for the files")
    nc_.add_argument("--host", default="127.0.0.1")
    nc_.add_argument("--port", type=int, default=4222)
    nc_.add_argument(
        "--callout",
        action="store_true",
        help="NATS clients log in with their API key (the auth service answers the server's "
        "auth callout; give it TOKENBUS_NATS_CALLOUT=<out>/callout.json) instead of a shared "
        "client password",
    )
    nc_.add_argument(
        "--tls",
        action="store_true",
        help="TLS only: generate a CA, a server certificate and a client certificate for "
        "services in <out>/tls (kept once made), unless --tls-cert/--tls-key/--tls-ca give yours",
    )
    nc_.add_argument(
        "--tls-name",
        action="append",
        default=[],
        help="--tls: another host name or address the server certificate is valid for "
        "(repeatable; localhost, 127.0.0.1, this host's name and --host are always in)",
    )
    nc_.add_argument(
        "--tls-verify",
        action="store_true",
        help="--tls: mutual TLS, every connection (services and NATS clients) must present a "
        "certificate signed by the CA",
    )
    nc_.add_argument("--tls-cert", dest="tls_server_cert", help="--tls: your server certificate")
    nc_.add_argument("--tls-key", dest="tls_server_key", help="--tls: its private key")
    nc_.add_argument("--tls-ca", help="--tls: the CA that signed it (and client certificates)")
    nc_.add_argument(
        "--worker-host",
        action="append",
        default=None,
        metavar="HOST=REPLICA[,REPLICA...]",
        help="a login of its own (worker-HOST) for a GPU host, which may serve only these "
        "replica ids (repeatable); given once, the list replaces the last run's and a host "
        "left out loses its login once the server reloads (nats-server --signal reload)",
    )
    return p


def _settings(a: argparse.Namespace) -> cfgmod.Settings:
    over: dict[str, Any] = {"nats_url": a.nats_url, "log_level": a.log_level}
    if a.cmd in ("up", "serve"):
        over["worker"] = _worker_overrides(a)
        over["bridge"] = {
            "host": a.host,
            "port": a.port,
            "tls_cert": a.tls_cert,
            "tls_key": a.tls_key,
        }
    if a.cmd == "up":
        over["bridge"]["processes"] = a.bridge_processes
        over["up"] = {"workers": a.workers, "nats_port": a.nats_port, "data_dir": a.data_dir}
    if a.cmd == "serve":
        over["bridge"]["processes"] = a.processes
    s = cfgmod.load(a.config, **over)
    role = _local_role(a)
    if role and not s.nats_user:
        # Beside a `tokenbus up`, operator commands log in as its admin and services as their
        # own role on its locked bus, from the credentials it generated.
        from pathlib import Path

        from services.natsconf import role_env

        users = Path(s.up.data_dir) / "nats-locked" / "nats-users.json"
        if (
            users.exists()
            and role in json.loads(users.read_text())
            and _same_server(s.url(), users.parent / "nats.conf")
        ):
            env = role_env(users, role)
            s = s.model_copy(
                update={
                    "nats_user": env["TOKENBUS_NATS_USER"],
                    "nats_password": env["TOKENBUS_NATS_PASSWORD"],
                    "nats_callout": s.nats_callout or env.get("TOKENBUS_NATS_CALLOUT", ""),
                    "nats_tls_ca": s.nats_tls_ca or env.get("TOKENBUS_NATS_TLS_CA", ""),
                    "nats_tls_cert": s.nats_tls_cert or env.get("TOKENBUS_NATS_TLS_CERT", ""),
                    "nats_tls_key": s.nats_tls_key or env.get("TOKENBUS_NATS_TLS_KEY", ""),
                }
            )
    return s


def _nats_tls_files(a: argparse.Namespace) -> Any:
    """The TLS files of `nats-config --tls`: the operator's, or generated (None: plain)."""
    from pathlib import Path

    from services import tlsfiles

    own = (a.tls_server_cert, a.tls_server_key, a.tls_ca)
    if not a.tls:
        if any(own) or a.tls_verify or a.tls_name:
            raise ValueError(
                "--tls-cert, --tls-key, --tls-ca, --tls-name and --tls-verify go with --tls"
            )
        return None
    if any(own):
        if not all(own):
            raise ValueError(
                "your own certificate needs all three: --tls-cert, --tls-key, --tls-ca"
            )
        for f in own:
            if not Path(f).is_file():
                raise ValueError(f"no such file: {f}")
        return tlsfiles.TlsFiles(
            ca=str(Path(a.tls_ca).resolve()),
            server_cert=str(Path(a.tls_server_cert).resolve()),
            server_key=str(Path(a.tls_server_key).resolve()),
            verify=a.tls_verify,
        )
    return tlsfiles.generate(
        Path(a.out).resolve() / "tls", [a.host, *a.tls_name], verify=a.tls_verify
    )


def _same_server(url: str, conf: Path) -> bool:
    """Whether ``url`` names the server that ``conf`` (a generated config) listens as, on
    this machine: the credentials beside it are for that server only."""
    import re
    from urllib.parse import urlsplit

    m = re.search(r'^listen: "([^"]*):(\d+)"', conf.read_text() if conf.exists() else "", re.M)
    if not m:
        return False
    loopback = {"127.0.0.1", "localhost", "::1", m.group(1)}
    for u in url.split(","):
        parts = urlsplit(u.strip() if "://" in u else f"nats://{u.strip()}")
        if parts.hostname in loopback and parts.port == int(m.group(2)):
            return True
    return False


# The sub-commands that never talk to the bus. Every other one (status, keys, router, adapters,
# audit, batches, backup, restore, bench, and any added later) logs in the same way: as the
# admin of the `tokenbus up` whose data folder it finds, unless TOKENBUS_NATS_USER says otherwise.
OFFLINE_COMMANDS = frozenset({"up", "nats-config", "deploy", "health", "compose", "report"})


def _local_role(a: argparse.Namespace) -> str | None:
    """The NATS role a command runs as on the locked bus of a local ``tokenbus up``."""
    if a.cmd == "serve":
        from services.natsconf import SERVICE_ROLE

        return SERVICE_ROLE.get(a.service)
    return None if a.cmd in OFFLINE_COMMANDS else "admin"


async def _serve(a: argparse.Namespace, s: cfgmod.Settings) -> int:
    from services.runtime import Service, listen_socket, serve_until_signalled

    svc: Service
    if a.service == "bridge":
        # Before anything connects: a port that cannot be bound is a usage error, said at
        # once, not a crash for a supervisor to retry.
        b = s.bridge
        listen_socket(b.host, b.port, reuse_port=a.reuse_port or b.processes > 1).close()
    if a.service == "bridge" and s.bridge.processes > 1:
        return await _serve_bridge_processes(a, s)
    if a.service == "openai-http":
        from tokenbus.evaluation.direct import run_direct

        port = a.port if a.port is not None else 8001
        listen_socket(a.host or "127.0.0.1", port, reuse_port=False).close()
        await run_direct(s, a.host or "127.0.0.1", port)
        return 0
    if a.service == "bridge":
        from gateway.bridge import Bridge

        svc = Bridge(s, reuse_port=a.reuse_port)
    elif a.service == "ingress":
        from gateway.ingress import Ingress

        svc = Ingress(s)
    elif a.service == "auth":
        from auth.service import Auth

        svc = Auth(s)
    elif a.service == "ratelimit":
        from auth.ratelimit import RateLimit

        svc = RateLimit(s)
    elif a.service == "filter":
        from filter.service import Filter

        svc = Filter(s)
    elif a.service == "router":
        from router.service import Router

        svc = Router(s)
    elif a.service == "telemetry":
        from telemetry.service import Telemetry

        svc = Telemetry(s)
    else:
        from engine_worker.worker import Worker

        svc = Worker(s)
    await serve_until_signalled(svc)
    return 0


async def _serve_bridge_processes(a: argparse.Namespace, s: cfgmod.Settings) -> int:
    from pathlib import Path

    from services.supervisor import Supervisor
    from tokenbus.launcher import bridge_children, supervise_until_signalled

    # A log of this command's own per process (``bridge-<port>-<i>.log``), apart from the
    # ``bridge-<i>.log`` of a `tokenbus up` in the same data folder.
    sup = Supervisor(
        Path(s.up.data_dir) / "logs", echo=True, fatal_codes={2}, watchdog_s=s.up.watchdog_s
    )
    children = bridge_children(s.bridge, {"TOKENBUS_NATS_URL": s.url()}, tag=f"{s.bridge.port}-")
    for child in children:
        await sup.add(child)
    print(f"bridge: {len(children)} processes on port {s.bridge.port}, logs in {sup.log_dir}")
    return await supervise_until_signalled(sup, s.drain_timeout_s)


async def _status(a: argparse.Namespace, s: cfgmod.Settings) -> int:
    from bus_schemas import codec, subjects
    from router.registry import Registry
    from tokenbus.cli import bus

    nc = await bus.connect(s.url(), s.nats_auth())
    if nc is None:
        return 1
    reg = Registry()

    async def cb(msg: Any) -> None:
        reg.update(codec.decode_map(msg.data))

    await nc.subscribe(subjects.heartbeat_wildcard(), cb=cb)
    await asyncio.sleep(a.wait)
    await nc.drain()
    rows = [r.to_dict() for r in sorted(reg.all_live(), key=lambda r: (r.model, r.replica))]
    if a.json:
        print(json.dumps({"replicas": rows}, indent=2))
        return 0
    if not rows:
        print("no replicas on the bus")
        return 0
    for r in rows:
        # Requests waiting for an engine slot per class (priority/default/flex).
        flow = r.get("flow") or {}
        r["queued"] = (
            "/".join(
                str((flow.get(c) or {}).get("queued", 0)) for c in ("priority", "default", "flex")
            )
            if flow
            else "-"
        )
    cols = [
        "model",
        "replica",
        "backend",
        "in_flight",
        "running",
        "waiting",
        "queued",
        "max_concurrency",
        "tp",
        "pool",
        "draining",
        "kv_routing",
    ]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    ups = [r for r in rows if r.get("upstream")]
    if ups:
        # What each upstream can do, as its worker probed it (docs/deploy.md).
        print()
        for r in ups:
            print(f"{r['replica']} upstream: {_upstream_caps(r['upstream'])}")
    return 0


def _upstream_caps(caps: dict[str, Any]) -> str:
    """An upstream's capabilities on one line: ``usage-on-streams=no resume=no ...``."""

    def word(v: Any) -> str:
        return "?" if v is None else ("yes" if v is True else "no" if v is False else str(v))

    if not caps.get("probed"):
        return "not probed yet (unreachable): prompt counted here, no resume"
    parts = [
        f"usage-on-streams={word(caps.get('stream_usage'))}",
        f"resume={word(caps.get('continue_message'))}",
        f"tokenize={caps.get('tokenize') or 'none'}",
        f"logprobs={word(caps.get('logprobs'))}",
    ]
    if caps.get("overridden"):
        parts.append(f"(set in config: {', '.join(map(str, caps['overridden']))})")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``tokenbus`` command."""
    a = build_parser().parse_args(argv)
    try:
        s = _settings(a)
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
    # `up` speaks to its user in plain lines (the banner); its own info-level log lines
    # (the audit stream made, ...) would land in the middle of them. Its children log at
    # ``s.log_level`` into their files.
    own_level = "warning" if a.cmd == "up" and s.log_level in ("debug", "info") else s.log_level
    tlog.setup(own_level, json=a.cmd == "serve")
    from services.runtime import run

    rc = 0

    async def go() -> None:
        nonlocal rc
        # (--cold-path and --start-cost run without awaiting: Ctrl-C stops them as Python does)
        if a.cmd == "bench" and not a.cold_path and not a.start_cost:
            # SIGTERM (`timeout`, a CI runner's stop) ends a run as Ctrl-C does: the stack it
            # spawned is stopped on the way out, not left running.
            task = asyncio.current_task()
            assert task is not None
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, task.cancel)

            def interrupted() -> None:
                # Ctrl-C the same way, through the loop: left to the default handling, a
                # Ctrl-C during the stack's start under load left the run hanging with
                # nothing printed (CI, three runs of five). A second one stops at once.
                task.cancel()
                loop.remove_signal_handler(signal.SIGINT)

            loop.add_signal_handler(signal.SIGINT, interrupted)
        if a.cmd == "up":
            from tokenbus.launcher import up

            # The worker options given to `up` reach its workers (their own settings are
            # read from file and environment): the bridge's go as arguments.
            child_env = cfgmod.env_overrides({"worker": _worker_overrides(a)})
            rc = await up(s, config_file=a.config, child_env=child_env)
        elif a.cmd == "serve":
            from services.heap import keep_freed
            from services.runtime import GaveUp, StartRefused

            keep_freed(s.malloc_keep_mb)
            try:
                rc = await _serve(a, s)
            except StartRefused as exc:
                print(f"error: {exc}", file=sys.stderr)
                rc = 2
            except GaveUp as exc:
                print(f"error: {exc}", file=sys.stderr)
                rc = exc.exit_code
        elif a.cmd == "status":
            rc = await _status(a, s)
        elif a.cmd == "nats-config":
            from pathlib import Path

            from services.natsconf import generate, parse_worker_hosts

            try:
                tls = _nats_tls_files(a)
                hosts = parse_worker_hosts(a.worker_host) if a.worker_host is not None else None
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                rc = 2
                return
            conf, users = generate(
                Path(a.out),
                host=a.host,
                port=a.port,
                callout=a.callout,
                tls=tls,
                worker_hosts=hosts,
            )
            print(f"wrote {conf} and {users} (mode 0600: one password per role)")
            print(f"start it with: nats-server -c {conf}")
            print("services log in with TOKENBUS_NATS_USER=<role> TOKENBUS_NATS_PASSWORD=...")
            if tls is not None:
                print(
                    f"TLS only: services and clients trust TOKENBUS_NATS_TLS_CA={tls.ca}"
                    + (
                        f"; services present TOKENBUS_NATS_TLS_CERT={tls.client_cert} "
                        f"TOKENBUS_NATS_TLS_KEY={tls.client_key}"
                        if tls.client_cert
                        else ""
                    )
                )
            if a.callout:
                print(
                    f"the auth service answers the callout: TOKENBUS_NATS_CALLOUT="
                    f"{Path(a.out) / 'callout.json'} tokenbus serve auth; clients connect "
                    "with their API key as the token"
                )
        elif a.cmd == "keys":
            from tokenbus.cli import keys_cli

            rc = await keys_cli.main(a, s.url(), s.nats_auth(), s.router.aliases)
        elif a.cmd == "deploy":
            from tokenbus.cli import deploy as deploy_cli

            rc = deploy_cli.init(a)
        elif a.cmd == "health":
            from tokenbus.cli import deploy as deploy_cli

            rc = deploy_cli.health(a)
        elif a.cmd == "compose":
            from tokenbus.cli import compose as compose_cli

            rc = compose_cli.main(a)
        elif a.cmd == "audit":
            from tokenbus.cli import audit_cli

            rc = await audit_cli.run(a, s)
        elif a.cmd == "batches":
            from tokenbus.cli import batches_cli

            rc = await batches_cli.run(a, s)
        elif a.cmd in ("backup", "restore"):
            from tokenbus.cli import backup as backup_cli

            rc = await backup_cli.run(a, s)
        elif a.cmd == "bench":
            if a.nemesis:
                from tokenbus.evaluation.nemesis import run_from_args

                rc = await run_from_args(a)
            elif a.tenants:  # its scenarios build on bench's stack and requests
                from tokenbus.evaluation.tenants import run_tenants

                rc = await run_tenants(a)
            elif a.sync_cost:
                from tokenbus.evaluation.syncbench import run_sync_bench

                rc = await run_sync_bench(a)
            elif a.cold_path:
                from tokenbus.evaluation.coldpath import run_cold_path

                rc = run_cold_path(a)
            elif a.start_cost:
                from tokenbus.evaluation.startcost import run_start_cost

                rc = run_start_cost(a)
            elif a.pd:
                from tokenbus.evaluation.pdbench import run_pd_bench

                rc = await run_pd_bench(a)
            elif a.adapters:
                from tokenbus.evaluation.adapterbench import run_adapter_bench

                rc = await run_adapter_bench(a)
            elif a.batch_lines:
                from tokenbus.evaluation.batchbench import run_batch_bench

                rc = await run_batch_bench(a)
            elif a.kv_sessions:
                from tokenbus.evaluation.kvbench import run_kv_sessions

                rc = await run_kv_sessions(a)
            elif a.routing_trace or a.trace_file:
                from tokenbus.evaluation.routebench import run_routing_trace

                rc = await run_routing_trace(a)
            else:
                from tokenbus.evaluation import bench

                rc = await bench.main(a, s)
        elif a.cmd == "router":
            from tokenbus.cli import router_cli

            rc = await router_cli.main(a, s)
        elif a.cmd == "adapters":
            from tokenbus.cli import adapters_cli

            rc = await adapters_cli.main(a, s)
        elif a.cmd == "report":
            from tokenbus.evaluation.report import markdown, report

            try:
                # The store the telemetry service writes: its SQLite file, or PostgreSQL.
                pg = s.telemetry.store == "postgres" and s.telemetry.postgres_dsn
                db = a.db or (s.telemetry.postgres_dsn if pg else s.telemetry.db_path)
                summary = report(db, a.out, since_s=a.since, bucket_s=a.bucket)
            except FileNotFoundError as exc:
                print(f"error: {exc}")
                rc = 1
            else:
                print(markdown(summary))
                print("\n".join(summary["files"]))
                if "plots" in summary:  # skipped: say so, and how to get them
                    print(f"no plots: {summary['plots']}", file=sys.stderr)

    try:
        run(go())
    except asyncio.CancelledError:  # a bench run stopped by SIGTERM
        sys.exit(128 + signal.SIGTERM)
    sys.exit(rc)
