"""The bus of ``tokenbus deploy init`` with real processes: a service logs in from its role's
login file (not the environment), and ``tokenbus health`` follows the health file its runtime
writes: healthy while connected, unhealthy when the process is frozen or NATS is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.repo import run_cli

pytestmark = pytest.mark.fault


def _health(path: Path, max_age: float = 10) -> subprocess.CompletedProcess[str]:
    return run_cli("health", "--file", str(path), "--max-age", str(max_age))


def _service_env() -> dict[str, str]:
    """This environment without any NATS login of its own: the test gives the service its."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_NATS_")}


def _until(cond: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[tuple[Path, str, subprocess.Popen[bytes]]]:
    out = tmp_path / "bus"
    r = run_cli("deploy", "init", "--dir", str(out), "--no-tls")
    assert r.returncode == 0, r.stderr
    port = free_port()
    # deploy init's auth.conf under a node config for this test (its own port and store).
    conf = tmp_path / "node.conf"
    conf.write_text(
        'include "bus/auth.conf"\n'  # nats-server resolves includes beside the file
        f'listen: "127.0.0.1:{port}"\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    )
    proc = spawn_nats(port, "-c", str(conf))
    try:
        yield out, f"nats://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def test_a_service_logs_in_from_its_login_file_and_reports_its_health(
    bus: tuple[Path, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    out, url, nats_proc = bus
    health = tmp_path / "health.json"
    env = _service_env() | {
        "TOKENBUS_NATS_URL": url,
        "TOKENBUS_NATS_LOGIN_FILE": str(out / "roles" / "ingress.json"),
        "TOKENBUS_HEALTH_FILE": str(health),
    }
    svc = subprocess.Popen(
        [sys.executable, "-m", "tokenbus.cli", "serve", "ingress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _until(lambda: _health(health).returncode == 0)
        state = json.loads(health.read_text())
        assert state["service"] == "ingress" and state["connected"] is True
        # Frozen (a stuck loop looks the same): the file goes stale, the check fails.
        svc.send_signal(signal.SIGSTOP)
        _until(lambda: _health(health, max_age=3).returncode != 0)
        stale = _health(health, max_age=3)
        assert stale.returncode == 1 and "old" in stale.stderr, stale.stderr
        svc.send_signal(signal.SIGCONT)
        _until(lambda: _health(health, max_age=3).returncode == 0)
        # NATS gone: the service lives on, reconnecting, and says it is not connected.
        nats_proc.terminate()
        nats_proc.wait(10)
        _until(lambda: "not connected" in _health(health).stderr)
        assert svc.poll() is None
    finally:
        svc.send_signal(signal.SIGCONT)
        svc.terminate()
        svc.wait(30)


def test_a_wrong_login_file_is_refused_with_the_reason(
    bus: tuple[Path, str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    _, url, _ = bus
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"user": "ingress", "password": "not-it"}))
    env = _service_env() | {
        "TOKENBUS_NATS_URL": url,
        "TOKENBUS_NATS_LOGIN_FILE": str(wrong),
    }
    r = subprocess.run(
        [sys.executable, "-m", "tokenbus.cli", "serve", "ingress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "authorization" in r.stderr.lower(), r.stderr[-2000:]


def test_health_checks_fail_clearly_without_a_service(tmp_path: Path) -> None:
    r = _health(tmp_path / "absent.json")
    assert r.returncode == 1 and "no health file" in r.stderr
    r = run_cli("health", "--url", f"http://127.0.0.1:{free_port()}/ready")
    assert r.returncode == 1 and "unhealthy" in r.stderr
    r = run_cli("health")
    assert r.returncode == 2 and "--file or --url" in r.stderr
