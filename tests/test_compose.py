"""Compose files as operators use them: the shipped one and ``tokenbus compose generate``'s
GPU topologies parse, and every service command is a ``tokenbus`` invocation the CLI takes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.deploybundle import NATS_UID, ROLE_UID
from services.natsconf import SERVICE_ROLE, parse_worker_hosts
from tests.support.repo import ROOT, run_cli
from tokenbus.cli import build_parser
from tokenbus.cli.compose import plan
from tokenbus.launcher import nats_server_binary


def _commands(doc: dict[str, Any]) -> dict[str, list[str]]:
    return {name: svc["command"] for name, svc in doc["services"].items() if "command" in svc}


def _devices(svc: dict[str, Any]) -> list[str]:
    devs = svc["deploy"]["resources"]["reservations"]["devices"]
    return [d for dev in devs for d in dev["device_ids"]]


COMPOSE = ROOT / "compose"


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((COMPOSE / name).read_text())
    return doc


def _tokenbus_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The long-running tokenbus services (not the one-shot init, nor the cli tool)."""
    return {
        name: svc
        for name, svc in doc["services"].items()
        if name not in ("nats", "init", "cli") and svc.get("image", "").startswith("tokenbus")
    }


def _role(name: str) -> str:
    """The service a compose service runs: its name (bridge-b, the `gateways` profile's
    second bridge, runs the bridge)."""
    return "bridge" if name == "bridge-b" else name


@pytest.mark.unit
def test_the_shipped_compose_file_runs_only_commands_the_cli_takes() -> None:
    doc = _load("docker-compose.yml")
    cmds = _commands(doc)
    assert {"bridge", "ingress", "router", "worker", "auth", "ratelimit", "filter"} <= set(cmds)
    for name, svc in _tokenbus_services(doc).items():
        args = build_parser().parse_args(svc["command"])  # exits (fails the test) on a bad one
        assert (args.cmd, args.service) == ("serve", _role(name)), name
    init = build_parser().parse_args(doc["services"]["init"]["command"])
    assert (init.cmd, init.deploy_cmd, init.dir) == ("deploy", "init", "/config")


@pytest.mark.unit
def test_every_service_logs_in_as_its_own_role_under_its_own_uid() -> None:
    doc = _load("docker-compose.yml")
    svcs = {**_tokenbus_services(doc), "cli": doc["services"]["cli"]}
    for name, svc in svcs.items():
        role = "admin" if name == "cli" else SERVICE_ROLE[_role(name)]
        env = svc["environment"]
        assert env["TOKENBUS_NATS_LOGIN_FILE"] == f"/config/roles/{role}.json", name
        assert svc["user"] == str(ROLE_UID[role]), name
        assert "TOKENBUS_NATS_USER" not in env and "TOKENBUS_NATS_PASSWORD" not in env
        assert env["TOKENBUS_NATS_URL"].startswith("tls://")
        assert env["TOKENBUS_NATS_TLS_CA"] == "/config/tls/ca.pem"
        assert "config:/config:ro" in svc["volumes"], name
        assert ("TOKENBUS_NATS_CALLOUT" in env) == (name == "auth"), name
    assert doc["services"]["nats"]["user"] == str(NATS_UID)
    assert doc["services"]["init"]["user"] == "0"  # the one step that runs as root


@pytest.mark.unit
def test_nats_is_private_and_everything_waits_for_its_health() -> None:
    doc = _load("docker-compose.yml")
    nats = doc["services"]["nats"]
    assert "ports" not in nats  # reachable inside the compose network only
    assert nats["command"] == ["-c", "/config/nats.conf"]
    assert "healthz" in " ".join(nats["healthcheck"]["test"])
    assert nats["depends_on"] == {"init": {"condition": "service_completed_successfully"}}
    for name, svc in _tokenbus_services(doc).items():
        assert svc["depends_on"]["nats"] == {"condition": "service_healthy"}, name
        assert svc["restart"] == "unless-stopped", name
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert svc["cpus"] and svc["mem_limit"], name
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "tokenbus", "health"], name
        health = build_parser().parse_args(test[2:])
        if _role(name) == "bridge":
            assert health.url == "http://127.0.0.1:8000/ready"
        else:
            assert health.file == svc["environment"]["TOKENBUS_HEALTH_FILE"], name
    public = _load("nats-public.yml")
    assert public["services"]["nats"]["ports"] == ["${TOKENBUS_NATS_PUBLIC_PORT:-4222}:4222"]


@pytest.mark.unit
def test_the_cluster_override_runs_three_nodes_and_gives_services_every_url() -> None:
    doc = _load("cluster.yml")
    nodes = {n: doc["services"][n] for n in ("nats", "nats-1", "nats-2")}
    assert [n["command"] for n in nodes.values()] == [
        ["-c", f"/config/nats-{i}.conf"] for i in range(3)
    ]
    init = build_parser().parse_args(doc["services"]["init"]["command"])
    assert init.nodes == 3
    base = _load("docker-compose.yml")
    # The override's init replaces the base's: it gives away every volume that one does (its
    # workers died on a spool they could not write, the base's chown of it dropped).
    base_init = build_parser().parse_args(base["services"]["init"]["command"])
    assert set(base_init.chown) <= set(init.chown), set(base_init.chown) - set(init.chown)
    mounted = {v.split(":")[1] for v in doc["services"]["init"]["volumes"]}
    assert {c.split("=")[0] for c in init.chown} <= mounted
    for name in _tokenbus_services(base):
        env = doc["services"][name]["environment"]
        assert env["TOKENBUS_KV_REPLICAS"] == "3", name
        assert env["TOKENBUS_NATS_URL"].split(",") == [f"tls://nats-{i}:4222" for i in range(3)]


@pytest.mark.stack
def test_deploy_init_writes_each_role_a_login_of_its_own_and_keeps_them(tmp_path: Path) -> None:
    out = tmp_path / "bus"
    r = run_cli("deploy", "init", "--dir", str(out), "--nodes", "3")
    assert r.returncode == 0, r.stderr
    first = {p.name: p.read_text() for p in (out / "roles").iterdir()}
    assert set(first) == {f"{role}.json" for role in ROLE_UID}
    logins = [json.loads(t) for t in first.values()]
    assert len({x["password"] for x in logins}) == len(logins)  # no two roles share one
    for p in out.rglob("*"):
        if p.name != "tls.json" and (p.suffix in (".json", ".conf") or p.name.endswith("key.pem")):
            assert p.stat().st_mode & 0o077 == 0, p  # secrets: owner only
    confs = [(out / f"nats-{i}.conf").read_text() for i in range(3)]
    for i, conf in enumerate(confs):
        assert 'include "auth.conf"' in conf and f'server_name: "nats-{i}"' in conf
        # The monitoring port in the network (the telemetry service exports it), never
        # published: the nats services publish no port at all (below).
        assert 'http: "0.0.0.0:8222"' in conf and "tls {" in conf
        assert f"@nats-{i}:6222" not in conf and conf.count("@nats-") == 2  # routes to the others
    assert "auth_callout" in (out / "auth.conf").read_text()
    again = run_cli("deploy", "init", "--dir", str(out), "--nodes", "3")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_text() for p in (out / "roles").iterdir()} == first
    bad = run_cli("deploy", "init", "--dir", str(out), "--chown", "/x=nobody")
    assert bad.returncode == 2 and "PATH=ROLE" in bad.stderr


@pytest.mark.stack
def test_the_generated_configs_are_accepted_by_nats_server(tmp_path: Path) -> None:
    out = tmp_path / "bus"
    assert run_cli("deploy", "init", "--dir", str(out), "--nodes", "3").returncode == 0
    for name in ("nats-0.conf", "nats-1.conf", "nats-2.conf"):
        r = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(out / name)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, (name, r.stdout, r.stderr)


@pytest.mark.stack
def test_the_observability_profile_runs_prometheus_grafana_and_jaeger_provisioned() -> None:
    """`--profile observability` (docs/telemetry.md): every file it mounts is in the tree, and
    what they point at fits together: Prometheus's jobs reach the telemetry service and the
    bridges and load the alert rules, Grafana's data sources and dashboard provider find what
    compose mounts, exemplars link to the Jaeger that receives the services' OTLP."""
    doc = _load("docker-compose.yml")
    svcs = doc["services"]
    extra = {"prometheus", "grafana", "jaeger"}
    for name in extra:
        svc = svcs[name]
        assert svc["profiles"] == ["observability"], name
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", [])), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (COMPOSE / src).resolve().exists(), (name, vol)
    # the stack runs without a profile (but the `gateways` profile's second bridge)
    assert not any(svcs[n].get("profiles") for n in _tokenbus_services(doc) if n != "bridge-b")
    prom = svcs["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "../deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert all((ROOT / "deploy" / "prometheus" / f).is_file() for f in cfg["rule_files"])
    targets = {
        j["job_name"]: (d["names"], d["port"]) for j in cfg["scrape_configs"]
        for d in j["dns_sd_configs"]
    }  # fmt: skip
    telemetry_port = int(svcs["telemetry"]["ports"][0].rsplit(":", 1)[1])
    assert targets == {"telemetry": (["telemetry"], telemetry_port), "bridge": (["bridge"], 8000)}
    assert svcs["telemetry"]["environment"]["TOKENBUS_TELEMETRY__METRICS_HOST"] == "0.0.0.0"
    # Grafana: its data sources, and the dashboard where the provider looks for it.
    grafana = svcs["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounts["../deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((prov / "dashboards" / "tokenbus.yml").read_text())["providers"]
    dashboard = mounts["../deploy/grafana/tokenbus.json"]
    assert dashboard.rsplit("/", 1)[0] == provider["options"]["path"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard
    sources = yaml.safe_load((prov / "datasources" / "tokenbus.yml").read_text())["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090"
    (link,) = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id" and by_uid[link["datasourceUid"]]["type"] == "jaeger"
    assert by_uid["jaeger"]["url"] == "http://jaeger:16686"
    # Traces: the services export OTLP where TOKENBUS_OTLP_ENDPOINT says (Jaeger's 4318).
    assert svcs["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name, svc in _tokenbus_services(doc).items():
        env = svc["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${TOKENBUS_OTLP_ENDPOINT:-}", name
    tool = shutil.which("docker-compose")
    if tool is not None:
        r = subprocess.run(
            [tool, "-f", str(COMPOSE / "docker-compose.yml"), "--profile", "observability",
             "config", "-q"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr


@pytest.mark.stack
def test_the_compose_files_pass_the_compose_schema() -> None:
    """docker-compose validates against the compose specification's schema."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (Debian's docker-compose validates)")
    for extra in ([], ["cluster.yml"], ["nats-public.yml"]):
        files = [a for f in ["docker-compose.yml", *extra] for a in ("-f", str(COMPOSE / f))]
        for profile in ([], ["--profile", "gateways"]):
            r = subprocess.run(
                [tool, *files, *profile, "config", "-q"], capture_output=True, text=True, timeout=60
            )
            assert r.returncode == 0, (extra, profile, r.stderr)


@pytest.mark.stack
@pytest.mark.parametrize(
    ("gpus", "tp", "want"),
    [
        (8, "8", [[0, 1, 2, 3, 4, 5, 6, 7]]),  # ScaleLLM's one TP8 replica
        (8, "2,2,2,2", [[0, 1], [2, 3], [4, 5], [6, 7]]),  # four TP2 replicas
        (8, "4,2,2", [[0, 1, 2, 3], [4, 5], [6, 7]]),  # the tiered mix
        (4, "1,1,2", [[0], [1], [2, 3]]),
        (8, "2,2", [[0, 1], [2, 3]]),  # GPUs left free is allowed
    ],
)
def test_topologies_pin_each_worker_to_its_gpus(
    gpus: int, tp: str, want: list[list[int]], tmp_path: Path
) -> None:
    out = tmp_path / "workers.yml"
    r = run_cli(
        "compose", "generate", "--gpus", str(gpus), "--tp", tp, "--model", "m",
        "--pool", "high_tp:4", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    svcs = doc["services"]
    owner = svcs.pop("hf-cache-owner")
    assert [[int(d) for d in _devices(s)] for s in svcs.values()] == want
    assert "hf-cache" in doc["volumes"]
    assert owner["entrypoint"][:2] == ["chown", "-R"]
    for svc in svcs.values():
        n = len(_devices(svc))
        args = build_parser().parse_args(svc["command"])
        assert (args.cmd, args.service, args.backend, args.model) == (
            "serve",
            "worker",
            "vllm",
            "m",
        )
        assert args.tp == n and f"tensor_parallel_size={n}" in svc["command"]
        assert args.pool == ("high_tp" if n == 4 else "default")
        assert svc["volumes"] == ["config:/config:ro", "hf-cache:/hf-cache"]
        assert svc["user"] == str(ROLE_UID["worker"])
        assert svc["environment"]["TOKENBUS_NATS_LOGIN_FILE"] == "/config/roles/worker.json"
        assert svc["depends_on"]["nats"] == {"condition": "service_healthy"}


@pytest.mark.unit
def test_explicit_gpu_sets() -> None:
    groups = plan(8, None, "6,7;0,1,2,3", [])
    assert [g.gpus for g in groups] == [(6, 7), (0, 1, 2, 3)] and [g.tp for g in groups] == [2, 4]


@pytest.mark.stack
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--gpus", "8", "--devices", "0,1;1,2"], "GPU 1 is given to two workers"),
        (["--gpus", "8", "--tp", "4,4,2"], "GPU 8 does not exist"),
        (["--gpus", "4", "--devices", "0,1;4,5"], "GPU 4 does not exist"),
        (["--gpus", "8", "--tp", "3"], "TP 3 does not divide"),
        (["--gpus", "8", "--tp", "2", "--devices", "0,1"], "--tp"),
        (["--gpus", "8"], "--tp"),
        (["--gpus", "8", "--tp", "two"], "integers"),
        (["--gpus", "8", "--tp", "2", "--pool", "fast"], "NAME:TP"),
        (["--gpus", "0", "--tp", "1"], "at least 1"),
    ],
)
def test_impossible_topologies_are_refused_with_the_reason(args: list[str], why: str) -> None:
    r = run_cli("compose", "generate", "--model", "m", *args)
    assert r.returncode == 2 and why in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""


@pytest.mark.stack
def test_a_gpu_host_on_its_own_serves_two_models_with_ids_unique_to_the_host(
    tmp_path: Path,
) -> None:
    """The 4-host layout of docs/deploy.md: a 70B model at TP4 and four 8B workers at TP1 on
    one 8-GPU host, the bus elsewhere; every replica id names the host, no service name is
    another file's, and nothing refers to a stack that is not there."""
    big, small = "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"
    files = {}
    for host in ("gpu-1", "gpu-2"):
        out = tmp_path / f"{host}.yml"
        r = run_cli(
            "compose", "generate", "--gpus", "8", "--host", host,
            "--model", big, "--tp", "4", "--model", small, "--tp", "1,1,1,1",
            "--bus", "tls://nats-1.example:4222,tls://nats-2.example:4222",
            "--login-file", "/etc/tokenbus/worker.json", "--ca", "/etc/tokenbus/ca.pem",
            "--out", str(out),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        files[host] = yaml.safe_load(out.read_text())["services"]
        # The file names the login of this host's own, with every replica id it serves.
        (hint,) = re.findall(r"--worker-host (\S+)", out.read_text())
        ids = {
            build_parser().parse_args(s["command"]).replica
            for n, s in files[host].items()
            if n.startswith("vllm-")
        }
        assert parse_worker_hosts([hint]) == {host: sorted(ids, key=hint.index)}
    one = files["gpu-1"]
    owner = one.pop("hf-cache-owner")
    assert owner["image"] == "tokenbus-vllm:latest"  # no stack image on a GPU host
    assert sorted(one) == [
        "vllm-llama-3.1-70b-instruct-0",
        *(f"vllm-llama-3.1-8b-instruct-{i}" for i in range(4)),
    ]
    replicas = {}
    for name, svc in one.items():
        args = build_parser().parse_args(svc["command"])
        replicas[args.replica] = (args.model, args.tp, [int(d) for d in _devices(svc)])
        env = svc["environment"]
        assert env["TOKENBUS_NATS_URL"].startswith("tls://nats-1.example:4222")
        assert svc["volumes"][:2] == [
            "/etc/tokenbus/worker.json:/config/roles/worker.json:ro",
            "/etc/tokenbus/ca.pem:/config/tls/ca.pem:ro",
        ]
        assert "nats" not in svc["depends_on"], name
        assert not any(v.startswith("config:") for v in svc["volumes"])
    assert replicas == {
        "gpu-1-llama-3.1-70b-instruct-tp4-0": (big, 4, [0, 1, 2, 3]),
        **{f"gpu-1-llama-3.1-8b-instruct-tp1-{i}": (small, 1, [4 + i]) for i in range(4)},
    }
    # The other host's file: the same services, every replica id its own.
    two = [build_parser().parse_args(s["command"]).replica for s in files["gpu-2"].values()
           if "command" in s]  # fmt: skip
    assert not set(two) & set(replicas) and all(r.startswith("gpu-2-") for r in two)


@pytest.mark.stack
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--model", "a", "--tp", "4", "--model", "b"], "one --tp for each --model"),
        (["--model", "a", "--tp", "4", "--model", "a", "--tp", "4"], "given twice"),
        (["--model", "a", "--tp", "8", "--bus", "tls://n:4222"], "--login-file"),
        (["--model", "a", "--tp", "8", "--bus", "tls://n:4222", "--login-file", "w"], "--ca"),
        (["--model", "a", "--tp", "8", "--login-file", "w"], "go with --bus"),
        (["--model", "a", "--tp", "4", "--model", "b", "--tp", "4,4"], "GPU 8 does not exist"),
    ],
)
def test_several_models_and_a_bus_elsewhere_are_refused_when_wrong(
    args: list[str], why: str
) -> None:
    r = run_cli("compose", "generate", "--gpus", "8", *args)
    assert r.returncode == 2 and why in r.stderr, (r.returncode, r.stderr)


@pytest.mark.stack
async def test_cluster_routes_are_encrypted_and_admit_only_nodes_of_the_ca(tmp_path: Path) -> None:
    """Two nodes of `deploy init --nodes 3`'s own configs (moved to loopback ports) route
    over TLS with the generated certificate; a node whose certificate another CA signed is
    refused."""
    import asyncio
    import re
    import ssl

    import httpx

    from tests.support.natsserver import spawn_nats
    from tests.support.ports import free_port
    from tests.support.waits import wait_for

    out = tmp_path / "bus"
    assert run_cli("deploy", "init", "--dir", str(out), "--nodes", "3").returncode == 0
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]

    def local(i: int, foreign: Path | None = None) -> Path:
        text = (out / f"nats-{i}.conf").read_text()
        client, monitor, route = ports[i]
        text = text.replace('listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{client}"')
        text = text.replace('http: "0.0.0.0:8222"', f'http: "127.0.0.1:{monitor}"')
        text = text.replace('listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{route}"')
        text = text.replace('"/data/jetstream"', json.dumps(str(tmp_path / f"js-{i}")))
        pw = re.search(r'user: "route", password: "([^"]+)"', text)
        assert pw is not None
        dial = pw.group(1)
        if foreign is not None:  # certificates of another CA
            text = text.replace(str(out / "tls"), str(foreign / "tls"))
        others = ", ".join(
            json.dumps(f"nats://route:{dial}@localhost:{ports[j][2]}") for j in range(3) if j != i
        )
        text = re.sub(r"routes: \[[^\]]*\]", f"routes: [{others}]", text)
        path = out / f"local-{i}.conf"
        path.write_text(text)
        return path

    procs = [spawn_nats(ports[i][0], "-c", str(local(i))) for i in range(2)]
    try:
        async with httpx.AsyncClient() as h:

            async def routes(node: int) -> list[Any]:
                r = await h.get(f"http://127.0.0.1:{ports[node][1]}/routez")
                return list(r.json().get("routes") or [])

            await wait_for(lambda: routes(0), timeout=30, what="the two nodes routing")
            # The route port speaks TLS at once, and only to a peer the CA signed: a TLS
            # handshake with the node's own certificate succeeds, plain bytes get nothing back.
            tls = out / "tls"
            ctx = ssl.create_default_context(cafile=str(tls / "ca.pem"))
            ctx.load_cert_chain(str(tls / "server.pem"), str(tls / "server-key.pem"))
            _, writer = await asyncio.open_connection(
                "127.0.0.1", ports[0][2], ssl=ctx, server_hostname="localhost"
            )
            assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", ports[0][2])
            writer.write(b"CONNECT {}\r\nPING\r\n")
            await writer.drain()
            assert b"PONG" not in await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            # A third node with the route password but a certificate of another CA: the
            # others' dials to it fail its certificate check (said in its log), and it
            # routes to neither.
            other = tmp_path / "other"
            assert run_cli("deploy", "init", "--dir", str(other), "--nodes", "3").returncode == 0
            log = tmp_path / "intruder.log"
            procs.append(
                spawn_nats(ports[2][0], "-c", str(local(2, foreign=other)), "-l", str(log))
            )
            await wait_for(
                lambda: log.exists() and "handshake error" in log.read_text(),
                timeout=30,
                what="the third node refusing a route's certificate",
            )
            assert not await routes(2)
            assert {r["remote_name"] for r in [*await routes(0), *await routes(1)]} == {
                "nats-0",
                "nats-1",
            }
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


@pytest.mark.stack
def test_deploy_init_renews_the_nodes_certificate_from_the_same_ca(tmp_path: Path) -> None:
    """Run again, deploy init keeps a certificate that is not near its end; with
    --renew-certs it issues the nodes' certificate again from the CA the clients trust
    (usable for routes: server and client use), and keeps the CA."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    out = tmp_path / "bus"
    tls = out / "tls"
    assert run_cli("deploy", "init", "--dir", str(out), "--nodes", "3").returncode == 0
    ca, cert = (tls / "ca.pem").read_bytes(), (tls / "server.pem").read_bytes()
    assert run_cli("deploy", "init", "--dir", str(out), "--nodes", "3").returncode == 0
    assert (tls / "server.pem").read_bytes() == cert
    r = run_cli("deploy", "init", "--dir", str(out), "--nodes", "3", "--renew-certs")
    assert r.returncode == 0, r.stderr
    assert (tls / "ca.pem").read_bytes() == ca
    new = x509.load_pem_x509_certificate((tls / "server.pem").read_bytes())
    assert new.public_bytes(serialization_pem()) != cert
    new.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    eku = set(new.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= eku
    names = new.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"nats-0", "nats-1", "nats-2"} <= set(names.get_values_for_type(x509.DNSName))


def serialization_pem() -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM


@pytest.mark.stack
def test_a_role_password_is_changed_by_dropping_it_and_running_init_again(tmp_path: Path) -> None:
    """docs/deploy.md's password rotation: a role's entry removed from nats-users.json, deploy
    init makes it a new one (its login file and the nodes' hash), every other kept."""
    out = tmp_path / "bus"
    assert run_cli("deploy", "init", "--dir", str(out)).returncode == 0
    users = out / "nats-users.json"
    before = json.loads(users.read_text())
    login = json.loads((out / "roles" / "worker.json").read_text())
    assert login["password"] == before["worker"]
    users.write_text(json.dumps({k: v for k, v in before.items() if k != "worker"}))
    assert run_cli("deploy", "init", "--dir", str(out)).returncode == 0
    after = json.loads(users.read_text())
    assert after["worker"] != before["worker"]
    assert {k: v for k, v in after.items() if k != "worker"} == {
        k: v for k, v in before.items() if k != "worker"
    }
    assert json.loads((out / "roles" / "worker.json").read_text())["password"] == after["worker"]


@pytest.mark.unit
def test_the_gateways_profile_runs_a_second_bridge_to_restart_one_at_a_time() -> None:
    """Two bridges on one host, each on a port of its own, so that one drains and restarts
    while a load balancer sends everything to the other: the second is the first (command,
    role, drain and grace, the /ready health check) on another published port, and runs only
    with the profile. The cluster override gives it every node's URL too."""
    doc = _load("docker-compose.yml")
    one, two = doc["services"]["bridge"], doc["services"]["bridge-b"]
    assert "profiles" not in one and two["profiles"] == ["gateways"]
    assert {k: v for k, v in two.items() if k not in ("profiles", "ports")} == {
        k: v for k, v in one.items() if k != "ports"
    }
    assert one["ports"] == ["${TOKENBUS_HTTP_PORT:-8000}:8000"]
    assert two["ports"] == ["${TOKENBUS_HTTP_PORT_B:-8001}:8000"]
    env = two["environment"]
    assert env["TOKENBUS_BRIDGE__UNREADY_S"] == "5" and env["TOKENBUS_DRAIN_TIMEOUT_S"] == "605"
    assert two["stop_grace_period"] == "620s"
    cluster = _load("cluster.yml")["services"]
    assert cluster["bridge-b"]["environment"] == cluster["bridge"]["environment"]
    # One port in front of both: a balancer that checks /ready (tests/test_balancer.py runs
    # its config in front of real bridges).
    lb = doc["services"]["balancer"]
    assert lb["profiles"] == ["gateways"]
    assert lb["volumes"] == ["./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro"]
    assert lb["ports"] == ["${TOKENBUS_LB_PORT:-8080}:8080"]
    assert set(lb["depends_on"]) == {"bridge", "bridge-b"}
    cfg = (COMPOSE / "haproxy.cfg").read_text()
    assert "bind :8080" in cfg and "option httpchk GET /ready" in cfg
