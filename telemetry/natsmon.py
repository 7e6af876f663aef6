"""The NATS servers' own state, exported beside tokenbus' metrics (docs/telemetry.md).

The telemetry service reads each server's monitoring endpoint (``/varz``: connections,
routes, slow consumers, memory, CPU, and JetStream's storage, API errors and meta leader)
at each probe and exports it as ``tokenbus_nats_server_*`` and ``tokenbus_jetstream_*``,
labelled by the server's name. A server that does not answer counts 0 in
``tokenbus_nats_server_up`` (labelled by its URL), so an alert sees it; the rest of its
figures are left out rather than kept stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # imported where used: a process that reads no monitor never loads it
    import aiohttp


@dataclass(slots=True)
class ServerState:
    """One server's figures at the last probe (``varz`` None: it did not answer)."""

    url: str
    varz: dict[str, Any] | None = None


async def scrape(
    session: aiohttp.ClientSession, urls: list[str], timeout_s: float
) -> list[ServerState]:
    """Each server's ``/varz``, read at once (a server that does not answer in
    ``timeout_s`` is down for this probe)."""
    import aiohttp

    async def one(url: str) -> ServerState:
        try:
            async with asyncio.timeout(timeout_s):
                async with session.get(f"{url.rstrip('/')}/varz") as r:
                    if r.status != 200:
                        return ServerState(url)
                    data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return ServerState(url)
        return ServerState(url, data if isinstance(data, dict) else None)

    return list(await asyncio.gather(*(one(u) for u in urls)))


def _num(d: Any, *path: str) -> float | None:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return float(d) if isinstance(d, int | float) and not isinstance(d, bool) else None


def collect(states: list[ServerState]) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "tokenbus_nats_server_up",
        "1 while a NATS server's monitoring endpoint answers (telemetry.nats_monitor_urls)",
        labels=["url"],
    )
    gauges = {
        "connections": ("tokenbus_nats_server_connections", "Client connections", ("connections",)),
        "routes": ("tokenbus_nats_server_routes", "Route connections to other nodes", ("routes",)),
        "mem": ("tokenbus_nats_server_memory_bytes", "Resident memory", ("mem",)),
        "cpu": ("tokenbus_nats_server_cpu_percent", "CPU use, percent of one core", ("cpu",)),
        "js_storage": (
            "tokenbus_jetstream_storage_bytes",
            "JetStream file storage in use",
            ("jetstream", "stats", "storage"),
        ),
        "js_max_storage": (
            "tokenbus_jetstream_max_storage_bytes",
            "JetStream file storage the server may use",
            ("jetstream", "config", "max_storage"),
        ),
        "js_memory": (
            "tokenbus_jetstream_memory_bytes",
            "JetStream memory storage in use",
            ("jetstream", "stats", "memory"),
        ),
    }
    counters = {
        "slow": (
            "tokenbus_nats_server_slow_consumers",
            "Clients the server dropped or stalled for not reading fast enough",
            ("slow_consumers",),
        ),
        "api_errors": (
            "tokenbus_jetstream_api_errors",
            "JetStream API requests that failed",
            ("jetstream", "stats", "api", "errors"),
        ),
    }
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        k: GaugeMetricFamily(name, doc, labels=["server"]) for k, (name, doc, _) in gauges.items()
    }
    fams |= {
        k: CounterMetricFamily(name, doc, labels=["server"])
        for k, (name, doc, _) in counters.items()
    }
    leader = GaugeMetricFamily(
        "tokenbus_jetstream_meta_leader",
        "1 on the server that leads JetStream's meta group (0 elsewhere; none: no leader)",
        labels=["server"],
    )
    for s in states:
        up.add_metric([s.url], 0.0 if s.varz is None else 1.0)
        if s.varz is None:
            continue
        name = str(s.varz.get("server_name") or s.url)
        for k, (_, _, path) in (gauges | counters).items():
            v = _num(s.varz, *path)
            if v is not None:
                fams[k].add_metric([name], v)
        meta = (s.varz.get("jetstream") or {}).get("meta")
        if isinstance(meta, dict):
            leader.add_metric([name], 1.0 if meta.get("leader") == name else 0.0)
        elif s.varz.get("jetstream"):  # JetStream on one server: its own leader
            leader.add_metric([name], 1.0)
    yield up
    yield from fams.values()
    yield leader
