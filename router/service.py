"""The router stage: picks a replica for each request and hands it over (see dispatch.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import check_envelope
from router.adapters import watch_adapters
from router.dispatch import Dispatcher
from router.kv_follow import KVFollower
from router.registry import Registry
from router.routing import RoutingTable
from services.aliases import watch_aliases
from services.config import RouterSettings
from services.runtime import Service, reply_subject


class Router(Service):
    """Routes requests to replicas by policy, with failover before the first token."""

    name = "router"

    async def setup(self) -> None:
        self.registry = Registry(self.settings.router.missed_heartbeats)
        self.registry.bus = self.nc
        self.kv = KVFollower.of(self.registry, self.log, self.settings)
        self.routing = await watch_routing(self.nc, self.settings.router, self.log, self.kv)
        self.aliases = await watch_aliases(self.nc, self.settings.router.aliases, self.log)
        self.adapters = await watch_adapters(self.nc, self.log)
        self.dispatcher = Dispatcher(
            self.nc,
            self.registry,
            self.settings.router,
            self.routing,
            self.aliases,
            self.adapters,
            site=self.settings.site,
        )
        self._tracker = HeartbeatTracker(self.registry, self.log)
        await self._tracker.start(self.nc)
        await self.stage_endpoints(subjects.STAGE_ROUTE).add("route", self.handle)

    async def on_stop(self) -> None:
        await self.kv.stop()
        await self._tracker.stop()
        await self.routing.close()
        await self.aliases.close()
        await self.adapters.close()

    async def handle(self, msg: Msg) -> None:
        reply = reply_subject(msg, service="router", log=self.log)
        if not reply:
            self.log.warning("request_without_reply_subject", subject=msg.subject)
            return
        hdrs = dict(msg.headers or {})
        model = hdrs.get(H.MODEL)
        if not model:
            env = codec.decode_map(msg.data)
            check_envelope(env)
            model = env["model"]
        await self.dispatcher.dispatch(model, msg.data, hdrs, reply)


async def watch_routing(
    nc: NATS, cfg: RouterSettings, log: Any, kv: KVFollower | None = None
) -> RoutingTable:
    """A routing table following the run-time overrides in KV; configuration only (and a
    warning) when the bus has no JetStream. With ``kv``, a model routed ``kv_aware`` starts
    it following the replicas' KV events (now, when the configuration names one)."""
    table = RoutingTable(cfg, log, kv.index if kv is not None else None)
    if kv is not None:

        def follow() -> None:
            if not kv.started:
                asyncio.get_running_loop().create_task(kv.start(nc))

        table.on_kv_aware = follow
        follows = {"kv_aware", "predicted_latency"}
        if follows & {cfg.policy, *(m.policy for m in cfg.models.values())}:
            await kv.start(nc)
    try:
        await table.watch(nc)
    except Exception as exc:
        log.warning("routing_overrides_unavailable", error=str(exc))
    return table


# Forgetting replicas whose heartbeats stopped only frees memory: routing and every listing
# check a replica's last beat themselves, so this need not be prompt (an idle stack wakes less).
PRUNE_EVERY_S = 5.0


class HeartbeatTracker:
    """Feeds a :class:`Registry` from heartbeats and prunes replicas that stopped beating."""

    def __init__(self, registry: Registry, log: object) -> None:
        self.registry = registry
        self.log = log
        self._sub: object = None
        self._pruner: asyncio.Task[None] | None = None

    async def start(self, nc: object) -> None:
        self._sub = await nc.subscribe(subjects.heartbeat_wildcard(), cb=self._on_heartbeat)  # type: ignore[attr-defined]
        self._pruner = asyncio.get_running_loop().create_task(self._prune_loop())

    async def stop(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()  # type: ignore[attr-defined]

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.registry.update(codec.decode_map(msg.data))
        except E.TokenbusError:
            self.log.warning("bad_heartbeat", subject=msg.subject)  # type: ignore[attr-defined]

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_EVERY_S)
            self.registry.prune()


async def heard(nc: Any, wait_s: float, missed_heartbeats: int = 3) -> Registry:
    """The replicas heard beating within ``wait_s`` seconds, for a process that keeps no
    registry running (``tokenbus adapters``, the adapters bench)."""
    registry = Registry(missed_heartbeats)
    tracker = HeartbeatTracker(registry, structlog.get_logger("tokenbus.heartbeats"))
    await tracker.start(nc)
    try:
        await asyncio.sleep(max(0.0, wait_s))  # heartbeats arrive meanwhile
    finally:
        await tracker.stop()
    return registry
