"""``tokenbus compose generate``: a docker compose file of vLLM workers for a GPU topology.

One container per tensor-parallel group, pinned to its GPUs with ``device_ids``; ScaleLLM's
layouts are one command each: ``--gpus 8 --tp 8`` (one TP8 replica), ``--tp 2,2,2,2`` (four
TP2 replicas), ``--tp 4,2,2 --pool high_tp:4`` (a tiered mix, the TP4 replica in the
``high_tp`` pool, the others in ``default``). Impossible layouts are refused with the
reason: a GPU given twice or beyond the host's count, a group whose size is not its TP
degree, a TP degree that does not divide the host's GPU count.

The file holds the worker services only; run it beside the stack's compose file
(``docker compose -f compose/docker-compose.yml -f workers.yml up``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from services.deploybundle import ROLE_UID

HF_CACHE = "/hf-cache"
HEALTH_FILE = "/tmp/tokenbus-health.json"


@dataclass(frozen=True, slots=True)
class Group:
    """One vLLM worker: its GPUs and its pool."""

    gpus: tuple[int, ...]
    pool: str

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
        help="tensor-parallel degree of each worker, e.g. 2,2,4 (GPUs given in order)",
    )
    g.add_argument(
        "--devices",
        help="the GPUs of each worker instead, e.g. '0,1;2,3;4,5,6,7' (TP = group size)",
    )
    g.add_argument("--model", required=True, help="the model every worker serves")
    g.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME:TP",
        help="workers of this TP degree go to pool NAME (tiered routing); others: default",
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


def services(groups: list[Group], model: str) -> dict[str, Any]:
    """The compose document: one vLLM worker service per group, and the shared HF cache."""
    out: dict[str, Any] = {}
    for i, g in enumerate(groups):
        ids = [str(x) for x in g.gpus]
        # Inside the container its GPUs are numbered from 0: vLLM takes all it sees.
        cmd = ["serve", "worker", "--backend", "vllm", "--model", model]
        cmd += ["--replica", f"vllm-tp{g.tp}-{i}", "--tp", str(g.tp), "--pool", g.pool]
        cmd += ["--engine-arg", f"tensor_parallel_size={g.tp}"]
        out[f"vllm-{i}"] = {
            "build": {"context": "..", "dockerfile": "Dockerfile.vllm"},
            "image": "tokenbus-vllm:latest",
            "command": cmd,
            # On the stack's locked bus, as the worker role (its own uid and login).
            "user": str(ROLE_UID["worker"]),
            "environment": {
                "TOKENBUS_NATS_URL": "tls://nats:4222",
                "TOKENBUS_NATS_TLS_CA": "/config/tls/ca.pem",
                "TOKENBUS_NATS_LOGIN_FILE": "/config/roles/worker.json",
                "TOKENBUS_HEALTH_FILE": HEALTH_FILE,
                "TOKENBUS_LOOP_WATCHDOG_S": "30",
                # vLLM drains its running requests: longer than the stages' 30 s.
                "TOKENBUS_DRAIN_TIMEOUT_S": "120",
                "HF_HOME": HF_CACHE,
                "HOME": "/tmp",
            },
            "volumes": ["config:/config:ro", f"hf-cache:{HF_CACHE}"],
            "ipc": "host",  # NCCL between the GPUs of one worker
            "restart": "unless-stopped",
            "stop_grace_period": "130s",
            "depends_on": {
                "nats": {"condition": "service_healthy"},
                "hf-cache-owner": {"condition": "service_completed_successfully"},
            },
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
        "image": "tokenbus:latest",
        "user": "0",
        "entrypoint": ["chown", "-R", f"{ROLE_UID['worker']}:{ROLE_UID['worker']}", HF_CACHE],
        "volumes": [f"hf-cache:{HF_CACHE}"],
        "restart": "no",
    }
    return {"services": out, "volumes": {"hf-cache": {}}}


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
        groups = plan(a.gpus, a.tp, a.devices, a.pool)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layout = " + ".join(f"TP{g.tp}[{','.join(map(str, g.gpus))}]:{g.pool}" for g in groups)
    text = (
        f"# tokenbus compose generate: {a.model} on {a.gpus} GPUs as {layout}\n"
        "# Run beside the stack: docker compose -f compose/docker-compose.yml -f <this> up\n"
        + to_yaml(services(groups, a.model))
        + "\n"
    )
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
        print(f"wrote {a.out}: {layout}")
    else:
        sys.stdout.write(text)
    return 0
