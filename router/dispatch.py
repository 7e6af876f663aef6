"""Handing a request to a replica: choose by policy, send, fail over before the first token.

The dispatch is a NATS request to the replica's subject; the replica acknowledges at once
and then streams straight to the caller's inbox (``Tb-Reply-To``). "No responders" or a
refusal that names the replica (draining, lost) moves the request to another replica; the
caller never notices. Used by the router service and, fused in-process, by the HTTP bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter as PromCounter

from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CLAIM, check_envelope, render_prompt
from router.adapters import LOAD_TIMEOUT_S, AdapterTable, OnDemand
from router.policies import KVAware, RouteRequest, prompt_text
from router.registry import Registry, Replica
from router.routing import ModelRoute, RoutingTable
from services import bodies, natsclient, tracing
from services.aliases import AliasTable, envelope_for, retarget
from services.config import RouterSettings
from services.runtime import HOLD_NOTICE_S, HoldNotice

_QUEUE_POLL_S = 0.02  # how often a queued request looks for a replica with room
# After the bus was silent, how long "no responders" from a replica means "not subscribed
# again yet" (its connection is coming back) rather than "gone".
RESUBSCRIBE_GRACE_S = 3.0
REPORT_EVERY_S = 1.0  # how often a router holding requests says how many


def queue_report(
    instance: str, held: dict[tuple[str, str], int], interval_s: float
) -> dict[str, Any]:
    """What a router (or bridge) holds, per model and class, as it says so on the bus."""
    waiting: dict[str, dict[str, int]] = {}
    for (model, tier), n in held.items():
        waiting.setdefault(model, {})[tier] = n
    return {"type": "queue", "instance": instance, "waiting": waiting, "interval_s": interval_s}


# Headers a prefill's request goes without: nothing is reported, charged or recorded against
# the key for it (the decode replica's report and record count the prompt), and it is no
# migration of the request.
_NOT_FOR_PREFILL = frozenset(
    (H.RATELIMIT, H.SPEND, H.ADMISSION, H.MIGRATION, H.RESUME, H.REPLY_TO, H.PRINCIPAL)
)
PD_DECISIONS = PromCounter(
    "tokenbus_pd_decisions_total",
    "Prefill/decode decisions of this router: disaggregated, or aggregated (short, busy, "
    "after a failed prefill).",
    ["decision"],
)

SITE_PLACEMENTS = PromCounter(
    "tokenbus_router_site_placements_total",
    "Requests a router at a site (TOKENBUS_SITE) sent to a replica: at its own site "
    "(local), or spilled over to another site's (the site it went to).",
    ["site", "placement"],
)

# Refusals that say "this replica, not the request": another replica may take it.
_TRY_ELSEWHERE = frozenset({E.ReplicaDraining.code, E.ReplicaLost.code, E.EngineError.code})


@dataclass
class _Placement:
    """One request on its way to a replica: where it may go and how far it got."""

    route: ModelRoute
    req: RouteRequest
    model: str  # whose replicas serve it: an expert route may name another model
    pool: str | None
    data: bytes
    hdrs: dict[str, str]
    reply: str
    tried: set[str] = field(default_factory=set)
    # Refused as at capacity: retried once there is room.
    busy: set[str] = field(default_factory=set)
    attempt: int = 0
    last_err: E.TokenbusError | None = None
    queued_until: float = 0.0  # end of its wait in the queue; 0 while it has no place there
    tier: str = "default"  # its class (Tb-Priority), for the queue depth reported
    loaded: bool = False  # it waited for its adapter's load once (router.adapters)
    # Prefill/decode disaggregation: "prefill" (a prefill replica's part), "decode" (its
    # prompt's KV cache handed over), "" (whole, on any replica but a prefill-only one).
    pd: str = ""
    # The site of the prefill replica that computed its prompt (a decode part's; None: any).
    pd_site: str | None = None

    def failed(self, replica: str, err: E.TokenbusError) -> None:
        """``replica`` cannot take the request: count the attempt, try another."""
        self.tried.add(replica)
        self.attempt += 1
        self.last_err = err
        _refused_event(replica, err.code)


def _bus_quiet_since(nc: Any, t: float) -> bool:
    """Whether ``nc``'s server was silent at some time since ``t``: still down or stalled,
    or heard again after a silence since then."""
    now = time.monotonic()
    return (
        not nc.is_connected
        or (isinstance(nc, natsclient.Client) and nc.stalled())
        or natsclient.resumed_within(nc, now - t)
    )


def _refused_event(replica: str, code: str) -> None:
    """A replica refused (or failed to take) the request: an event on the routing span."""
    tracing.event(
        tracing.current(),
        tracing.REFUSED_EVENT,
        {tracing.REPLICA: replica, tracing.ERROR_TYPE: code},
    )


def _for_part(live: list[Replica], pd: str) -> list[Replica]:
    """The replicas that may take a request's part: a prefill only on prefill replicas; a
    handed-over decode, or a whole request, on the others (a model whose replicas are all
    prefill-only serves whole requests there)."""
    if pd == "prefill":
        return [r for r in live if r.pd_role == "prefill"]
    others = [r for r in live if r.pd_role != "prefill"]
    return others if others or pd == "decode" else live


class Dispatcher:
    """Routes one request at a time over a shared :class:`Registry`."""

    def __init__(
        self,
        nc: NATS,
        registry: Registry,
        cfg: RouterSettings,
        routing: RoutingTable | None = None,
        aliases: AliasTable | None = None,
        adapters: AdapterTable | None = None,
        site: str = "",
    ) -> None:
        self.nc = nc
        # The site this router runs at (Settings.site): its replicas first while they have room.
        self.site = site
        # LoRA adapters loaded at run time where their requests need them (the wanted ones:
        # ``adapters``).
        self.adapters = OnDemand(nc, registry, adapters) if adapters is not None else None
        self.registry = registry
        self.cfg = cfg
        self.routing = routing if routing is not None else RoutingTable(cfg)
        # Global model aliases, resolved here when no auth stage did (services.aliases).
        self.aliases = aliases
        self.started = time.monotonic()
        self.queued: dict[str, int] = {}  # model -> requests waiting for capacity
        # (model, class) -> requests held here (the queue and the waiting room), reported on
        # the bus for autoscalers (see QueueReport).
        self.holding: Counter[tuple[str, str]] = Counter()
        self.instance = uuid.uuid4().hex[:12]
        self._report: asyncio.Task[None] | None = None

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
        # Only this router's prediction reaches a worker, never a client's (set per attempt).
        hdrs.pop(H.KV_PREDICTED, None)
        hdrs.pop(H.PREFILL_TOKENS, None)
        if self.aliases is not None and H.MODEL_ALIAS not in hdrs:
            served = self.aliases.resolve(model)
            if retarget(hdrs, model, served):
                data = envelope_for(data, env, served)
                env = None if env is None else {**env, "model": served}
                model = served
        route = self.routing.route(model)
        if env is None and (route.needs_prompt or route.needs_rendered):
            env = await self._envelope(data)
        req = self._route_request(route, model, data, hdrs, env)
        target, pool = route.target(req)
        await self._warm_up(target)
        p = _Placement(route, req, target, pool, data, hdrs, reply)
        p.tier = hdrs.get(H.PRIORITY) or "default"
        try:
            await self._disaggregate(p, env)
            replica = await self._place(p)
        finally:
            self._leave_queue(p)
        if replica is None:
            raise self._give_up(p)
        if tracing.on():
            tracing.set_attributes(
                tracing.current(), {tracing.REPLICA: replica, tracing.ATTEMPTS: p.attempt + 1}
            )
        return replica

    # -- prefill/decode disaggregation ------------------------------------------------------
    async def _disaggregate(self, p: _Placement, env: dict[str, Any] | None) -> None:
        """Decide aggregated or disaggregated (as llm-d's decider: by the prompt's tokens the
        decode replicas do not hold cached, and whether a prefill replica has room) and, for
        the second, have a prefill replica compute the prompt first: ``p`` then carries its
        hand-over (vLLM's ``kv_transfer_params``) to a decode replica. A prefill that fails
        (its replica lost, refused, too slow) leaves the request whole, never failed."""
        if not self.registry.prefill_seen:
            return  # no disaggregated deployment (the common case): nothing to decide
        kind = p.hdrs.get(H.KIND) or None
        if kind not in (subjects.KIND_CHAT, subjects.KIND_COMPLETIONS) or p.hdrs.get(H.RESUME):
            return
        live = self.registry.live(p.model, kind)
        prefill = [r for r in live if r.pd_role == "prefill"]
        decode = [r for r in live if r.pd_role != "prefill"]
        if not prefill or not decode:
            return
        if env is None:
            env = await self._envelope(p.data)
        extra = env.get("extra") or {}
        if env.get("resume") or "kv_transfer_params" in extra:
            return  # a continuation, or a client that disaggregates itself
        uncached = self._uncached_tokens(p, env, decode)
        if uncached < self.cfg.pd_min_prompt_tokens:
            PD_DECISIONS.labels("aggregated_short").inc()
            return
        if not self.cfg.pd_cross_site:
            # The hand-over moves the prompt's KV cache from the prefill replica to the
            # decode one: never over a site's link unless told to (router.pd_cross_site).
            sites = {r.site for r in decode}
            prefill = [r for r in prefill if r.site in sites]
            if not prefill:
                PD_DECISIONS.labels("aggregated_other_site").inc()
                return
        if not any(r.load < r.max_concurrency for r in prefill):
            PD_DECISIONS.labels("aggregated_busy").inc()
            return
        kvt = await self._prefill(p, env, prefill)
        if kvt is None:
            PD_DECISIONS.labels("aggregated_after_failure").inc()
            return
        PD_DECISIONS.labels("disaggregated").inc()
        p.data = bodies.encode({**env, "extra": {**extra, "kv_transfer_params": kvt}})
        p.pd = "decode"

    def _uncached_tokens(self, p: _Placement, env: dict[str, Any], decode: list[Replica]) -> int:
        """The prompt's tokens (about four characters a token) less the longest prefix a
        decode replica holds cached, where the route follows the replicas' KV events."""
        if not p.req.rendered:
            p.req.rendered = render_prompt(env.get("messages"), env.get("prompt"))
            p.req.env = env
        tokens = (len(p.req.rendered) + 3) // 4
        policy = p.route.policy
        if isinstance(policy, KVAware):
            found = policy.depths(decode, p.req)
            if found is not None:
                depth, _ = found
                index = policy.index
                cached = max((n * index.block_size(name) for name, n in depth.items()), default=0)
                tokens -= cached
        return tokens

    async def _prefill(
        self, p: _Placement, env: dict[str, Any], prefill: list[Replica]
    ) -> dict[str, Any] | None:
        """The prompt computed on a prefill replica (one token, which is dropped): its
        hand-over, or None when no prefill replica gave one in time. The caller is told the
        request is held meanwhile (hold frames), so it does not send it again."""
        params = {**(env.get("params") or {}), "max_tokens": 1}
        extra = {
            **(env.get("extra") or {}),
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        # Its own request, under an id of its own (its telemetry record is not the answer's):
        # no usage is reported or charged for it (the decode replica's report counts the
        # prompt), and its frames come here, not to the caller.
        rid = f"{env.get('request_id') or p.hdrs.get(H.REQUEST_ID, '')}.prefill"
        data = bodies.encode({**env, "request_id": rid, "params": params, "extra": extra})
        hdrs = {k: v for k, v in p.hdrs.items() if k not in _NOT_FOR_PREFILL}
        hdrs[H.REQUEST_ID] = rid
        inbox = self.nc.new_inbox()
        hdrs[H.REPLY_TO] = inbox
        sub = await self.nc.subscribe(inbox)
        holding = HoldNotice(self.nc, p.reply)
        q = _Placement(p.route, p.req, p.model, p.pool, data, hdrs, inbox, tier=p.tier)
        q.pd = "prefill"
        # Only the prefill replicas the decision allowed (those at a site with decode ones).
        allowed = {r.replica for r in prefill}
        q.tried.update(r.replica for r in self.registry.live(p.model) if r.replica not in allowed)
        deadline = time.monotonic() + self.cfg.pd_prefill_timeout_s
        try:
            try:
                replica = await self._place(q)
            except E.TokenbusError:
                return None
            if replica is None:
                return None
            if not self.cfg.pd_cross_site and (r := self.registry.get(replica)) is not None:
                p.pd_site = r.site
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=min(left, HOLD_NOTICE_S))
                except (NatsTimeout, TimeoutError):
                    if not self.registry.alive(replica):
                        return None  # lost mid-prefill (its heartbeats stopped)
                    continue
                if msg.headers and H.BODY_PULL in msg.headers:
                    # The prefill replica asks for a body held in this process (the bridge
                    # routing in-process, services/bodies.py): the one it was sent to only.
                    await self._send_held(env, msg.headers[H.BODY_PULL], replica)
                    continue
                try:
                    frame = codec.decode_map(msg.data)
                except E.TokenbusError:
                    return None
                t = frame.get("t")
                if t == frames.FINAL:
                    kvt = frame.get("kvt")
                    return kvt if isinstance(kvt, dict) else None
                if t == frames.ERROR:
                    return None
            # Too slow (or lost with no word): it must not go on computing.
            await self._cancel_on(replica, q)
            return None
        finally:
            holding.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _send_held(self, env: dict[str, Any], asked_by: str, replica: str) -> None:
        """Send the held body ``env``'s claim names to ``replica`` when it is who asked."""
        claim = env.get(CLAIM)
        held = bodies.held(claim["id"]) if isinstance(claim, dict) and "id" in claim else None
        if held is not None and asked_by == replica:
            await held.send(self.nc, replica)  # (it does not raise: a failed send times out)

    async def _cancel_on(self, replica: str, p: _Placement) -> None:
        r = self.registry.get(replica)
        if r is not None:
            with contextlib.suppress(Exception):
                await self._cancel(r, p)

    async def _envelope(self, data: bytes) -> dict[str, Any]:
        """The envelope ``data`` decoded, its claim-checked parts fetched (services/bodies.py)."""
        env = codec.decode_map(data)
        check_envelope(env)
        return await bodies.resolve(self.nc, env)

    def _route_request(
        self,
        route: ModelRoute,
        model: str,
        data: bytes,
        hdrs: dict[str, str],
        env: dict[str, Any] | None,
    ) -> RouteRequest:
        """What the routing policy reads: model, session, and the prompt when it needs one."""
        req = RouteRequest(model, hdrs.get(H.SESSION) or None)
        req.tier = hdrs.get(H.PRIORITY) or "default"
        req.tenant = hdrs.get(H.PRINCIPAL) or ""
        if route.needs_prompt or route.needs_rendered:
            if env is None:
                env = codec.decode_map(data)
                check_envelope(env)
            if route.needs_prompt:
                req.prompt = prompt_text(env)
            if route.needs_rendered:
                req.rendered = render_prompt(env.get("messages"), env.get("prompt"))
                req.env = env
        return req

    async def _place(self, p: _Placement) -> str | None:
        """Offer the request to replicas until one takes it; None when none is left to try."""
        while p.attempt < self.cfg.max_attempts:
            kind = p.hdrs.get(H.KIND) or None
            live = _for_part(self.registry.live(p.model, kind), p.pd)
            if p.pd == "decode" and p.pd_site is not None:
                # At the prefill's site; elsewhere only when that site has none left.
                live = [r for r in live if r.site == p.pd_site] or live
            if p.hdrs.get(H.RESUME) == "1" and kind == subjects.KIND_CHAT:
                # Text already delivered: to a replica that continues it exactly, where one
                # is live (any other would end the stream with replica_lost).
                live = [r for r in live if r.continues] or live
            open_ = [r for r in live if r.replica not in p.tried]
            candidates = [
                r for r in open_ if r.replica not in p.busy and r.load < r.max_concurrency
            ]
            if not candidates and self.adapters and await self._load_adapter(p, live):
                continue
            if not candidates:
                if not live and not p.tried and self._may_hold(p.model):
                    # No replica at all: the waiting room, while one starts (scale from 0).
                    await self._wait_for_room(p, self.cfg.waiting_room_s)
                    continue
                if not open_:
                    return None
                # Every replica is at capacity: wait in this router's bounded queue.
                await self._wait_for_room(p)
                continue
            r = p.route.pick(candidates, live, p.req, p.pool, self.site)
            self._predict(p, r)
            ack = await self._send(r, p)
            if ack is None:
                continue
            if ack.get("ok"):
                if self.site:
                    where = "local" if r.site == self.site else "spilled"
                    SITE_PLACEMENTS.labels(r.site or "none", where).inc()
                r.reported_in_flight = int(ack.get("in_flight", r.reported_in_flight))
                backlog = ack.get("backlog")
                if isinstance(backlog, int):
                    r.told_backlog(backlog, time.monotonic())
                return r.replica
            self._refused(r, E.TokenbusError.from_dict(ack.get("error") or {}), p)
        return None

    def _predict(self, p: _Placement, r: Replica) -> None:
        """Carry the policy's predicted cached prompt tokens on ``r`` to its worker (the
        closed loop, router/kv_check.py), or none: always this router's, for this attempt."""
        policy = p.route.policy
        kv = policy if isinstance(policy, KVAware) else None
        predicted = kv.prediction(r.replica) if kv is not None else None
        # A disaggregated request's parts read the prompt from elsewhere (or only write it):
        # the engine's cached count is not the local cache's, so nothing is predicted.
        if kv is None or predicted is None or p.pd:
            p.hdrs.pop(H.KV_PREDICTED, None)
            p.hdrs.pop(H.PREFILL_TOKENS, None)
        else:
            p.hdrs[H.KV_PREDICTED] = f"{predicted},{self.instance}"
            # What it should compute, for its prefill backlog (engine_worker/backlog.py).
            prompt = kv.tokens.get(r.replica, 0)
            p.hdrs[H.PREFILL_TOKENS] = str(max(1, prompt - predicted))

    async def _send(self, r: Replica, p: _Placement) -> dict[str, Any] | None:
        """Send the request to ``r`` and return its ack; None when it did not answer in time."""
        p.hdrs[H.ATTEMPT] = str(p.attempt)
        r.unacked += 1
        sent_at = time.monotonic()
        # Its prompt joins the replica's backlog as this router sees it, until the ack says.
        adds = p.hdrs.get(H.PREFILL_TOKENS, "")
        if adds.isdigit():
            r.add_backlog(int(adds), sent_at)
        try:
            ack_msg = await natsclient.request(
                self.nc,
                r.subject,
                p.data,
                timeout=self.cfg.dispatch_timeout_s,
                headers=p.hdrs,
                at_once=self.cfg.write_at_once,
            )
        except NoRespondersError:
            if natsclient.resumed_within(self.nc, RESUBSCRIBE_GRACE_S):
                # The bus was silent a moment ago (stalled, or this connection came back):
                # replicas subscribe again as their own connections come back. Asked again
                # shortly, not forgotten.
                await asyncio.sleep(0.1)
                return None
            # The replica is gone (crashed or unsubscribed); forget it until it
            # beats again.
            self.registry.remove(r.replica)
            p.failed(r.replica, E.ReplicaLost(f"replica {r.replica} did not answer"))
            return None
        except NatsTimeout:
            if _bus_quiet_since(self.nc, sent_at) and not marks.expired(p.hdrs):
                # Not the replica: the bus stalled (or this connection reconnected) while
                # it waited. The same replica is asked again (it acknowledges a request it
                # runs already, so nothing runs twice); not counted against it.
                return await self._send(r, p)
            # Slow or stuck: make sure it does not also generate, then try another.
            await self._cancel(r, p)
            p.failed(r.replica, E.Timeout(f"replica {r.replica} did not acknowledge in time"))
            return None
        finally:
            r.unacked = max(0, r.unacked - 1)
        r.heard_ack(time.monotonic() - sent_at)
        return codec.decode_map(ack_msg.data)

    async def _cancel(self, r: Replica, p: _Placement) -> None:
        """Tell ``r`` to drop the request it did not acknowledge. If it runs it after all
        (the dispatch came late), that copy's caller never reads it: its usage report says
        so (``dup``), and leaves the request's charge to the copy that is read, which runs
        under the same admission and hold (auth.budgets.SpendBook.settle)."""
        await self.nc.publish(
            subjects.worker_cancel(r.replica),
            codec.encode(
                {
                    "type": "cancel",
                    "request_id": p.hdrs.get(H.REQUEST_ID, ""),
                    "reply": p.reply,
                    "dup": True,
                }
            ),
        )

    def _refused(self, r: Replica, err: E.TokenbusError, p: _Placement) -> None:
        """``r`` refused the request: wait for room when busy, move on when the refusal
        names the replica, raise ``err`` when it names the request."""
        if err.code == E.ReplicaBusy.code:
            # Full until its next heartbeat says otherwise.
            r.reported_in_flight = max(r.reported_in_flight, r.max_concurrency)
            p.busy.add(r.replica)
            _refused_event(r.replica, err.code)
            return
        if err.code == E.ReplicaDraining.code:
            r.draining = True
        if err.code not in _TRY_ELSEWHERE:
            raise err
        p.failed(r.replica, err)

    async def _load_adapter(self, p: _Placement, live: list[Replica]) -> bool:
        """When ``p`` asks for a wanted adapter (router.adapters): no live replica holds it
        yet, so wait (once, within the request's deadline) for its load on a replica of its
        model, True when one holds it now; every holder is at capacity, so start a load on
        another while the request waits for room as any other (False)."""
        assert self.adapters is not None
        want = self.adapters.wanted(p.model)
        if want is None:
            return False
        task = self.adapters.start(want)
        if live or p.loaded:
            return False
        p.loaded = True
        if task is None:
            raise E.NoReplica(
                f"no replica of {want.model!r} has room to load the adapter {want.name!r}; "
                "retry shortly",
                headers={"Retry-After": "1"},
            )
        deadline = marks.deadline_ms(p.hdrs)
        left = LOAD_TIMEOUT_S if deadline is None else max(0.0, (deadline - marks.now_ms()) / 1e3)
        try:
            done = await asyncio.wait_for(asyncio.shield(task), left)
        except TimeoutError:
            raise E.Timeout(f"the request's deadline passed while {want.name!r} loaded") from None
        if done is None:
            raise E.NoReplica(
                f"the adapter {want.name!r} could not be loaded on a replica of "
                f"{want.model!r}; retry shortly",
                headers={"Retry-After": "1"},
            )
        return True

    def _may_hold(self, model: str) -> bool:
        """Whether a request for ``model``, which has no live replica, waits for one: the
        waiting room is on and the model is one this router knows."""
        cfg = self.cfg
        return cfg.waiting_room_s > 0 and (
            self.registry.ever_seen(model)
            or model in cfg.models
            or model in cfg.waiting_room_models
        )

    async def _wait_for_room(self, p: _Placement, limit_s: float | None = None) -> None:
        """Wait one poll in the queue (or, with ``limit_s``, the waiting room), taking a
        place on the first wait; raises :class:`E.Overloaded` when the queue is full or the
        wait is over (:class:`E.NoReplica` when no replica started)."""
        now = time.monotonic()
        if not p.queued_until:
            self._join_queue(p, now, limit_s)
        if now >= p.queued_until or marks.expired(p.hdrs):
            if not self.registry.live(p.model):
                waited = self.cfg.waiting_room_s
                raise E.NoReplica(
                    f"no replica of model {p.model!r} started within {waited:g} s; retry shortly",
                    headers={"Retry-After": str(max(1, round(waited)))},
                )
            raise self._overloaded(p.model, "no replica freed up in time")
        await asyncio.sleep(_QUEUE_POLL_S)
        p.busy.clear()

    def _join_queue(self, p: _Placement, now: float, limit_s: float | None = None) -> None:
        """Take a place in the model's queue until the queue timeout (or ``limit_s``),
        unless it is full."""
        if self.queued.get(p.model, 0) >= self.cfg.max_queued:
            raise self._overloaded(p.model, "its queue is full")
        self.queued[p.model] = self.queued.get(p.model, 0) + 1
        p.queued_until = now + (self.cfg.queue_timeout_s if limit_s is None else limit_s)
        self.holding[(p.model, p.tier)] += 1
        if self._report is None or self._report.done():
            self._report = asyncio.get_running_loop().create_task(self._report_loop())

    def _leave_queue(self, p: _Placement) -> None:
        """Give back the request's place in the queue, if it took one."""
        if p.queued_until:
            self.queued[p.model] -= 1
            key = (p.model, p.tier)
            self.holding[key] -= 1
            if self.holding[key] <= 0:
                del self.holding[key]

    async def _report_loop(self) -> None:
        """While this router (or bridge) holds requests, say how many per model and class
        every second on the bus (the telemetry service exports them for autoscalers), and
        once more when it holds none."""
        with contextlib.suppress(Exception):
            while True:
                held = dict(self.holding)
                await self.nc.publish(
                    subjects.telemetry(subjects.TELEMETRY_QUEUE),
                    codec.encode(queue_report(self.instance, held, REPORT_EVERY_S)),
                )
                if not held:
                    return
                await asyncio.sleep(REPORT_EVERY_S)

    def _give_up(self, p: _Placement) -> E.TokenbusError:
        """Why no replica took the request: each one tried failed, none is live, or the
        model does not exist."""
        if p.tried:
            return E.NoReplica(
                f"no replica of model {p.model!r} could take the request"
                + (f" ({p.last_err.message})" if p.last_err else "")
                + "; retry shortly"
            )
        kind = p.hdrs.get(H.KIND)
        others = self.registry.live(p.model)
        if kind and others and not self.registry.live(p.model, kind):
            served = sorted(set().union(*(r.endpoints for r in others)))
            return E.InvalidRequest(
                f"the model {p.model!r} does not serve {kind} (it serves {', '.join(served)})",
                param="model",
            )
        if self.registry.ever_seen(p.model):
            return E.NoReplica(f"no live replica serves model {p.model!r} right now; retry shortly")
        available = ", ".join(self.registry.models()) or "none"
        return E.ModelNotFound(
            f"the model {p.model!r} does not exist on this tokenbus (available: {available})",
            param="model",
        )
