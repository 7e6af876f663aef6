"""The CLI as a user runs it: ``tokenbus serve`` and ``tokenbus up``'s options and refusals
(the whole ``tokenbus up`` with its crashes: tests/test_cli_up.py; ``tokenbus bench``:
tests/test_cli_bench.py)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.cli import cli_env, wait_line
from tests.support.pids import children_of, stop_process
from tests.support.ports import free_port, taken_port
from tests.support.repo import ROOT, run_cli


@pytest.mark.unit
def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """A port the kernel picks is one any outgoing connection may take before the server
    meant for it binds it (a cluster node that never started, in CI): the ports servers get
    here are below the ephemeral range, distinct, and free."""
    from tokenbus.launcher import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < low for p in ports), [p for p in ports if p >= low]
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing holds it


@pytest.mark.stack
def test_up_refuses_a_taken_nats_port(tmp_path: Path) -> None:
    with taken_port() as taken:
        r = run_cli(
            "up",
            "--nats-port",
            str(taken),
            "--data-dir",
            str(tmp_path),
            env=cli_env(),
            timeout=60,
        )
    assert r.returncode == 2
    assert f"port {taken} is taken" in r.stderr


@pytest.mark.unit
def test_config_file_and_env_vars(tmp_path: Path) -> None:
    from services import config

    f = tmp_path / "tb.toml"
    f.write_text('log_level = "debug"\n[bridge]\nport = 9100\n[worker.sim]\ndecode_ms = 3.5\n')
    env = os.environ.copy()
    try:
        os.environ["TOKENBUS_BRIDGE__PORT"] = "9200"
        s = config.load(str(f))
        assert (s.log_level, s.bridge.port, s.worker.sim.decode_ms) == ("debug", 9200, 3.5)
        s = config.load(str(f), bridge={"port": 9300})
        assert s.bridge.port == 9300
        with pytest.raises(FileNotFoundError):
            config.load(str(tmp_path / "missing.toml"))
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.stack
@pytest.mark.parametrize("processes", ["1", "3"])
def test_serve_bridge_on_a_taken_port_is_a_usage_error(tmp_path: Path, processes: str) -> None:
    with taken_port() as taken:
        r = run_cli(
            *("serve", "bridge", "--port", str(taken), "--processes", processes),
            env=cli_env(TOKENBUS_UP__DATA_DIR=str(tmp_path)),
            timeout=60,
        )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{taken}: Address already in use" in r.stderr
    assert "--port" in r.stderr


@pytest.mark.stack
def test_up_refuses_a_taken_bridge_port(tmp_path: Path) -> None:
    with taken_port() as taken:
        r = run_cli(
            *("up", "--port", str(taken), "--nats-port", str(free_port())),
            *("--data-dir", str(tmp_path)),
            env=cli_env(),
            timeout=60,
        )
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{taken}" in r.stderr
    assert not (tmp_path / "nats").exists()  # refused before anything started


@pytest.mark.stack
async def test_a_child_exiting_with_a_fatal_code_stops_its_supervisor(tmp_path: Path) -> None:
    from services.supervisor import Child, Supervisor
    from tokenbus.launcher import supervise_until_signalled

    sup = Supervisor(tmp_path, backoff_s=0.1, echo=False, fatal_codes={2})
    refuse = "import sys; print('error: port taken', file=sys.stderr); sys.exit(2)"
    await sup.add(Child("bridge-1-0", [sys.executable, "-c", refuse]))
    await sup.add(Child("bridge-1-1", [sys.executable, "-c", "import time; time.sleep(60)"]))
    assert await supervise_until_signalled(sup, 5) == 2
    assert sup.failed is not None and sup.failed[0].name == "bridge-1-0"
    assert sup.last_error(sup.failed[0]) == "port taken"
    assert all(c.restarts == 0 for c in sup.children)  # not restarted, and the other stopped
    assert all(c.proc is not None and c.proc.returncode is not None for c in sup.children)


def _up_with(
    tmp_path: Path, *args: str, lines: list[str] | None = None
) -> tuple[subprocess.Popen[str], int, dict[str, str]]:
    """`tokenbus up` on free ports with ``args``, once its banner is out: the process, the
    bridge's port and the environment for CLI commands beside it (``lines``: what it printed
    up to there)."""
    port, nats_port = free_port(), free_port()
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "tokenbus.cli", "up", "--port", str(port)),
            *("--nats-port", str(nats_port), "--data-dir", str(data), *args),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=cli_env(),
    )
    try:
        wait_line(proc, "Ctrl-C stops everything", [] if lines is None else lines, timeout=60)
    except BaseException:
        stop_process(proc, 60)
        raise
    env = cli_env(
        TOKENBUS_NATS_URL=f"nats://127.0.0.1:{nats_port}", TOKENBUS_UP__DATA_DIR=str(data)
    )
    return proc, port, env


@pytest.mark.stack
def test_up_options_reach_the_sim_workers_and_the_bridges(tmp_path: Path) -> None:
    from services import tlsfiles

    tls = tlsfiles.generate(tmp_path / "tls", [])
    proc, port, env = _up_with(
        tmp_path,
        *("--workers", "1", "--model", "my-model", "--max-concurrency", "7", "--tp", "2"),
        *("--pool", "high_tp", "--sim-prefill-ms", "1", "--sim-decode-ms", "300"),
        *("--bridge-processes", "2", "--tls-cert", tls.server_cert, "--tls-key", tls.server_key),
    )
    try:
        st = run_cli("status", "--json", env=env, timeout=60)
        (replica,) = json.loads(st.stdout)["replicas"]
        assert replica["model"] == "my-model"
        assert (replica["max_concurrency"], replica["tp"], replica["pool"]) == (7, 2, "high_tp")
        assert sum("serve bridge" in cmd for cmd in children_of(proc.pid).values()) == 2
        key = (tmp_path / "data" / "dev-key").read_text().strip()
        # Closed before `up` is stopped: a TLS connection left open idle holds the bridge's
        # shutdown for asyncio's 30 s SSL shutdown timeout (the client never answers the
        # server's close_notify), which this test is not about.
        with openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key=key,
            max_retries=0,
            http_client=httpx.Client(verify=ssl.create_default_context(cafile=tls.ca)),
        ) as client:
            t0 = time.monotonic()
            out = client.chat.completions.create(
                model="my-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            took = time.monotonic() - t0
        # Five tokens at 300 ms a step, on TP 2 (the sim's speed-up divides each step by at
        # most 2), cannot come in under 0.6 s: the sim runs at the speed `up` was given, not
        # its default of 10 ms a step (50 ms for the whole answer).
        assert took >= 0.5
        assert out.model == "my-model" and out.usage is not None
    finally:
        stop_process(proc, 60)


@pytest.mark.unit
def test_up_gives_its_nats_server_a_monitoring_port_and_the_services_its_url(
    tmp_path: Path,
) -> None:
    from services.config import Settings
    from tokenbus.launcher import MONITOR_URLS_ENV, _nats_server_args, monitor_env

    got = {}
    for locked in (False, True):
        s = Settings(up={"locked": locked})
        got[locked], _ = _nats_server_args(s, tmp_path / str(locked), 14222, 18222)
        assert got[locked][-2:] == ["-m", "18222"], got[locked]
        args, _ = _nats_server_args(s, tmp_path / str(locked), 14222, -1)
        assert "-m" not in args, args
    # The monitoring port binds the address the server listens on: 127.0.0.1, open (-a) or
    # locked (the generated config's listen).
    assert got[False][got[False].index("-a") + 1] == "127.0.0.1"
    conf = (tmp_path / "True" / "nats-locked" / "nats.conf").read_text()
    assert 'listen: "127.0.0.1:14222"' in conf
    url = "http://127.0.0.1:18222"
    plain = Settings(telemetry={"nats_monitor_urls": []})
    assert monitor_env(plain, {}, url) == {MONITOR_URLS_ENV: json.dumps([url])}
    assert monitor_env(plain, {}, None) == {}  # -1: no monitoring port, nothing said
    # The user's own list (config, environment, or the env given to the services) stays.
    assert monitor_env(plain, {MONITOR_URLS_ENV: '["http://elsewhere:8222"]'}, url) == {}
    mine = Settings(telemetry={"nats_monitor_urls": ["http://elsewhere:8222"]})
    assert monitor_env(mine, {}, url) == {}


@pytest.mark.stack
def test_up_serves_its_nats_servers_monitoring_to_the_consoles_bus_page(tmp_path: Path) -> None:
    lines: list[str] = []
    proc, port, _ = _up_with(tmp_path, "--workers", "1", lines=lines)
    try:
        said = next(ln for ln in lines if "nats-server monitoring:" in ln)
        monitor = said.split("monitoring:")[1].split()[0]
        assert monitor.startswith("http://127.0.0.1:"), said
        varz = httpx.get(f"{monitor}/varz", timeout=10).json()
        assert varz["jetstream"]["config"]["store_dir"].startswith(str(tmp_path / "data"))
        admin = (tmp_path / "data" / "admin-key").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as h:
            r = h.post("/console/api/session", json={"key": admin})
            assert r.status_code == 200, r.text
            bus = h.get("/console/api/bus").json()
            (server,) = bus["servers"]
            assert server["url"] == monitor and server["up"] is True, server
            assert server["connections"] >= 1 and not bus["alerts"], bus
            # And the replicas name their host (this machine: one `tokenbus up`).
            (rep,) = h.get("/console/api/replicas").json()["data"]
            assert rep["host"] == socket.gethostname(), rep
    finally:
        stop_process(proc, 60)


@pytest.mark.stack
def test_up_options_reach_an_openai_worker(tmp_path: Path) -> None:
    from tests.support.upstreams import Upstream

    upstream = Upstream(tmp_path)
    try:
        proc, port, _ = _up_with(
            tmp_path,
            *("--workers", "1", "--backend", "openai", "--model", "served-name"),
            *("--upstream-url", upstream.url, "--upstream-model", "upstream-model"),
        )
        try:
            key = (tmp_path / "data" / "dev-key").read_text().strip()
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0
            )
            out = client.chat.completions.create(
                model="served-name", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.model == "served-name"
            assert httpx.get(f"{upstream.url}/last_request").json()["model"] == "upstream-model"
        finally:
            stop_process(proc, 60)
    finally:
        upstream.stop()
