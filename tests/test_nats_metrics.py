"""The NATS servers' own state beside tokenbus' metrics (telemetry/natsmon.py): the telemetry
service reads each server's monitoring endpoint and exports it; a server that stops
answering counts 0 at once. A real nats-server with JetStream and its monitoring port."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.service import Telemetry
from tests.support.inprocess import settings
from tests.support.natsserver import spawn_nats
from tests.support.ports import free_port
from tests.support.waits import wait_for

pytestmark = pytest.mark.fault


def up(tel: Telemetry, url: str) -> float | None:
    return samples(tel).get(("tokenbus_nats_server_up", (("url", url),)))


def samples(tel: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(tel.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def test_the_nats_servers_state_is_exported_and_a_silent_one_counts_down(
    tmp_path: Path,
) -> None:
    port, mport = free_port(), free_port()
    server = spawn_nats(
        port, "-a", "127.0.0.1", "-p", str(port), "-m", str(mport), "-js",
        "-sd", str(tmp_path / "js"), "-n", "node-a",
    )  # fmt: skip
    good, dead = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{free_port()}"
    cfg = {
        "db_path": str(tmp_path / "t.db"),
        "metrics_port": 0,
        "probe_interval_s": 0.2,
        "nats_monitor_urls": [good, dead],
    }
    try:
        tel = Telemetry(settings(f"nats://127.0.0.1:{port}", telemetry=cfg))
        async with tel:
            await wait_for(
                lambda: up(tel, good) == 1.0,
                timeout=20,
                what="the server's state exported",
            )
            got = samples(tel)
            node = (("server", "node-a"),)
            assert got[("tokenbus_nats_server_up", (("url", dead),))] == 0.0
            assert got[("tokenbus_nats_server_connections", node)] >= 1  # telemetry's own
            assert got[("tokenbus_nats_server_routes", node)] == 0
            assert got[("tokenbus_nats_server_memory_bytes", node)] > 0
            assert got[("tokenbus_nats_server_slow_consumers_total", node)] == 0
            assert got[("tokenbus_jetstream_max_storage_bytes", node)] > 0
            assert ("tokenbus_jetstream_storage_bytes", node) in got
            assert got[("tokenbus_jetstream_api_errors_total", node)] >= 0
            assert got[("tokenbus_jetstream_meta_leader", node)] == 1.0
            # Paused with its sockets open: it answers nothing, and counts down at once;
            # its figures are left out rather than kept stale.
            server.send_signal(signal.SIGSTOP)
            try:
                await wait_for(
                    lambda: up(tel, good) == 0.0,
                    timeout=20,
                    what="the paused server counted down",
                )
                assert ("tokenbus_nats_server_connections", node) not in samples(tel)
            finally:
                server.send_signal(signal.SIGCONT)
    finally:
        server.terminate()
        server.wait(10)
