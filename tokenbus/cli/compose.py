"""``tokenbus compose generate``: a docker compose file of vLLM workers for a GPU topology.

One container per tensor-parallel group, pinned to its GPUs with ``device_ids``; ScaleLLM's
layouts are one command each: ``--gpus 8 --tp 8`` (one TP8 replica), ``--tp 2,2,2,2`` (four
TP2 replicas), ``--tp 4,2,2 --pool high_tp:4`` (a tiered mix, the TP4 replica in the
``high_tp`` pool, the others in ``default``). Impossible layouts are refused with the
reason: a GPU given twice or beyond the host's count, a group whose size is not its TP
degree, a TP degree that does not divide the host's GPU count.

Several models in one file: ``--model A --tp 4 --model B --tp 1,1,1,1`` (each ``--tp`` or
``--devices`` belongs to the ``--model`` before it; GPUs are given in order across them).
Replica ids are unique by construction: ``<host>-<model>-tp<TP>-<i>`` (``--host``, by
default this machine's name), and a worker whose id another process serves refuses to
start anyway (engine_worker/claim.py).

By default the file holds the worker services only, run beside the stack's compose file
(``docker compose -f compose/docker-compose.yml -f workers.yml up``). With ``--bus`` it
stands alone on a GPU host: the workers reach the bus elsewhere by URL, with the worker
role's login file (and the bus's CA) from this host's disk.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any

from services.deploybundle import ROLE_UID

HF_CACHE = "/hf-cache"
HEALTH_FILE = "/tmp/tokenbus-health.json"


@dataclass(frozen=True, slots=True)
class Group:
    """One vLLM worker: its GPUs, its pool and (plan_models) its model."""

    gpus: tuple[int, ...]
    pool: str
    model: str = ""

    @property
    def tp(self) -> int:
        return len(self.gpus)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compose", help="write docker compose files for a deployment")
    csub = p.add_subparsers(dest="compose_cmd", required=True)
    g = csub.add_parser("generate", help="vLLM workers for a GPU topology, one per TP group")
    g.add_argument("--gpus", type=int, required=True, help="GPUs on the host")
    g.add_argument(
        "--tp",
        action="append",
        help="tensor-parallel degree of each worker of the --model before it, e.g. 2,2,4 "
        "(GPUs given in order)",
    )
    g.add_argument(
        "--devices",
        action="append",
        help="the GPUs of each worker instead, e.g. '0,1;2,3;4,5,6,7' (TP = group size)",
    )
    g.add_argument(
        "--model",
        action="append",
        required=True,
        help="a model its workers serve; give it again (each with its --tp) for several",
    )
    g.add_argument(
        "--host",
        default=socket.gethostname(),
        help="this host's name, in every replica id (default: this machine's)",
    )
    g.add_argument(
        "--bus",
        help="stand alone: the NATS URL(s) of the bus elsewhere, e.g. tls://nats-1:4222,"
        "tls://nats-2:4222 (without: beside the stack's compose file)",
    )
    g.add_argument("--login-file", help="with --bus: the worker role's login file on this host")
    g.add_argument("--ca", help="with --bus: the bus's CA certificate on this host (tls://)")
    g.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME:TP",
        help="workers of this TP degree go to pool NAME (tiered routing); others: default",
    )
    g.add_argument(
        "--site",
        help="with --bus: the host is at this site (docs/deploy.md, Sites): --bus is the "
        "site's own nats-server, --login-file its sites/<SITE>/roles/worker.json, and the "
        "workers announce the site (TOKENBUS_SITE)",
    )
    g.add_argument(
        "--bridge-login",
        metavar="FILE",
        help="with --site: a bridge at the site too, serving the site's users on port 8000 "
        "(its login sites/<SITE>/roles/bridge.json of `deploy init --site-bridge`; the "
        "stages and router in-process, the site's replicas first, limits kept through a cut "
        "link from half of each: docs/deploy.md, Sites)",
    )
    g.add_argument("--out", help="write here (default: standard output)")


def plan(gpus: int, tp: str | None, devices: str | None, pools: list[str]) -> list[Group]:
    """The worker groups of a topology, or ValueError saying why it is impossible."""
    if gpus < 1:
        raise ValueError("--gpus must be at least 1")
    if (tp is None) == (devices is None):
        raise ValueError("give the workers' TP degrees (--tp) or their GPUs (--devices)")
    by_tp: dict[int, str] = {}
    for spec in pools:
        name, _, degree = spec.partition(":")
        if not name or not degree.isdigit():
            raise ValueError(f"--pool {spec!r}: expected NAME:TP, e.g. high_tp:4")
        by_tp[int(degree)] = name
    sets: list[tuple[int, ...]] = []
    try:
        if tp is not None:
            start = 0
            for d in (int(x) for x in tp.split(",")):
                sets.append(tuple(range(start, start + d)))
                start += d
        else:
            assert devices is not None
            sets = [tuple(int(x) for x in grp.split(",")) for grp in devices.split(";")]
    except ValueError:
        raise ValueError("--tp and --devices take integers, e.g. --tp 2,2,4") from None
    seen: set[int] = set()
    for s in sets:
        if not s:
            raise ValueError("a worker needs at least one GPU")
        if gpus % len(s):
            raise ValueError(f"TP {len(s)} does not divide the host's {gpus} GPUs")
        for gpu in s:
            if gpu < 0 or gpu >= gpus:
                raise ValueError(
                    f"GPU {gpu} does not exist: the host has {gpus} (0..{gpus - 1}); "
                    f"these workers need {sum(len(x) for x in sets)}"
                )
            if gpu in seen:
                raise ValueError(f"GPU {gpu} is given to two workers")
            seen.add(gpu)
    return [Group(s, by_tp.get(len(s), "default")) for s in sets]


def slug(model: str) -> str:
    """A model's name as it goes into service names and replica ids: its last path part,
    lower case, other characters than letters, digits, ``.`` and ``-`` as ``-``."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9.-]+", "-", name).strip("-.") or "model"


@dataclass(frozen=True, slots=True)
class Bus:
    """Where standalone workers find the bus (``--bus``): URLs, and files on the host."""

    url: str
    login_file: str
    ca: str | None = None


def plan_models(
    gpus: int,
    models: list[str],
    tps: list[str] | None,
    devices: list[str] | None,
    pools: list[str],
) -> list[Group]:
    """Each model's groups, GPUs given in order across them; ValueError saying why not."""
    tps, devices = tps or [], devices or []
    if bool(tps) == bool(devices):
        raise ValueError("give the workers' TP degrees (--tp) or their GPUs (--devices)")
    specs = tps or devices
    if len(specs) != len(models):
        flag = "--tp" if tps else "--devices"
        raise ValueError(f"give one {flag} for each --model ({len(models)} models, {len(specs)})")
    if len(set(models)) != len(models):
        raise ValueError("a --model is given twice: give it one --tp with all its workers")
    joined = ",".join(tps) if tps else ";".join(devices)
    groups = plan(gpus, joined if tps else None, joined if devices else None, pools)
    out: list[Group] = []
    for model, spec in zip(models, specs, strict=True):
        n = len(spec.split(",")) if tps else len(spec.split(";"))
        out += [Group(g.gpus, g.pool, model) for g in groups[len(out) : len(out) + n]]
    return out


def services(
    groups: list[Group], *, host: str = "", bus: Bus | None = None, site: str = ""
) -> dict[str, Any]:
    """The compose document: one vLLM worker service per group, and the shared HF cache.
    ``bus``: the file stands alone (no stack beside it); ``site``: the site it is at."""
    out: dict[str, Any] = {}
    host = slug(host) if host else "host"
    counts: dict[str, int] = {}
    for g in groups:
        served = g.model
        i = counts[served] = counts.get(served, -1) + 1
        ids = [str(x) for x in g.gpus]
        # Inside the container its GPUs are numbered from 0: vLLM takes all it sees.
        cmd = ["serve", "worker", "--backend", "vllm", "--model", served]
        replica = f"{host}-{slug(served)}-tp{g.tp}-{i}"
        cmd += ["--replica", replica, "--tp", str(g.tp), "--pool", g.pool]
        cmd += ["--engine-arg", f"tensor_parallel_size={g.tp}"]
        env = {
            "TOKENBUS_NATS_URL": bus.url if bus else "tls://nats:4222",
            "TOKENBUS_NATS_TLS_CA": "/config/tls/ca.pem",
            "TOKENBUS_NATS_LOGIN_FILE": "/config/roles/worker.json",
            "TOKENBUS_HEALTH_FILE": HEALTH_FILE,
            "TOKENBUS_LOOP_WATCHDOG_S": "30",
            # vLLM drains its running requests: longer than the stages' 30 s.
            "TOKENBUS_DRAIN_TIMEOUT_S": "120",
            "HF_HOME": HF_CACHE,
            "HOME": "/tmp",
            **({"TOKENBUS_SITE": site} if site else {}),
        }
        depends: dict[str, Any] = {
            "hf-cache-owner": {"condition": "service_completed_successfully"}
        }
        if bus is None:  # the stack's bus and config volume, beside it
            volumes = ["config:/config:ro", f"hf-cache:{HF_CACHE}"]
            depends = {"nats": {"condition": "service_healthy"}, **depends}
        else:  # the role's login (and the bus's CA) from this host's disk
            volumes = [f"{bus.login_file}:/config/roles/worker.json:ro", f"hf-cache:{HF_CACHE}"]
            if bus.ca:
                volumes.insert(1, f"{bus.ca}:/config/tls/ca.pem:ro")
            else:
                del env["TOKENBUS_NATS_TLS_CA"]
        # Named after the model: files generated for two models do not collide.
        out[f"vllm-{slug(served)}-{i}"] = {
            "build": {"context": "..", "dockerfile": "Dockerfile.vllm"},
            "image": "tokenbus-vllm:latest",
            "command": cmd,
            # On the locked bus, as the worker role (its own uid and login).
            "user": str(ROLE_UID["worker"]),
            "environment": env,
            "volumes": volumes,
            "ipc": "host",  # NCCL between the GPUs of one worker
            "restart": "unless-stopped",
            "stop_grace_period": "130s",
            "depends_on": depends,
            "healthcheck": {
                "test": ["CMD", "tokenbus", "health", "--file", HEALTH_FILE],
                "interval": "15s",
                "timeout": "5s",
                "retries": 3,
                # Loading (or downloading) the weights comes first.
                "start_period": "30m",
            },
            "deploy": {
                "resources": {
                    "reservations": {
                        "devices": [
                            {"driver": "nvidia", "device_ids": ids, "capabilities": ["gpu"]}
                        ]
                    }
                }
            },
        }
    # The cache volume belongs to the worker uid (a new volume is root's).
    out["hf-cache-owner"] = {
        "image": "tokenbus-vllm:latest" if bus else "tokenbus:latest",
        "user": "0",
        "entrypoint": ["chown", "-R", f"{ROLE_UID['worker']}:{ROLE_UID['worker']}", HF_CACHE],
        "volumes": [f"hf-cache:{HF_CACHE}"],
        "restart": "no",
    }
    return {"services": out, "volumes": {"hf-cache": {}}}


def site_bridge(bus: Bus, login_file: str, site: str) -> dict[str, Any]:
    """A bridge at ``site`` (``--bridge-login``): on the site's node with the site bridge's
    login, the stages and the router in-process, preferring the site's replicas; limits
    taken from half of each while the link to the hub is cut (ratelimit.cut_off_share)."""
    env = {
        "TOKENBUS_NATS_URL": bus.url,
        "TOKENBUS_NATS_TLS_CA": "/config/tls/ca.pem",
        "TOKENBUS_NATS_LOGIN_FILE": "/config/roles/bridge.json",
        "TOKENBUS_SITE": site,
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
        "TOKENBUS_RATELIMIT__CUT_OFF_SHARE": "0.5",
        "TOKENBUS_BRIDGE__UNREADY_S": "5",
        "TOKENBUS_DRAIN_TIMEOUT_S": "605",
        # Usage records kept on the host's disk until the hub's stream takes them, and what
        # was admitted while cut off until the hub's store has it (a restarted bridge's).
        "TOKENBUS_TELEMETRY__SPOOL_DIR": "/spool",
        "TOKENBUS_RATELIMIT__CUT_OFF_DIR": "/spool/cut-off",
    }
    volumes = [f"{login_file}:/config/roles/bridge.json:ro", "bridge-spool:/spool"]
    if bus.ca:
        volumes.insert(1, f"{bus.ca}:/config/tls/ca.pem:ro")
    else:
        del env["TOKENBUS_NATS_TLS_CA"]
    return {
        "build": {"context": "..", "dockerfile": "Dockerfile"},
        "image": "tokenbus:latest",
        "command": ["serve", "bridge", "--host", "0.0.0.0", "--port", "8000"],
        "user": str(ROLE_UID["bridge"]),
        "environment": env,
        "volumes": volumes,
        "ports": ["8000:8000"],
        "restart": "unless-stopped",
        "stop_grace_period": "620s",
        "depends_on": {"bridge-spool-owner": {"condition": "service_completed_successfully"}},
        "healthcheck": {
            "test": ["CMD", "tokenbus", "health", "--url", "http://127.0.0.1:8000/ready"],
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            "start_period": "30s",
        },
    }


def to_yaml(doc: Any, indent: int = 0) -> str:
    """Block YAML for nested dicts and lists; every scalar written as JSON (valid YAML)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}{k}:")
                lines.append(to_yaml(v, indent + 1))
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")
    else:
        for item in doc:
            if isinstance(item, dict) and item:
                body = to_yaml(item, indent + 1).lstrip()
                lines.append(f"{pad}- {body}")
            else:
                lines.append(f"{pad}- {json.dumps(item)}")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    try:
        groups = plan_models(a.gpus, a.model, a.tp, a.devices, a.pool)
        bus = None
        if a.bus:
            if not a.login_file:
                raise ValueError("--bus needs --login-file: the worker role's login on this host")
            if a.bus.startswith("tls://") and not a.ca:
                raise ValueError("a tls:// --bus needs --ca: the bus's CA certificate")
            bus = Bus(a.bus, a.login_file, a.ca)
        elif a.login_file or a.ca or a.site:
            raise ValueError("--login-file, --ca and --site go with --bus (a GPU host on its own)")
        if a.site:
            from services.natsconf import site_user

            site_user(a.site)  # a valid name
        if a.bridge_login and not a.site:
            raise ValueError("--bridge-login goes with --site (a bridge at a site)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layout = " + ".join(
        f"{slug(g.model)} TP{g.tp}[{','.join(map(str, g.gpus))}]:{g.pool}" for g in groups
    )
    run = (
        "# On this host alone: docker compose -f <this> up -d\n"
        if bus
        else "# Run beside the stack: docker compose -f compose/docker-compose.yml -f <this> up\n"
    )
    doc = services(groups, host=a.host, bus=bus, site=a.site or "")
    if bus is not None and a.bridge_login:
        doc["services"]["bridge"] = site_bridge(bus, a.bridge_login, a.site)
        # The spool volume belongs to the bridge's uid (a new volume is root's).
        uid = ROLE_UID["bridge"]
        doc["services"]["bridge-spool-owner"] = {
            "image": "tokenbus:latest",
            "user": "0",
            "entrypoint": ["chown", "-R", f"{uid}:{uid}", "/spool"],
            "volumes": ["bridge-spool:/spool"],
            "restart": "no",
        }
        doc["volumes"]["bridge-spool"] = {}
    ids = [
        svc["command"][svc["command"].index("--replica") + 1]
        for svc in doc["services"].values()
        if "--replica" in svc.get("command", [])
    ]
    # A login of this host's own, which may serve only these ids (docs/deploy.md).
    login = f"--worker-host {slug(a.host) if a.host else 'host'}={','.join(ids)}"
    whose, then = "This host's own login", "bus/roles/worker-<host>.json"
    if a.site:  # the site's login instead: it serves the ids of every host at the site
        whose = "The site's login (with its other hosts' ids too)"
        login, then = f"--site {a.site}={','.join(ids)}", f"bus/sites/{a.site}/roles/worker.json"
        if a.bridge_login:  # and the site's bridge's
            login += f" --site-bridge {a.site}"
            then += f", --bridge-login bus/sites/{a.site}/roles/bridge.json"
    text = (
        f"# tokenbus compose generate: {', '.join(a.model)} on {a.host}'s {a.gpus} GPUs as "
        f"{layout}\n" + run + f"# {whose}: tokenbus deploy init ... {login}\n"
        f"# (then --login-file {then})\n" + to_yaml(doc) + "\n"
    )
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
        print(f"wrote {a.out}: {layout}")
    else:
        sys.stdout.write(text)
    return 0
