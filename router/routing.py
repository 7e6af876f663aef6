"""Per-model routing: the configuration, changed at run time through a watched KV bucket.

Every router (and every bridge that routes in-process) builds a :class:`ModelRoute` per model
from ``[router]`` / ``[router.models.<model>]`` and from the model's entry in the JetStream KV
bucket ``tokenbus_routing`` (set by ``tokenbus router set`` or ``PUT /v1/admin/routing/<model>``).
All instances watch the bucket, so a change reaches every one of them within milliseconds and
survives restarts; deleting the entry goes back to the configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from router.policies import (
    ConcurrencyTiered,
    LoadPolicy,
    RouteRequest,
    make_load_policy,
    prefer_site,
)
from router.registry import Replica
from services import audit, buckets, kvmap
from services.config import ModelRouting, RouterSettings

BUCKET = "tokenbus_routing"


kv_key = kvmap.kv_key
model_of = kvmap.name_of


class ExpertSelector:
    """Sends each prompt to the pool or model its Expert Router cluster maps to."""

    def __init__(self, model_dir: str, targets: dict[str, str]) -> None:
        from router.expert import ExpertModel  # numpy: only where the expert policy runs

        self.model = ExpertModel.load(model_dir)
        labels = self.model.labels()
        self.targets: dict[int, str] = {}
        for c in range(self.model.clusters):
            target = targets.get(str(c)) or targets.get(labels.get(c, ""))
            if target:
                self.targets[c] = target

    def target(self, prompt: str) -> tuple[int, str | None]:
        cluster = self.model.classify(prompt)
        return cluster, self.targets.get(cluster)


class ModelRoute:
    """One model's routing, built from its :class:`ModelRouting`."""

    def __init__(self, spec: ModelRouting, kv_index: Any = None) -> None:
        self.spec = spec
        self.policy: LoadPolicy = make_load_policy(
            spec.policy,
            bound=spec.load_bound,
            block_chars=spec.prefix_block_chars,
            kv_index=kv_index,
            kv_weights=spec.kv.model_dump(),
            latency_targets=dict(spec.latency_targets),
        )
        # kv_aware (and predicted_latency, for the cached prefix) hashes the prompt as the
        # engines render it (its fallbacks use the same).
        self.needs_rendered = spec.policy in ("kv_aware", "predicted_latency")
        self.tiered: ConcurrencyTiered | None = None
        self.expert: ExpertSelector | None = None
        if spec.pool_policy == "concurrency_tiered":
            t = spec.tiered
            self.tiered = ConcurrencyTiered(t.threshold, t.hysteresis, t.high_pool, t.wide_pool)
        elif spec.pool_policy == "expert":
            if not spec.expert.model_dir:
                raise ValueError("the expert pool policy needs expert.model_dir")
            self.expert = ExpertSelector(spec.expert.model_dir, spec.expert.targets)
        self.needs_prompt = self.expert is not None or spec.policy == "prefix_aware"

    def target(self, req: RouteRequest) -> tuple[str, str | None]:
        """(model whose replicas serve it, pool tag to prefer or None)."""
        if self.expert is None:
            return req.model, None
        _, target = self.expert.target(req.prompt)
        if target is None:
            return req.model, None
        if target.startswith("pool:"):
            return req.model, target[5:]
        return target, None

    def pick(
        self,
        candidates: list[Replica],
        live: Sequence[Replica],
        req: RouteRequest,
        pool: str | None,
        site: str = "",
    ) -> Replica:
        """The router's ``site`` first (its replicas with room, :func:`prefer_site`), a pool
        (tiered, or the expert's), then a replica by the load policy."""
        candidates = prefer_site(candidates, site)
        if self.tiered is not None:
            candidates = self.tiered.select(candidates, live, req)
        elif pool is not None:
            candidates = [r for r in candidates if r.pool == pool] or candidates
        return self.policy.choose(candidates, req)


class RoutingTable:
    """Routes per model: configuration defaults plus run-time overrides from KV."""

    def __init__(self, cfg: RouterSettings, log: Any = None, kv_index: Any = None) -> None:
        self.cfg = cfg
        self.log = log
        # The replicas' KV caches (router.kv_index), for the kv_aware policy; called when a
        # model's route is first built kv_aware.
        self.kv_index = kv_index
        self.on_kv_aware: Any = None
        self.overrides: dict[str, dict[str, Any]] = {}
        self._routes: dict[str, ModelRoute] = {}
        self._follow: buckets.Follow | None = None

    def route(self, model: str) -> ModelRoute:
        r = self._routes.get(model)
        if r is None:
            try:
                r = ModelRoute(
                    self.cfg.routing_for(model, self.overrides.get(model)), self.kv_index
                )
            except (ValueError, OSError) as exc:
                # A bad run-time override must not stop the model being served. The admin API
                # checks each one it writes: a bad one came straight to the KV bucket.
                if self.log is not None:
                    self.log.warning("routing_invalid", model=model, error=str(exc)[:300])
                r = ModelRoute(self.cfg.routing_for(model), self.kv_index)
            self._routes[model] = r
            if r.needs_rendered and self.on_kv_aware is not None:
                self.on_kv_aware()  # start following the replicas' KV events
        return r

    async def watch(self, nc: NATS) -> None:
        """Follow the routing bucket (created if missing)."""
        self._follow = await buckets.Follow(await open_bucket(nc), self._apply).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._follow.synced.wait(), 10)

    def _apply(self, entry: Any) -> None:
        # Anyone with the JetStream API may write here: what is not a change this module
        # wrote is skipped (an exception would end the watch for good).
        try:
            model = model_of(entry.key)
        except ValueError:
            self._skip("routing_key_invalid", entry.key)
            return
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.overrides.pop(model, None)
        else:
            override = _override(entry.value)
            if override is None:
                self._skip("routing_change_invalid", entry.key)
                return
            self.overrides[model] = override
        self._routes.pop(model, None)
        if self.log is not None:
            self.log.info("routing_changed", model=model, routing=self.overrides.get(model))

    def _skip(self, event: str, key: str) -> None:
        if self.log is not None:
            self.log.warning(event, bucket=BUCKET, key=key[:200])

    async def close(self) -> None:
        if self._follow is not None:
            await self._follow.close()


async def open_bucket(nc: NATS) -> KeyValue:
    return await kvmap.open_bucket(nc, BUCKET)


def validate_override(cfg: RouterSettings, model: str, override: dict[str, Any]) -> ModelRouting:
    """The routing ``override`` would give ``model``, or ValueError with the reason."""
    try:
        spec = cfg.routing_for(model, override)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"{loc}: {first.get('msg')}") from None
    ModelRoute(spec)  # builds the policies: a missing expert model fails here
    return spec


async def set_override(
    nc: NATS,
    model: str,
    override: dict[str, Any],
    *,
    actor: str | None = None,
    request_id: str | None = None,
) -> None:
    """Change ``model``'s routing on every router; with an ``actor``, audited
    (``routing.changed``, refused when the audit trail cannot be written)."""
    async with audit.change(
        nc, audit.ROUTING_CHANGED, model, actor, request_id=request_id
    ) as change:
        kv = await open_bucket(nc)
        previous = await kvmap.current(kv, model, _override)
        data = json.dumps(override).encode()
        # Through a stalled stream leader too (a put is safe to repeat).
        await buckets.through_stall(lambda: kv.put(kv_key(model), data), what="routing change")
        change.details = {"override": override, "previous": previous}


async def clear_override(
    nc: NATS, model: str, *, actor: str | None = None, request_id: str | None = None
) -> None:
    """Back to the configured routing for ``model``; audited like :func:`set_override`."""
    async with audit.change(
        nc, audit.ROUTING_CHANGED, model, actor, request_id=request_id
    ) as change:
        kv = await open_bucket(nc)
        previous = await kvmap.current(kv, model, _override)
        with contextlib.suppress(KeyNotFoundError):
            await kv.delete(kv_key(model))
        change.details = {"override": None, "reset": True, "previous": previous}


async def list_overrides(nc: NATS) -> dict[str, dict[str, Any]]:
    return await kvmap.entries(await open_bucket(nc), _override)


def _override(value: bytes) -> dict[str, Any] | None:
    """A routing change as stored (a JSON object); None when ``value`` is not one."""
    obj = kvmap.json_value(value)
    return obj if isinstance(obj, dict) else None
