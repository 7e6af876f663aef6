"""LoRA adapters loaded at run time (docs/adapters.md).

What an operator wants is kept in the JetStream KV bucket ``tokenbus_adapters``: each adapter
by name, with its base model, the path its engines read it from, and on how many replicas to
load it. Every router and bridge follows the bucket (:class:`AdapterTable`). What each
replica holds is in its heartbeats (``adapters``, and ``aliases`` while it takes requests).

* :func:`load` / :func:`unload`: the admin API's and ``tokenbus adapters``' changes: the
  wanted entry, then the command to each replica (``subjects.worker_adapters``), answered
  with what the replica holds or an error naming it.
* :class:`OnDemand`: the dispatcher's loads: a request for a wanted adapter that no live
  replica holds waits for a load on the least busy replica of its base model; one whose
  every holder is at capacity starts a load on another replica and goes on waiting for room.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas.messages import ADAPTER_NAME_MAX
from router.registry import Registry, Replica
from services import audit, buckets, kvmap

BUCKET = "tokenbus_adapters"
# How long a replica may take to load an adapter (vLLM reads its weights from disk, or
# downloads them) before the load is reported as failed on it.
LOAD_TIMEOUT_S = 60.0
# How long a replica's unload may take beyond the drain it was given.
UNLOAD_SLACK_S = 10.0


@dataclass(frozen=True, slots=True)
class Wanted:
    """An adapter an operator loaded: served as ``name``, on ``model``'s replicas, read from
    ``path``, on ``replicas`` of them (more when its requests need more)."""

    name: str
    model: str
    path: str
    replicas: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "path": self.path,
            "replicas": self.replicas,
        }


def _wanted(value: bytes) -> Wanted | None:
    obj = kvmap.json_value(value)
    if not isinstance(obj, dict):
        return None
    try:
        w = Wanted(str(obj["name"]), str(obj["model"]), str(obj["path"]), int(obj["replicas"]))
    except (KeyError, TypeError, ValueError):
        return None
    return w if w.name and w.model and w.path and w.replicas >= 1 else None


async def open_bucket(nc: NATS) -> KeyValue:
    return await kvmap.open_bucket(nc, BUCKET)


class AdapterTable:
    """The wanted adapters, following the bucket."""

    def __init__(self, log: Any = None) -> None:
        self.log = log
        self._table = kvmap.Table(BUCKET, _wanted, log, "adapter")

    @property
    def wanted(self) -> dict[str, Wanted]:
        return self._table.values

    def get(self, name: str) -> Wanted | None:
        return self.wanted.get(name)

    async def watch(self, nc: NATS) -> AdapterTable:
        """Follow the bucket (created if missing); waits for its current values."""
        await self._table.watch(nc)
        return self

    async def close(self) -> None:
        await self._table.close()


async def watch_adapters(nc: NATS, log: Any) -> AdapterTable:
    """An adapter table following the bucket; empty (and a warning) without JetStream."""
    table = AdapterTable(log)
    try:
        await table.watch(nc)
    except Exception as exc:
        log.warning("adapters_unavailable", error=str(exc))
    return table


# -- commands to replicas --------------------------------------------------------------------
async def command(
    nc: NATS, model: str, replica: str, body: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Send one adapter command to a replica; its answer when it did what was asked, else
    the typed error (naming the replica)."""
    try:
        msg = await nc.request(
            subjects.worker_adapters(model, replica), codec.encode(body), timeout=timeout
        )
    except (NatsTimeout, TimeoutError):
        raise E.EngineError(
            f"replica {replica} did not answer the adapter {body.get('op')} within {timeout:g} s"
        ) from None
    except NoRespondersError:
        raise E.ReplicaLost(f"replica {replica} is gone") from None
    reply = codec.decode_map(msg.data)
    if not reply.get("ok"):
        raise E.TokenbusError.from_dict(reply.get("error") or {"message": "refused"})
    return reply


def check_name(name: Any, param: str = "name") -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > ADAPTER_NAME_MAX:
        raise E.InvalidRequest(
            f"{param}: the adapter's name, 1 to {ADAPTER_NAME_MAX} characters", param=param
        )
    return name


def holders(registry: Registry, name: str) -> list[Replica]:
    """The live replicas that loaded ``name`` at run time (draining ones too: they still
    hold it)."""
    return [r for r in registry.all_live() if name in r.adapters]


def bases(registry: Registry, model: str) -> list[Replica]:
    """The live replicas of ``model`` itself that take work."""
    return [r for r in registry.live(model) if r.model == model]


async def load(
    nc: NATS,
    registry: Registry,
    want: Wanted,
    *,
    served: Iterable[str] = (),
    actor: str | None = None,
    request_id: str | None = None,
    timeout: float = LOAD_TIMEOUT_S,
) -> dict[str, Any]:
    """Keep ``want`` and load it on ``want.replicas`` replicas of its model (those holding it
    first, then the least busy); audited as ``adapter.loaded`` with an ``actor``. Returns
    ``{"adapter", "loaded": [{"replica", "load_ms"}], "failed": [{"replica", "error"}]}``;
    raises the first replica's error when none loaded it (the entry is not kept then)."""
    check_name(want.name)
    if want.name == want.model or (want.name in set(served) and not holders(registry, want.name)):
        raise E.InvalidRequest(
            f"name: {want.name!r} is a model the bus serves; an adapter needs a name of its own",
            param="name",
        )
    live = bases(registry, want.model)
    if not live:
        raise E.NotFound(f"no live replica serves the model {want.model!r}", param="model")
    have = {r.replica for r in holders(registry, want.name)}
    # Those holding it first; then the fewest adapters (an engine batches only max_loras
    # adapters at once: a request on another waits), the least busy.
    live.sort(
        key=lambda r: (
            r.replica not in have,
            len(r.adapters),
            r.load / r.max_concurrency,
            r.replica,
        )
    )
    targets = live[: want.replicas]
    body = {"type": "adapters", "op": "load", "name": want.name, "path": want.path}
    answers = await asyncio.gather(
        *(command(nc, r.model, r.replica, body, timeout) for r in targets),
        return_exceptions=True,
    )
    loaded: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    first: E.TokenbusError | None = None
    for r, a in zip(targets, answers, strict=True):
        if isinstance(a, BaseException):
            err = a if isinstance(a, E.TokenbusError) else E.EngineError(f"{r.replica}: {a}")
            first = first or err
            failed.append({"replica": r.replica, "error": err.to_dict()})
        else:
            registry.add_adapter(r, want.name, want.path)
            loaded.append({"replica": r.replica, "load_ms": a.get("load_ms")})
    if not loaded:
        assert first is not None
        raise first
    async with audit.change(
        nc, audit.ADAPTER_LOADED, want.name, actor, request_id=request_id
    ) as change:
        kv = await open_bucket(nc)
        data = json.dumps(want.to_dict()).encode()
        await buckets.through_stall(lambda: kv.put(kvmap.kv_key(want.name), data), what="adapter")
        change.details = {**want.to_dict(), "loaded": [x["replica"] for x in loaded]}
    return {"adapter": want.to_dict(), "loaded": loaded, "failed": failed}


async def unload(
    nc: NATS,
    registry: Registry,
    name: str,
    *,
    drain_s: float = 30.0,
    actor: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Stop wanting ``name`` (no router loads it again) and unload it from every replica
    holding it, each after the requests on it end (at most ``drain_s``); audited as
    ``adapter.unloaded``. A 404 when it is neither wanted nor held anywhere."""
    check_name(name)
    kv = await open_bucket(nc)
    previous = await kvmap.current(kv, name, _wanted)
    held = holders(registry, name)
    if previous is None and not held:
        raise E.NotFound(f"no adapter {name!r} is loaded", param="name")
    async with audit.change(
        nc, audit.ADAPTER_UNLOADED, name, actor, request_id=request_id
    ) as change:
        with contextlib.suppress(KeyNotFoundError):
            await buckets.through_stall(lambda: kv.delete(kvmap.kv_key(name)), what="adapter")
        body = {"type": "adapters", "op": "unload", "name": name, "drain_s": drain_s}
        answers = await asyncio.gather(
            *(command(nc, r.model, r.replica, body, drain_s + UNLOAD_SLACK_S) for r in held),
            return_exceptions=True,
        )
        unloaded: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for r, a in zip(held, answers, strict=True):
            if isinstance(a, BaseException):
                err = a if isinstance(a, E.TokenbusError) else E.EngineError(f"{r.replica}: {a}")
                failed.append({"replica": r.replica, "error": err.to_dict()})
            else:
                registry.set_adapters(r, {k: v for k, v in r.adapters.items() if k != name})
                unloaded.append(
                    {"replica": r.replica, "drained": a.get("drained"), "cut": a.get("cut")}
                )
        change.details = {"name": name, "unloaded": [x["replica"] for x in unloaded]}
    return {"name": name, "unloaded": unloaded, "failed": failed}


async def listing(nc: NATS, registry: Registry) -> list[dict[str, Any]]:
    """Every adapter wanted or held: its entry, and the replicas holding it now."""
    try:
        wanted = await kvmap.entries(await open_bucket(nc), _wanted)
    except Exception:
        raise E.ServiceUnavailable("the adapter store (JetStream KV) is not reachable") from None
    rows = {n: {**w.to_dict(), "wanted": True} for n, w in wanted.items()}
    for r in registry.all_live():
        for name, path in r.adapters.items():
            row = rows.setdefault(
                name, {"name": name, "model": r.model, "path": path, "wanted": False}
            )
            row.setdefault("loaded_on", []).append(r.replica)
    for row in rows.values():
        row.setdefault("loaded_on", [])
        row["loaded_on"].sort()
    return [rows[n] for n in sorted(rows)]


# -- the dispatcher's loads ------------------------------------------------------------------
class OnDemand:
    """Loads wanted adapters where the requests for them need them, one load per adapter at
    a time."""

    def __init__(self, nc: NATS, registry: Registry, table: AdapterTable) -> None:
        self.nc = nc
        self.registry = registry
        self.table = table
        self.log = table.log
        self._loading: dict[str, asyncio.Task[str | None]] = {}

    def wanted(self, model: str) -> Wanted | None:
        return self.table.get(model)

    def spare(self, want: Wanted) -> list[Replica]:
        """Replicas of the adapter's model that do not hold it and have room: those with the
        fewest adapters first (max_loras), then the least busy."""
        free = [
            r
            for r in bases(self.registry, want.model)
            if want.name not in r.adapters and r.load < r.max_concurrency
        ]
        return sorted(free, key=lambda r: (len(r.adapters), r.load / r.max_concurrency, r.replica))

    def start(self, want: Wanted) -> asyncio.Task[str | None] | None:
        """The load of ``want`` under way, or a new one on the least busy spare replica;
        None when there is none to load it on."""
        task = self._loading.get(want.name)
        if task is not None and not task.done():
            return task
        spare = self.spare(want)
        if not spare:
            return None
        task = asyncio.get_running_loop().create_task(self._load(want, spare[0]))
        self._loading[want.name] = task
        return task

    async def _load(self, want: Wanted, r: Replica) -> str | None:
        """Load on ``r``; its id once it holds the adapter (the registry knows at once), None
        when it failed (logged)."""
        body = {"type": "adapters", "op": "load", "name": want.name, "path": want.path}
        t0 = time.monotonic()
        try:
            await command(self.nc, r.model, r.replica, body, LOAD_TIMEOUT_S)
        except E.TokenbusError as exc:
            if self.log is not None:
                self.log.warning(
                    "adapter_load_failed", adapter=want.name, replica=r.replica, error=exc.message
                )
            return None
        self.registry.add_adapter(r, want.name, want.path)
        if self.log is not None:
            self.log.info(
                "adapter_loaded_on_demand",
                adapter=want.name,
                replica=r.replica,
                ms=round((time.monotonic() - t0) * 1000, 1),
            )
        return r.replica
