"""Keeps a :class:`router.kv_index.KVIndex` current from the bus: every replica's KV event
batches (``tb.v1.kv.*.*``), snapshots asked for where events were missed or none were seen
yet, and a dead replica's entries dropped with it.

Started by the router service and by a bridge that routes in-process, both only once a
model routes ``kv_aware`` (following costs a decode per event batch), and from then on for
good: an override may switch models to it at run time.

A router at a site (``TOKENBUS_SITE``) follows its own site's replicas only, one subscription
each, so no other site's KV events cross a leaf link to it: its index is the site's. It routes
to its own replicas first, and what it spills to another site is placed by load and distance,
not by cache (docs/deploy.md, "Sites").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

from nats.aio.msg import Msg

from bus_schemas import errors as E
from bus_schemas import kv_events as kv
from bus_schemas import subjects
from router.kv_check import KVCheck
from router.kv_index import KVIndex
from router.registry import Registry
from services.config import KVCheckSettings, Settings

# How often the follower looks for replicas to resynchronise or forget.
TICK_S = 0.25
# How long one snapshot may take to arrive, all its pages.
SNAPSHOT_TIMEOUT_S = 5.0
# A replica with no snapshot subject (no events: an openai backend) is asked again after this.
NO_EVENTS_RETRY_S = 30.0


class KVIndexCollector:
    """The KV indexes of this process's followers as Prometheus metrics (a router's or a
    bridge's ``/metrics``): registered once, with the first follower."""

    def __init__(self) -> None:
        self.followers: weakref.WeakSet[KVFollower] = weakref.WeakSet()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        followers = list(self.followers)
        indexes = [f.index for f in followers]
        entries = GaugeMetricFamily(
            "tokenbus_kv_index_entries",
            "Blocks the KV index holds per replica (from its KV events).",
            labels=["replica"],
        )
        lag = GaugeMetricFamily(
            "tokenbus_kv_event_lag_seconds",
            "Age of each replica's last KV event batch when it arrived.",
            labels=["replica"],
        )
        for idx in indexes:
            for name, n in idx.entries_by_replica().items():
                entries.add_metric([name], n)
            for name, s in idx.lags_s().items():
                lag.add_metric([name], s)
        yield entries
        yield lag
        yield GaugeMetricFamily(
            "tokenbus_kv_incompatible_replicas",
            "Replicas whose KV block hashes this router cannot compute (another block size or "
            "hash seed): their KV events are refused (docs/routing.md).",
            value=sum(len(f.check.incompatible) for f in followers),
        )
        yield GaugeMetricFamily(
            "tokenbus_kv_disagreeing_replicas",
            "Replicas whose engines' reported cached tokens disagree with this router's "
            "predicted ones: routed by load until they agree again (docs/routing.md).",
            value=sum(len(f.check.disagreeing) for f in followers),
        )
        yield CounterMetricFamily(
            "tokenbus_kv_refused_batches",
            "KV event batches of incompatible replicas refused.",
            value=sum(f.check.refused_batches for f in followers),
        )
        stats = [idx.stats() for idx in indexes]
        yield GaugeMetricFamily(
            "tokenbus_kv_index_bytes",
            "Memory the KV index takes (an estimate: entries x bytes per entry).",
            value=sum(s["bytes_estimate"] for s in stats),
        )
        yield GaugeMetricFamily(
            "tokenbus_kv_index_synced_replicas",
            "Replicas whose KV index entries are current (a snapshot loaded, no gap since).",
            value=sum(s["synced"] for s in stats),
        )
        for name, key, text in (
            ("tokenbus_kv_index_events", "events_applied", "KV events applied to the index."),
            ("tokenbus_kv_index_gaps", "gaps", "Gaps in replicas' KV event numbers seen."),
            ("tokenbus_kv_index_repairs", "repairs", "Snapshots loaded (warm starts, repairs)."),
            ("tokenbus_kv_route_decisions", "decisions", "kv_aware routing decisions."),
            (
                "tokenbus_kv_route_hit_decisions",
                "hit_decisions",
                "kv_aware decisions whose replica held part of the prompt in its cache.",
            ),
        ):
            yield CounterMetricFamily(name, text, value=sum(s[key] for s in stats))
        yield CounterMetricFamily(
            "tokenbus_kv_route_behind_decisions",
            "predicted_latency decisions made while every candidate replica had a prefill "
            "backlog and long steps (kv.when_behind = work): scored by the least prefill for "
            "the fleet.",
            value=sum(idx.behind_decisions for idx in indexes),
        )
        yield CounterMetricFamily(
            "tokenbus_kv_route_prompt_blocks",
            "Prompt blocks of kv_aware decisions.",
            value=sum(idx.decided_blocks for idx in indexes),
        )
        yield CounterMetricFamily(
            "tokenbus_kv_route_predicted_tokens",
            "Prompt tokens the chosen replicas should read from their caches, as this router "
            "predicted (the closed loop's router side, docs/routing.md).",
            value=sum(idx.decided_predicted_tokens for idx in indexes),
        )
        yield CounterMetricFamily(
            "tokenbus_kv_route_cached_blocks",
            "Of those, blocks the chosen replica held: cached / prompt is the hit ratio.",
            value=sum(idx.decided_hit_blocks for idx in indexes),
        )


_COLLECTOR: KVIndexCollector | None = None


def register_metrics() -> None:
    """Export the KV index metrics from this process (zero until a follower runs), so a
    dashboard's queries have series wherever a router can route."""
    _collector()


def _collector() -> KVIndexCollector:
    global _COLLECTOR
    if _COLLECTOR is None:
        from prometheus_client import REGISTRY

        _COLLECTOR = KVIndexCollector()
        REGISTRY.register(_COLLECTOR)
    return _COLLECTOR


class KVFollower:
    """Feeds ``index`` from the bus; see the module docstring."""

    def __init__(
        self,
        index: KVIndex,
        registry: Registry,
        log: Any,
        check: KVCheckSettings | None = None,
        site: str = "",
    ) -> None:
        self.index = index
        # Where this router runs: only that site's replicas are followed ("" = every one).
        self.site = site
        self._site_subs: dict[str, Any] = {}  # replica -> its events' subscription
        self.check = KVCheck(check, log)
        # The index's view of whom to trust and how to hash the sim's prompts: this
        # router's (router.kv_check).
        index.distrusted = self.check.disagreeing
        index.text_seed = self.check.cfg.hash_seed
        self.registry = registry
        self.log = log
        self.nc: Any = None
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._models: dict[str, str] = {}  # replica -> model (for its snapshot subject)
        self._no_events: dict[str, float] = {}  # replica -> when it was found to have none
        self._asking: set[str] = set()
        self.bad_batches = 0
        _collector().followers.add(self)

    @classmethod
    def of(cls, registry: Registry, log: Any, settings: Settings) -> KVFollower:
        """A router's follower as ``settings`` say: its KV check, its site."""
        return cls(KVIndex(), registry, log, settings.router.kv_check, site=settings.site)

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self, nc: Any) -> None:
        """Subscribe (idempotent); events first, then snapshots (so none falls between)."""
        if self._task is not None:
            return
        self.nc = nc
        if not self.site:
            self._sub = await nc.subscribe(subjects.kv_events_wildcard(), cb=self._on_batch)
        else:
            await self._follow_site()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for sub in [self._sub, *self._site_subs.values()]:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._site_subs.clear()

    def _mine(self, replica: Any) -> bool:
        """Whether this follower indexes ``replica``: all of them, or its own site's."""
        return not self.site or replica.site == self.site

    async def _follow_site(self) -> None:
        """A sited follower's subscriptions: one per live replica of its site, taken before
        the replica is indexed (so its snapshot comes after its events are heard), and
        dropped once the replica is gone from the registry and its entries with it."""
        live = {r.replica: r.model for r in self.registry.all_live() if self._mine(r)}
        for name, model in live.items():
            if name not in self._site_subs:
                self._site_subs[name] = await self.nc.subscribe(
                    subjects.kv_events(model, name), cb=self._on_batch
                )
        for name in [n for n in self._site_subs if n not in live]:
            if name in self.index.replicas() or name in self._asking:
                continue  # still indexed: the registry sync drops it first
            sub = self._site_subs.pop(name)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_batch(self, msg: Msg) -> None:
        try:
            batch = kv.decode_batch(msg.data)
        except E.TokenbusError:
            self.bad_batches += 1
            if self.bad_batches <= 10 or self.bad_batches % 1000 == 0:
                self.log.warning("bad_kv_events", subject=msg.subject[:200])
            return
        if msg.subject != subjects.kv_events(batch["model"], batch["replica"]):
            # A batch naming another replica (or model) than the subject it came on: the
            # bus's permissions let a host publish only its own replicas' subjects, so one
            # that names another's would poison that replica's entries.
            self.bad_batches += 1
            if self.bad_batches <= 10 or self.bad_batches % 1000 == 0:
                self.log.warning("kv_events_not_its_subject", subject=msg.subject[:200])
            return
        if self.check.refuses(batch["replica"]):
            return  # hashed otherwise than this router can: never indexed
        self._models[batch["replica"]] = batch["model"]
        self._no_events.pop(batch["replica"], None)
        if not self.index.apply(batch):
            self._ask_soon()

    def _ask_soon(self) -> None:
        for name in self.index.wants_snapshot():
            if name not in self._asking:
                self._asking.add(name)
                asyncio.get_running_loop().create_task(self._snapshot(name))

    async def _loop(self) -> None:
        while True:
            if self.site:
                await self._follow_site()
            self._sync_with_registry()
            self._ask_soon()
            await asyncio.sleep(TICK_S)

    def _sync_with_registry(self) -> None:
        """Replicas heard of are tracked (a late router starts warm: it asks each for a
        snapshot); the entries of replicas no longer live are dropped."""
        now = time.monotonic()
        replicas = [r for r in self.registry.all_live() if self._mine(r)]
        live = {r.replica: r.model for r in replicas}
        for r in replicas:
            self.check.observe(r, now)
            if not self.check.admit(r) and r.replica in self.index.replicas():
                self.index.drop(r.replica)  # what it sent before it said how it hashes
        for name, model in live.items():
            if name in self.check.incompatible or (self.site and name not in self._site_subs):
                continue
            self._models.setdefault(name, model)
            if now - self._no_events.get(name, -NO_EVENTS_RETRY_S) >= NO_EVENTS_RETRY_S:
                self.index.know(name)
        for name in self.index.replicas():
            if name not in live and name not in self._asking and not self._recent(name):
                self.index.drop(name)
                self._models.pop(name, None)
        self.check.retain(set(live))

    def _recent(self, name: str) -> bool:
        """Whether events came from ``name`` lately (a replica before its first heartbeat)."""
        seen = self.index.last_event_at(name)
        return seen is not None and time.monotonic() - seen < 3.0

    async def _snapshot(self, name: str) -> None:
        """Ask ``name`` for a snapshot and load it; a replica without a snapshot subject has
        no events and is asked again only after :data:`NO_EVENTS_RETRY_S`."""
        try:
            model = self._models.get(name)
            if model is None:
                return
            if name in self.check.incompatible:
                return
            pages = await self._pages(subjects.kv_snapshot(model, name))
            if pages is None:
                self._no_events[name] = time.monotonic()
                if not self.index.synced(name):
                    self.index.drop(name)  # nothing to follow; asked again later
                return
            seq, blocks = kv.assemble_snapshot(pages)
            if name in self.check.incompatible:
                return  # found out while the snapshot came
            first = pages[0]
            self.index.load(
                {
                    "replica": name,
                    "boot": first["boot"],
                    "block_size": first["block_size"],
                    "hashing": first.get("hashing"),
                    "seq": seq,
                    "blocks": list(blocks.items()),
                }
            )
        except E.TokenbusError as exc:
            self.log.warning("bad_kv_snapshot", replica=name, error=str(exc)[:200])
        except Exception as exc:
            self.log.warning("kv_snapshot_failed", replica=name, error=type(exc).__name__)
        finally:
            self._asking.discard(name)

    async def _pages(self, subject: str) -> list[dict[str, Any]] | None:
        """Every page of one snapshot, or None when nobody answers on ``subject``."""
        nc = self.nc
        inbox = nc.new_inbox()
        got: list[dict[str, Any]] = []
        done = asyncio.get_running_loop().create_future()

        async def on_page(msg: Msg) -> None:
            if not msg.data and (msg.headers or {}).get("Status") == "503":
                # nats-server's "no responders": the replica has no snapshot subject.
                if not done.done():
                    done.set_result(None)
                return
            try:
                page = kv.decode_snapshot(msg.data)
            except E.TokenbusError as exc:
                if not done.done():
                    done.set_exception(exc)
                return
            got.append(page)
            if len(got) >= int(page["pages"]) and not done.done():
                done.set_result(None)

        sub = await nc.subscribe(inbox, cb=on_page)
        try:
            await nc.publish(subject, b"", reply=inbox)
            try:
                await asyncio.wait_for(done, SNAPSHOT_TIMEOUT_S)
            except TimeoutError:
                return got or None
            return got or None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
