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
from services.config import RouterSettings

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
        for attempt in range(self.cfg.max_attempts):
            live = self.registry.live(model)
            candidates = [r for r in live if r.replica not in tried]
            if not candidates:
                break
            r = route.pick(candidates, live, req, pool)
            tried.add(r.replica)
            hdrs[H.ATTEMPT] = str(attempt)
            r.unacked += 1
            try:
                ack_msg = await self.nc.request(
                    r.subject, data, timeout=self.cfg.dispatch_timeout_s, headers=hdrs
                )
            except NoRespondersError:
                # The replica is gone (crashed or unsubscribed); forget it until it beats again.
                self.registry.remove(r.replica)
                last_err = E.ReplicaLost(f"replica {r.replica} did not answer")
                continue
            except NatsTimeout:
                # Slow or stuck: make sure it does not also generate, then try another.
                await self.nc.publish(
                    subjects.worker_cancel(r.replica),
                    codec.encode(
                        {"type": "cancel", "request_id": hdrs.get(H.REQUEST_ID, ""), "reply": reply}
                    ),
                )
                last_err = E.Timeout(f"replica {r.replica} did not acknowledge in time")
                continue
            finally:
                r.unacked = max(0, r.unacked - 1)
            ack = codec.decode_map(ack_msg.data)
            if ack.get("ok"):
                r.reported_in_flight = int(ack.get("in_flight", r.reported_in_flight))
                return r.replica
            err = E.TokenbusError.from_dict(ack.get("error") or {})
            if err.code == E.ReplicaDraining.code:
                r.draining = True
            if err.code not in _TRY_ELSEWHERE:
                raise err
            last_err = err
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
