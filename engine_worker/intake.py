"""A worker's intake of dispatches: the checks that refuse a request in the router's ack
(draining, expired, full, malformed, cancelled already, an adapter unloading), the ack
itself, and the caller's cancels."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from bus_schemas import codec, frames, marks
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CLAIM, check_envelope
from engine_worker import kvloop, spans
from engine_worker.backends.base import GenerationRequest
from engine_worker.generation import Generation
from engine_worker.replica import Replica
from engine_worker.tickets import request_class
from filter.policy import FilterPolicy
from services import bodies, natsclient, tracing
from services.runtime import reply_subject

# The longest reply subject a cancel may name (an inbox is a few dozen characters).
MAX_REPLY = 1024
# How long a cancel that arrived before its request is remembered.
EARLY_CANCEL_TTL_S = 30.0


class Intake:
    """Takes one replica's dispatches in, or refuses them, and hears its callers' cancels."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker
        # Streams their callers cancelled: reply -> a copy the caller never read (it sent
        # the request elsewhere meanwhile), whose usage report leaves the spend to the copy
        # it reads.
        self.caller_cancelled: dict[str, bool] = {}
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        # Dispatches acknowledged before their claim-checked body was fetched (id of the
        # message -> the caller's reply): a later refusal goes to the caller as an error.
        self._acked_early: dict[int, str] = {}

    async def on_cancel(self, msg: Msg) -> None:
        """Cancel the stream a caller names, or refuse it when it comes after its cancel."""
        # A cancel names the stream by the caller's inbox: unique per stream and known only
        # to the caller (and the stages that carried it), unlike a request id.
        try:
            body = codec.decode_map(msg.data)
        except E.TokenbusError:
            return
        key = body.get("reply")
        # An inbox subject, or nothing to cancel (``str()`` of a 1 000-deep list raised
        # RecursionError out of this callback).
        if not isinstance(key, str) or not key or len(key) > MAX_REPLY:
            return
        task = self.w._active.get(key)
        if task is not None and not task.done():
            self.caller_cancelled[key] = bool(body.get("dup"))
            task.cancel()
        elif task is None:
            # The generate message may still be queued behind this cancel: refuse it later.
            now = time.monotonic()
            self._early_cancels[key] = now + EARLY_CANCEL_TTL_S
            while self._early_cancels and next(iter(self._early_cancels.values())) < now:
                self._early_cancels.popitem(last=False)

    def forget(self, msg: Msg) -> None:
        """The dispatch ``msg`` was handled: its early ack, if any, is no longer pending."""
        self._acked_early.pop(id(msg), None)

    async def admit(self, msg: Msg) -> Generation | None:
        """The request to serve, or None once its refusal went back in the ack."""
        w = self.w
        # Once per message: a reply subject refused is counted and logged once.
        reply = reply_subject(msg, service="worker", log=w.log)
        if reply in w._active:
            # The same dispatch again: its ack was lost while the bus stalled, and the router
            # asked again (router/dispatch.py). It runs already: acknowledged, not run twice.
            await self.ack(msg, None)
            return None
        try:
            env = codec.decode_map(msg.data)
            if CLAIM in env and reply:
                # Its messages by claim check. The refusals that need no body go in the ack;
                # then the ack, so that the router does not wait on the fetch (one request
                # behind another's prompt on a busy worker waited seconds); a refusal after
                # it goes to the caller as an error frame (see ack).
                self._refuse_early(msg)
                check_envelope(env)
                await self.ack(msg, None)
                self._acked_early[id(msg)] = reply
                await bodies.resolve(w.nc, env, (w.replica, self._asker(reply)))
            return self._screen(msg, reply, env)
        except E.TokenbusError as err:
            await self.ack(msg, err)
            if tracing.on():
                spans.trace_refused(err)
            return None

    def _asker(self, reply: str) -> Callable[[], Awaitable[None]]:
        """How this replica asks the caller at ``reply`` for a request's body (a claim by
        pull, services/bodies.py): an empty frame naming it."""
        nc, hdrs = self.w.nc, {H.BODY_PULL: self.w.replica}

        async def ask() -> None:
            # At once, not on the flusher's next turn: the body's first chunk is on its way
            # that much sooner (services/natsclient.py).
            await natsclient.publish_at_once(nc, reply, b"", hdrs)

        return ask

    def _refuse_early(self, msg: Msg) -> None:
        """The refusals that need no envelope: draining, past its deadline, full."""
        w = self.w
        if w.draining:
            raise E.ReplicaDraining(f"replica {w.replica} is draining")
        if marks.expired(msg.headers):
            raise E.Timeout("the request's deadline passed before it was served")
        if len(w._active) >= w.cfg.max_concurrency and (
            w.flow is None or w.flow.shed_for(request_class(msg.headers)) is None
        ):
            # At capacity (its queues included) with nothing of a lower class to shed: the
            # router tries another replica or holds the request in its bounded queue.
            raise E.ReplicaBusy(f"replica {w.replica} is at its limit of requests")

    def _screen(self, msg: Msg, reply: str | None, env: dict[str, Any]) -> Generation:
        """Decode the request if this replica can take it; raise the typed refusal if not."""
        w = self.w
        self._refuse_early(msg)
        # A frame that breaks the wire contract is refused here, in the ack, not by an
        # exception in the engine or in the output filter later.
        check_envelope(env)
        policy = None
        try:
            req = GenerationRequest.from_envelope(env)
            if env.get("filter_policy") is not None:
                policy = FilterPolicy.from_dict(env["filter_policy"])
        except (KeyError, TypeError, ValueError) as exc:
            raise E.InvalidRequest(f"malformed envelope: {exc}") from exc
        task = asyncio.current_task()
        assert task is not None
        if not reply:
            raise E.InvalidRequest("the request carries no reply subject")
        if self._early_cancels.pop(reply, None) is not None:
            raise E.Cancelled("the caller cancelled this request")
        if w.adapters.refuses(req.model):
            # The router's view is older than the unload: another replica may hold it.
            raise E.ReplicaDraining(
                f"replica {w.replica} is unloading the adapter {req.model!r}", param="model"
            )
        if req.kind not in w.endpoints:
            raise E.InvalidRequest(
                f"replica {w.replica} of {w.model!r} does not serve {req.kind} "
                f"(it serves {', '.join(w.endpoints)})",
                param="model",
            )
        gen = Generation(reply, msg.headers or {}, env, req, task)
        gen.predicted = kvloop.predicted(gen.headers)
        if env.get("filter_policy"):  # an empty policy filters nothing, as none does
            gen.policy = policy
        return gen

    async def ack(self, msg: Msg, err: E.TokenbusError | None) -> None:
        """Answer the router's dispatch: taken, or refused with ``err`` (to the caller as an
        error frame when the dispatch was acknowledged already)."""
        w = self.w
        early = self._acked_early.pop(id(msg), None)
        if early is not None:  # acknowledged already (a claim-checked body's fetch)
            if err is not None:
                w.outbox.send(early, frames.error(err))
            return
        if not w.own_reply(msg):
            return
        body: dict[str, Any] = {
            "type": "ack",
            "ok": err is None,
            "replica": w.replica,
            "in_flight": len(w._active),
            "backlog": w.backlog.tokens,  # prompt tokens to compute (engine_worker/backlog.py)
        }
        if err is not None:
            body["error"] = err.to_dict()
        with contextlib.suppress(Exception):
            await w.nc.publish(msg.reply, codec.encode(body))
