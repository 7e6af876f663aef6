"""The console's Bus page (docs/console.md): the NATS servers and JetStream streams at a glance.

The servers are the monitoring endpoints of ``telemetry.nats_monitor_urls`` (each one's
``/varz``, read as the telemetry service reads it: :mod:`telemetry.natsmon`); a server that
does not answer in time is shown down. The streams are read over the bridge's own NATS
connection (``$JS.API.STREAM.LIST``, ``$JS.API.CONSUMER.LIST.<stream>``): messages, bytes,
each consumer's pending and unacknowledged messages, and, on a cluster, the leader and how
far each replica is behind. A read is bounded: at most :data:`MAX_STREAMS` streams and one
consumer listing for each, all at once, under one deadline.

The alerts are the few conditions of deploy/prometheus/alerts.yml that what this reads can
evaluate at once (no rates, no ``for:`` durations), and one of the console's own.

The live feed's ``bus`` events (gateway/console.py) come from :class:`Latest`: one read
shared by every feed of a bridge process, begun at most once per :data:`FEED_INTERVAL_S`
and only while a feed asks, so 64 open Bus pages cost the monitoring endpoints and
``$JS.API`` what one does.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.js.api import ClusterInfo, ConsumerInfo, StreamInfo, StreamsListIterator

from services import logging as tlog
from telemetry.natsmon import ServerState, scrape

log = tlog.get("bridge")

MAX_STREAMS = 64  # streams listed per read (the first ones, by name, of one listing page)
MAX_CONSUMERS = 16  # consumers shown per stream: the most pending first
MONITOR_TIMEOUT_S = 2.0  # a server's /varz slower than this is down for this read
JS_TIMEOUT_S = 3.0  # one JetStream listing
PENDING_ALERT = 10_000  # a consumer this far behind its stream is an alert
STORAGE_ALERT = 0.8  # of a server's JetStream file storage (TokenbusJetStreamStorageFilling)
# A live read begins at most this often per bridge process. A read is one /varz per
# monitoring URL, one stream listing and one consumer listing per stream with consumers (up to
# 65 JetStream API requests), and may itself take MONITOR_TIMEOUT_S or JS_TIMEOUT_S when a
# server is down, so a shorter interval could not be kept; what the page shows are levels
# (lag, storage, servers up) that an operator reads over seconds, and a new stream or a
# backlog is on the page within one interval and a feed tick of happening.
FEED_INTERVAL_S = 5.0


def _server(s: ServerState) -> dict[str, Any]:
    if s.varz is None:
        return {"url": s.url, "up": False}
    v = s.varz
    raw = v.get("jetstream")
    js: dict[str, Any] = raw if isinstance(raw, dict) else {}
    stats, config = js.get("stats") or {}, js.get("config") or {}
    meta = js.get("meta") if isinstance(js.get("meta"), dict) else None
    return {
        "url": s.url,
        "up": True,
        "name": str(v.get("server_name") or s.url),
        "version": str(v.get("version") or ""),
        "connections": v.get("connections"),
        "routes": v.get("routes"),
        "slow_consumers": v.get("slow_consumers"),
        "mem": v.get("mem"),
        "cpu": v.get("cpu"),
        "uptime": v.get("uptime"),
        "js_storage": stats.get("storage"),
        "js_max_storage": config.get("max_storage"),
        "meta_leader": meta.get("leader") if meta else None,
    }


def _cluster(c: ClusterInfo | None) -> dict[str, Any] | None:
    if c is None or not (c.leader or c.replicas):
        return None  # a single server: no leader, no replicas
    peers = [
        {"name": p.name, "current": bool(p.current), "offline": bool(p.offline), "lag": p.lag}
        for p in c.replicas or []
    ]
    return {"name": c.name, "leader": c.leader, "replicas": peers}


def _consumer(c: ConsumerInfo) -> dict[str, Any]:
    return {
        "name": c.name,
        "durable": bool(c.config.durable_name),
        "num_pending": c.num_pending or 0,
        "num_ack_pending": c.num_ack_pending or 0,
        "num_redelivered": c.num_redelivered or 0,
        "cluster": _cluster(c.cluster),
    }


async def _stream(nc: NATS, info: StreamInfo) -> dict[str, Any]:
    name = info.config.name or ""
    out: dict[str, Any] = {
        "name": name,
        "subjects": list(info.config.subjects or [])[:8],
        "messages": info.state.messages,
        "bytes": info.state.bytes,
        "consumer_count": info.state.consumer_count,
        "replicas": info.config.num_replicas or 1,
        "cluster": _cluster(info.cluster),
        "consumers": [],
    }
    if info.state.consumer_count:
        try:
            listed = await nc.jsm(timeout=JS_TIMEOUT_S).consumers_info(name)
        except Exception as exc:  # one stream's listing failing does not hide the others
            out["consumers_error"] = f"{type(exc).__name__}: {exc}"
        else:
            listed.sort(key=lambda c: -(c.num_pending or 0))
            out["consumers"] = [_consumer(c) for c in listed[:MAX_CONSUMERS]]
    return out


async def _streams(nc: NATS) -> dict[str, Any]:
    # One listing page (the server's up to 256), its total kept: nats-py types it loosely.
    page = cast(StreamsListIterator, await nc.jsm(timeout=JS_TIMEOUT_S).streams_info_iterator())
    infos = sorted(page, key=lambda i: i.config.name or "")[:MAX_STREAMS]
    streams = await asyncio.gather(*(_stream(nc, i) for i in infos))
    return {"streams": list(streams), "streams_total": page.total}


def alerts(servers: list[dict[str, Any]], streams: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conditions the console evaluates itself from one read (docs/console.md)."""
    out: list[dict[str, str]] = []

    def fire(name: str, severity: str, summary: str) -> None:
        out.append({"alert": name, "severity": severity, "summary": summary})

    for s in servers:
        if not s["up"]:
            fire("TokenbusNATSServerDown", "critical", f"{s['url']} does not answer")
            continue
        if (s.get("slow_consumers") or 0) > 0:
            n = s["slow_consumers"]
            fire("TokenbusNATSSlowConsumers", "warning", f"{s['name']}: {n} since it started")
        used, room = s.get("js_storage") or 0, s.get("js_max_storage") or 0
        if room > 0 and used / room > STORAGE_ALERT:
            fire(
                "TokenbusJetStreamStorageFilling", "warning", f"{s['name']}: {used / room:.0%} full"
            )
    for st in streams:
        for c in st["consumers"]:
            if c["num_pending"] > PENDING_ALERT:
                summary = f"{st['name']}/{c['name']}: {c['num_pending']} messages pending"
                fire("ConsoleConsumerBacklog", "warning", summary)
        behind = [p["name"] for p in (st["cluster"] or {}).get("replicas", []) if not p["current"]]
        if behind:
            summary = f"{st['name']}: replicas {', '.join(behind)} are not current"
            fire("ConsoleStreamReplicaBehind", "warning", summary)
    return out


async def read(nc: NATS, monitor_urls: list[str]) -> dict[str, Any]:
    """The servers, the streams (or why they could not be read) and the alerts firing."""

    async def servers() -> list[ServerState]:
        if not monitor_urls:
            return []
        import aiohttp  # here, not at import: a bridge starts without it (services/lean_imports.py)

        async with aiohttp.ClientSession() as http:
            return await scrape(http, monitor_urls, MONITOR_TIMEOUT_S)

    states, listed = await asyncio.gather(servers(), _streams(nc), return_exceptions=True)
    if isinstance(states, BaseException):
        raise states
    found = [_server(s) for s in states]
    out: dict[str, Any] = {"servers": found, "streams": [], "streams_total": 0}
    if isinstance(listed, BaseException):
        out["streams_error"] = f"JetStream did not answer: {type(listed).__name__}: {listed}"
    else:
        out |= listed
    out["truncated"] = out["streams_total"] > len(out["streams"])
    out["alerts"] = alerts(found, out["streams"])
    out["monitor_urls_set"] = bool(monitor_urls)
    return out


class Latest:
    """The newest bus read as JSON, shared by every live feed of a bridge process.

    :meth:`get` answers at once with what was read last and begins a new read in the
    background when the last one began :attr:`interval_s` ago or more and none is running:
    however many feeds ask, there is at most one read in flight and one begun per interval,
    and none while no feed asks. A read that fails keeps the last one (and is logged).
    Only the last read's JSON is kept."""

    def __init__(
        self,
        read: Callable[[], Awaitable[dict[str, Any]]],
        interval_s: float = FEED_INTERVAL_S,
    ) -> None:
        self.read = read
        self.interval_s = interval_s
        self.reads = 0  # reads begun, for the tests and a curious operator
        self.json: str | None = None
        self._began = -math.inf
        self._task: asyncio.Task[None] | None = None

    def get(self) -> str | None:
        """The last read's JSON (None until the first one ends)."""
        now = time.monotonic()
        if self._task is None and now - self._began >= self.interval_s:
            self._began = now
            self.reads += 1
            self._task = asyncio.create_task(self._refresh())
        return self.json

    def put(self, snapshot: dict[str, Any]) -> None:
        """Keep ``snapshot`` as the last read (the Bus API's own, fresh, reads too)."""
        self.json = json.dumps(snapshot)

    async def _refresh(self) -> None:
        try:
            self.put(await self.read())
        except Exception as exc:  # the feeds keep the last read; the next interval tries again
            log.warning("console_bus_read_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._task = None
