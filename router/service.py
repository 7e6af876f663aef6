"""The router stage: picks a replica for each request and hands it over.

The dispatch is a NATS request to the replica's subject; the replica acknowledges at once
and then streams straight to the caller's inbox (``Tb-Reply-To``). "No responders" or a
refusal (draining) moves the request to another replica; the caller never notices.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from router.policies import POLICIES
from router.registry import Registry
from services.runtime import Service, reply_subject


# Refusals that say "this replica, not the request": another replica may take it.
_TRY_ELSEWHERE = frozenset({E.ReplicaDraining.code, E.ReplicaLost.code, E.EngineError.code})


class Router(Service):
    """Routes requests to replicas by policy, with failover before the first token."""

    name = "router"

    async def setup(self) -> None:
        cfg = self.settings.router
        self.registry = Registry(cfg.missed_heartbeats)
        self.policy = POLICIES[cfg.policy]
        self._hb_sub = await self.nc.subscribe(subjects.heartbeat_wildcard(), cb=self._on_heartbeat)
        self._pruner = asyncio.get_running_loop().create_task(self._prune_loop())
        await self.add_endpoint(
            "route", subjects.stage(subjects.STAGE_ROUTE), self.handle, queue=subjects.STAGE_ROUTE
        )

    async def on_stop(self) -> None:
        self._pruner.cancel()
        with contextlib.suppress(Exception):
            await self._hb_sub.unsubscribe()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.registry.update(codec.decode_map(msg.data))
        except E.TokenbusError:
            self.log.warning("bad_heartbeat", subject=msg.subject)

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.registry.prune()

    async def handle(self, msg: Msg) -> None:
        reply = reply_subject(msg)
        if not reply:
            return
        hdrs = dict(msg.headers or {})
        model = hdrs.get(H.MODEL)
        if not model:
            model = str(codec.decode_map(msg.data).get("model", ""))
        marks.append(hdrs, "route")
        hdrs[H.REPLY_TO] = reply
        hdrs.pop(H.ROUTE, None)
        cfg = self.settings.router
        tried: set[str] = set()
        last_err: E.TokenbusError | None = None
        for attempt in range(cfg.max_attempts):
            candidates = [r for r in self.registry.live(model) if r.replica not in tried]
            if not candidates:
                break
            r = self.policy(candidates)
            tried.add(r.replica)
            hdrs[H.ATTEMPT] = str(attempt)
            r.unacked += 1
            try:
                ack_msg = await self.nc.request(
                    r.subject, msg.data, timeout=cfg.dispatch_timeout_s, headers=hdrs
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
                    codec.encode({"type": "cancel", "request_id": hdrs.get(H.REQUEST_ID, "")}),
                )
                last_err = E.Timeout(f"replica {r.replica} did not acknowledge in time")
                continue
            finally:
                r.unacked = max(0, r.unacked - 1)
            ack = codec.decode_map(ack_msg.data)
            if ack.get("ok"):
                r.reported_in_flight = int(ack.get("in_flight", r.reported_in_flight))
                return
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
