"""Handing a request to a replica: choose by policy, send, fail over before the first token.

The dispatch is a NATS request to the replica's subject; the replica acknowledges at once
and then streams straight to the caller's inbox (``Tb-Reply-To``). "No responders" or a
refusal that names the replica (draining, lost) moves the request to another replica; the
caller never notices. Used by the router service and, fused in-process, by the HTTP bridge.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from router.policies import RouteRequest, prompt_text
from router.registry import Registry
from router.routing import RoutingTable
from services.kit.config import RouterSettings

_QUEUE_POLL_S = 0.02  # how often a queued request looks for a replica with room

# Refusals that say "this replica, not the request": another replica may take it.
_TRY_ELSEWHERE = frozenset({E.ReplicaDraining.code, E.ReplicaLost.code, E.EngineError.code})


class Dispatcher:
    """Routes one request at a time over a shared :class:`Registry`."""

    def __init__(
        self,
        nc: NATS,
        registry: Registry,
        cfg: RouterSettings,
        routing: RoutingTable | None = None,
    ) -> None:
        self.nc = nc
        self.registry = registry
        self.cfg = cfg
        self.routing = routing if routing is not None else RoutingTable(cfg)
        self.started = time.monotonic()
        self.queued: dict[str, int] = {}  # model -> requests waiting for capacity

    def _overloaded(self, model: str, why: str) -> E.Overloaded:
        return E.Overloaded(
            f"every replica of model {model!r} is at capacity and {why}; retry shortly",
            headers={"Retry-After": "1"},
        )

    async def _warm_up(self, model: str) -> None:
        """Just after start the registry has not heard every replica's heartbeat yet: wait
        for a model it has never seen, for at most the warm-up, instead of calling it unknown."""
        while (  # noqa: ASYNC110 - polls the heartbeat-fed registry, only during warm-up
            not self.registry.ever_seen(model)
            and time.monotonic() - self.started < self.cfg.warmup_s
        ):
            await asyncio.sleep(0.05)

    async def dispatch(
        self,
        model: str,
        data: bytes,
        hdrs: dict[str, str],
        reply: str,
        env: dict[str, Any] | None = None,
    ) -> str:
        """Send the envelope ``data`` to a replica of ``model``; returns the replica id.

        ``hdrs`` are updated in place (route mark, reply subject, attempt). ``env`` is the
        decoded envelope when the caller has it (policies that read the prompt need it).
        """
        marks.append(hdrs, "route")
        hdrs[H.REPLY_TO] = reply
        hdrs.pop(H.ROUTE, None)
        tried: set[str] = set()
        last_err: E.TokenbusError | None = None
        route = self.routing.route(model)
        req = RouteRequest(model, hdrs.get(H.SESSION) or None)
        if route.needs_prompt:
            req.prompt = prompt_text(env if env is not None else codec.decode_map(data))
        model, pool = route.target(req)
        await self._warm_up(model)
        attempt = 0
        busy: set[str] = set()  # refused as at capacity: retried once there is room
        queued_until = 0.0
        try:
            while attempt < self.cfg.max_attempts:
                live = self.registry.live(model)
                open_ = [r for r in live if r.replica not in tried]
                candidates = [
                    r for r in open_ if r.replica not in busy and r.load < r.max_concurrency
                ]
                if not candidates:
                    if not open_:
                        break
                    # Every replica is at capacity: wait in this router's bounded queue.
                    now = time.monotonic()
                    if not queued_until:
                        if self.queued.get(model, 0) >= self.cfg.max_queued:
                            raise self._overloaded(model, "its queue is full")
                        self.queued[model] = self.queued.get(model, 0) + 1
                        queued_until = now + self.cfg.queue_timeout_s
                    if now >= queued_until or marks.expired(hdrs):
                        raise self._overloaded(model, "no replica freed up in time")
                    await asyncio.sleep(_QUEUE_POLL_S)
                    busy.clear()
                    continue
                r = route.pick(candidates, live, req, pool)
                hdrs[H.ATTEMPT] = str(attempt)
                r.unacked += 1
                try:
                    ack_msg = await self.nc.request(
                        r.subject, data, timeout=self.cfg.dispatch_timeout_s, headers=hdrs
                    )
                except NoRespondersError:
                    # The replica is gone (crashed or unsubscribed); forget it until it
                    # beats again.
                    self.registry.remove(r.replica)
                    tried.add(r.replica)
                    attempt += 1
                    last_err = E.ReplicaLost(f"replica {r.replica} did not answer")
                    continue
                except NatsTimeout:
                    # Slow or stuck: make sure it does not also generate, then try another.
                    await self.nc.publish(
                        subjects.worker_cancel(r.replica),
                        codec.encode(
                            {
                                "type": "cancel",
                                "request_id": hdrs.get(H.REQUEST_ID, ""),
                                "reply": reply,
                            }
                        ),
                    )
                    tried.add(r.replica)
                    attempt += 1
                    last_err = E.Timeout(f"replica {r.replica} did not acknowledge in time")
                    continue
                finally:
                    r.unacked = max(0, r.unacked - 1)
                ack = codec.decode_map(ack_msg.data)
                if ack.get("ok"):
                    r.reported_in_flight = int(ack.get("in_flight", r.reported_in_flight))
                    return r.replica
                err = E.TokenbusError.from_dict(ack.get("error") or {})
                if err.code == E.ReplicaBusy.code:
                    # Full until its next heartbeat says otherwise.
                    r.reported_in_flight = max(r.reported_in_flight, r.max_concurrency)
                    busy.add(r.replica)
                    continue
                if err.code == E.ReplicaDraining.code:
                    r.draining = True
                if err.code not in _TRY_ELSEWHERE:
                    raise err
                tried.add(r.replica)
                attempt += 1
                last_err = err
        finally:
            if queued_until:
                self.queued[model] -= 1
        if tried:
            raise E.NoReplica(
                f"no replica of model {model!r} could take the request"
                + (f" ({last_err.message})" if last_err else "")
                + "; retry shortly"
            )
        if self.registry.ever_seen(model):
            raise E.NoReplica(f"no live replica serves model {model!r} right now; retry shortly")
        available = ", ".join(self.registry.models()) or "none"
        raise E.ModelNotFound(
            f"the model {model!r} does not exist on this tokenbus (available: {available})",
            param="model",
        )
