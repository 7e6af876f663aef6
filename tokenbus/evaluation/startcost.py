"""``tokenbus bench --start-cost``: what starting each service costs, in time and CPU.

Every service is a process: a scale-out, a restart after a crash, a rolling upgrade and
every test stack start some, and what one costs to start is paid each time. This starts
each service ``--start-trials`` times, one after the other, on a nats-server of its own
(no locked bus, no JetStream state kept between them), and reports for each the time from
its launch to its health file (connected to NATS and serving) and the CPU its process used
from launch to exit (its start, its drain, its stop; ``getrusage`` of the child). Medians
and the spread; the numbers are this machine's (docs/testing.md, "Every process's start").
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenbus.evaluation.bench_report import report_head, write_report
from tokenbus.launcher import free_port, nats_server_binary, port_open

# The services, with what each needs to start on a bare bus.
SERVICES: dict[str, tuple[str, ...]] = {
    "worker": ("--model", "tokenbus-sim", "--replica", "start-cost-0"),
    "ingress": (),
    "auth": (),
    "ratelimit": (),
    "filter": (),
    "router": (),
    "bridge": ("--port", "{port}"),
    "telemetry": (),
}
READY_TIMEOUT_S = 60.0


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_once(role: str, env: dict[str, str], health: Path) -> dict[str, float]:
    """Start ``role``, wait for its health file, stop it: its time to ready and its CPU."""
    args = [a.replace("{port}", str(free_port())) for a in SERVICES[role]]
    health.unlink(missing_ok=True)
    cpu0, t0 = _child_cpu(), time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenbus.cli", "serve", role, *args],
        env={**env, "TOKENBUS_HEALTH_FILE": str(health)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not health.exists():
            if proc.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"{role} did not start (exit status {proc.poll()})")
            time.sleep(0.005)
        ready = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    return {"ready_s": ready, "cpu_s": _child_cpu() - cpu0}


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        key: {
            "p50": round(statistics.median(r[key] for r in runs), 4),
            "min": round(min(r[key] for r in runs), 4),
            "max": round(max(r[key] for r in runs), 4),
        }
        for key in ("ready_s", "cpu_s")
    }


def measure(trials: int, roles: list[str]) -> dict[str, Any]:
    """Each of ``roles`` started ``trials`` times on a nats-server of this run's own."""
    with tempfile.TemporaryDirectory(prefix="tokenbus-start-cost-") as tmp:
        port = free_port()
        server = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not port_open("127.0.0.1", port):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the nats-server of the run did not start")
                time.sleep(0.02)
            env = {**os.environ, "TOKENBUS_NATS_URL": f"nats://127.0.0.1:{port}"}
            health = Path(tmp) / "health.json"
            runs: dict[str, list[dict[str, float]]] = {r: [] for r in roles}
            for _ in range(trials):  # each round every role once: a drifting load hits all
                for role in roles:
                    runs[role].append(start_once(role, env, health))
        finally:
            server.terminate()
            server.wait(10)
    out = {role: _summary(r) for role, r in runs.items()}
    return {
        "trials": trials,
        "services": out,
        "cpu_s_p50_sum": round(sum(v["cpu_s"]["p50"] for v in out.values()), 3),
    }


def run_start_cost(a: argparse.Namespace) -> int:
    roles = [r.strip() for r in a.start_services.split(",") if r.strip()]
    unknown = sorted(set(roles) - set(SERVICES))
    if unknown or not roles:
        print(f"--start-services: not services: {unknown or roles}", file=sys.stderr)
        return 2
    report = report_head("tokenbus bench --start-cost")
    report["start_cost"] = measure(max(1, a.start_trials), roles)
    write_report(report, a.out)
    return 0
