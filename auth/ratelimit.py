"""The ratelimit stage: admits a request against its key's limits (see :mod:`auth.limits`)
and reconciles token reservations with the usage workers report.

A request moved to another replica (migration) comes through again. It counts once: each
admission hands the caller (through the worker's accept frame) an *admission ticket*, an
HMAC over the key, the request id, the attempt and its reservation with a secret only the
limiters hold, and the caller sends it back with the migrated request. A valid ticket,
claimed once (a replay is counted as a new request), admits the next attempt without
counting a request, and tells the limiter that admitted the previous attempt to charge it
only the output the caller got from it (the new attempt's report counts the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from prometheus_client import Counter

from auth import budgets
from auth.cut_off_state import CutOffState
from auth.limits import Limiter, info_header
from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import check_envelope, envelope_chars
from services import bodies, buckets, tracing
from services.config import PriceSettings, Settings, kv_replicas
from services.runtime import Service, cancel_and_wait


def parse_limits(value: str | None) -> tuple[int | None, int | None, int | None]:
    parts = (value or "").split(",")
    parts += [""] * (3 - len(parts))
    vals = [marks.number(p.strip()) for p in parts[:3]]
    return vals[0], vals[1], vals[2]


# A ticket is good for this long after its attempt was admitted (and never past the
# request's deadline); the claim that makes it single-use lives about as long.
TICKET_TTL_S = 150.0
# A supersede's spend is tried this long until the spend stream acknowledges it (as a
# worker's report is: a stream electing a leader answers nothing for seconds).
SUPERSEDE_FOR_S = 60.0
# Requests held to a budget for a model whose every price is 0 (or unset): they count $0.
UNPRICED = Counter(
    "tokenbus_budget_unpriced_total",
    "Requests held to a spend budget for a model without a price (they count $0)",
    ["model"],
)


@dataclass(frozen=True, slots=True)
class Ticket:
    """The admission of one attempt of a request, as the caller hands it back."""

    window: int
    reserved: int
    flags: str
    owner: str
    attempt: int
    expires: int
    sig: str
    rid: str = ""  # the request's id (the gateway's, given at its first admission)


def _sign(secret: bytes, principal: str, body: str) -> str:
    msg = f"{principal}\n{body}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]


def _ticket_safe(rid: str) -> bool:
    """Whether a ticket can carry ``rid`` (its fields are separated by commas). Ingress and
    the bridge give every request an id that can; a role that sends a stage another (the
    NATS fuzz: ``Tb-Request-Id: ,,,``) gets one made here instead of a failed handler."""
    return bool(rid) and "," not in rid and len(rid) <= 128


def issue_ticket(secret: bytes, principal: str, rid: str, t: Ticket) -> str:
    """``window,reserved,flags,owner,attempt,expires,rid,sig`` (``t.sig`` and ``t.rid`` are
    ignored): signed for the key and the request, whose id it carries, so the next attempt,
    admitted under an id of its own, is known for the same request (issue 64)."""
    if "," in rid:
        raise ValueError("a request id has no comma")
    body = f"{t.window},{t.reserved},{t.flags},{t.owner},{t.attempt},{t.expires},{rid}"
    return f"{body},{_sign(secret, principal, body)}"


def read_ticket(secret: bytes, value: str, principal: str, now: float) -> Ticket | None:
    """The ticket if ``secret`` signed it for this key and it has not expired."""
    body, _, sig = value.rpartition(",")
    parts = body.split(",")
    if not secret or len(parts) != 7 or len(sig) != 32 or not parts[6]:
        return None
    if not hmac.compare_digest(sig, _sign(secret, principal, body)):
        return None
    try:
        t = Ticket(
            int(parts[0]),
            int(parts[1]),
            parts[2],
            parts[3],
            int(parts[4]),
            int(parts[5]),
            sig,
            parts[6],
        )
    except ValueError:
        return None
    return t if t.expires >= now else None


# What a request that set no max_tokens (the gateway's default) reserves for its answer at
# admission; what it really makes is charged when it ends (auth.limits reconciles), so a
# key's concurrent requests are not refused for answers they will not write.
DEFAULT_RESERVE = 512


def estimate_tokens(env: dict[str, Any]) -> int:
    """Prompt (about four characters a token) plus the most the request may generate (for
    a request that set no max_tokens, at most :data:`DEFAULT_RESERVE`)."""
    chars = envelope_chars(env)
    params = env.get("params") or {}
    out = int(params.get("max_tokens", 0))
    if params.get("max_tokens_set") is False:
        out = min(out, DEFAULT_RESERVE)
    return (chars + 3) // 4 + out


def fit_tpm(env: dict[str, Any], tpm: int) -> bool:
    """Lower a default ``max_tokens`` (the client set none; with the gateway's default of
    the context it is more than any context) to what the key's TPM leaves after the prompt:
    one answer never outgrows the key's minute. A client's own value is left to be refused
    (:class:`~bus_schemas.errors.TokensExceedLimit`) as before. Whether it changed."""
    params = env.get("params")
    if not isinstance(params, dict) or params.get("max_tokens_set") is not False:
        return False
    prompt = (envelope_chars(env) + 3) // 4
    was = int(params.get("max_tokens", 1))
    now = max(1, min(was, tpm - prompt))
    params["max_tokens"] = now
    return now != was


class RateLimitCheck:
    """The ratelimit stage's work on one request, shared by the stage service and the HTTP
    bridge (which runs it in-process): admit against the key's limits, or raise."""

    def __init__(
        self,
        limiter: Limiter,
        *,
        fail_open: bool,
        log: Any,
        spend: budgets.SpendBook | None = None,
        prices: Any = None,
        owner_grace_s: float | None = None,
    ) -> None:
        self.limiter = limiter
        self.owner_grace_s = SPEND_OWNER_GRACE_S if owner_grace_s is None else owner_grace_s
        self.fail_open = fail_open
        self.log = log
        self._settling: set[asyncio.Task[None]] = set()
        # Spend budgets (auth.budgets): the book and each model's price. What a request
        # holds travels with it (Tb-Spend) and comes back in its usage report, so any
        # limiter settles it: this one at once, another from the stream if this one died.
        self.spend = spend
        self.prices: Any = prices or (lambda model: None)
        self._unpriced_said: dict[str, float] = {}
        self._spend_sub: Any = None
        self._spend_pull: Any = None  # the stream's consumer
        self._spend_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None  # cut-off mode: local holds out

    @classmethod
    async def open(cls, nc: NATS, settings: Settings, owner: str, log: Any) -> RateLimitCheck:
        """The check of a limiter instance ``owner`` (its limiter and spend book opened),
        with the model prices of ``settings``."""
        rl = settings.ratelimit
        state = None
        if rl.cut_off_share and rl.cut_off_dir:
            state = CutOffState(rl.cut_off_dir, owner).open()
        limiter = await Limiter(
            nc,
            owner=owner,
            cut_off_share=rl.cut_off_share,
            cut_off_after_s=rl.cut_off_after_s,
            state=state,
        ).open()
        spend = await budgets.SpendBook(nc, log).open()
        if state is not None:
            spend.keep_locally_on(state)
        router = settings.router

        def price(model: str) -> PriceSettings | None:
            return router.routing_for(model).price

        check = cls(
            limiter,
            fail_open=settings.ratelimit.fail_open,
            log=log,
            spend=spend,
            prices=price,
            owner_grace_s=settings.ratelimit.owner_grace_s,
        )
        await check.start(nc)
        return check

    async def apply(self, hdrs: dict[str, str], env: dict[str, Any]) -> bool:
        """Admit (headers updated in place with what the worker reports back) or raise;
        whether ``env`` changed (a default ``max_tokens`` lowered to the key's TPM)."""
        principal = hdrs.get(H.PRINCIPAL)
        rpm, tpm, conc = parse_limits(hdrs.get(H.LIMITS))
        if not principal:
            return False
        if rpm is None and tpm is None and conc is None:
            # No limits: only budgets, if the key or its owner has one.
            if hdrs.get(H.BUDGET) and self.spend is not None:
                await self._hold(hdrs, env, principal, tpm)
            return False
        deadline = marks.deadline_ms(hdrs)
        deadline_s = deadline / 1000 if deadline else time.time() + 600
        rid = hdrs.get(H.REQUEST_ID) or str(env.get("request_id", ""))
        ticket = hdrs.pop(H.ADMISSION, None)
        attempt = marks.attempt(hdrs.get(H.MIGRATION))
        changed = tpm is not None and fit_tpm(env, tpm)
        tokens = estimate_tokens(env)
        if tpm is not None and tokens > tpm and attempt < 1:
            # No window ever holds it: refused as the client's to fix, never "retry".
            err = E.TokensExceedLimit.of(tpm, tokens)
            tracing.verdict(subjects.STAGE_RATELIMIT, "deny", {tracing.ERROR_TYPE: err.code})
            raise err
        signed: Ticket | None = None
        try:
            signed, claimed = await self._prior(ticket, principal, rid, attempt)
            prior = signed if claimed else None
            # A migration is the request its ticket names (ingress gives each admission an
            # id of its own), whose slot and hold it takes on; one its ticket does not prove
            # (none, forged, replayed) is a new request, under an id of its own, never one a
            # caller named.
            proved = prior.rid if prior is not None else rid if attempt < 1 else None
            if proved is not None and not _ticket_safe(proved):
                proved = None  # no id a ticket can carry (a comma, too long): one of ours
            if proved != rid:
                rid = proved or marks.new_request_id()
                hdrs[H.REQUEST_ID] = rid
                env["request_id"] = rid
                changed = True
            adm = await self.limiter.admit(
                principal,
                rid,
                rpm=rpm,
                tpm=tpm,
                concurrent=conc,
                tokens=tokens,
                deadline_s=deadline_s,
                requests=0 if prior else 1,
                attempt=attempt,
            )
        except E.TokenbusError as exc:
            tracing.verdict(subjects.STAGE_RATELIMIT, "deny", {tracing.ERROR_TYPE: exc.code})
            raise
        except Exception as exc:
            if not self.fail_open:
                tracing.verdict(subjects.STAGE_RATELIMIT, "deny", {"tokenbus.store": "down"})
                raise E.ServiceUnavailable(
                    "the rate limiter cannot reach its store; retry"
                ) from None
            self.log.warning("ratelimit_fail_open", error=str(exc), principal=principal)
            tracing.verdict(subjects.STAGE_RATELIMIT, "allow", {"tokenbus.fail_open": True})
            return changed
        if tracing.on():
            tracing.verdict(
                subjects.STAGE_RATELIMIT, "allow", {"tokenbus.migrated": prior is not None}
            )
        flags = ("w" if rpm is not None or tpm is not None else "") + (
            "c" if conc is not None else ""
        )
        # The worker sends the real usage to this limiter instance (it holds the slot).
        owner = self.limiter.owner
        hdrs[H.RATELIMIT] = f"{adm.window},{adm.reserved},{flags},{owner}"
        if adm.info:
            hdrs[H.RATELIMIT_INFO] = info_header(adm.info)
        if signed is not None:
            # Every move a signed ticket names supersedes the attempt it moved from, the
            # move that claimed the ticket or not: a claim whose admission then failed (a
            # partition, a stall past the caller's wait) left the caller's next try of the
            # same move a replay, and what the caller got from an attempt whose worker died
            # was never charged (docs/nemesis.md, finding 16). A supersede settles once
            # (auth.budgets, auth.limits): the second changes nothing, and never lowers.
            await self._supersede(signed, principal, signed.rid, env, hdrs)
        if hdrs.get(H.BUDGET) and self.spend is not None:
            try:
                await self._hold(hdrs, env, principal, tpm, admitted=True)
            except E.TokenbusError:
                # Refused for its budget: what the limiter admitted goes back at once.
                await self.limiter.settle(principal, rid, 0, attempt=attempt)
                raise
        expires = int(min(deadline_s, time.time() + TICKET_TTL_S))
        this = Ticket(adm.window, adm.reserved, flags, owner, attempt, expires, "")
        hdrs[H.ADMISSION] = issue_ticket(self.limiter.secret, principal, rid, this)
        return changed

    async def _hold(
        self,
        hdrs: dict[str, str],
        env: dict[str, Any],
        principal: str,
        tpm: int | None,
        *,
        admitted: bool = False,
    ) -> None:
        """Hold the request's likely cost in its key's and owner's budgets, or raise 429
        ``insufficient_quota``. A request the limiter did not admit (a key without limits)
        gets a ``Tb-Ratelimit`` naming this instance, so its usage report comes here."""
        assert self.spend is not None
        if self.limiter.cut_off_share:
            # Cut-off mode (a site's bridge): a store across a cut link that has not answered
            # in cut_off_after_s: held in this limiter's book from a share of each budget,
            # written into the store once it answers (SpendBook.reserve_locally).
            if not await self.limiter.in_reach(self._hold_in_store(hdrs, env, principal, admitted)):
                await self._hold_in_store(hdrs, env, principal, admitted, local=True)
            return
        await self._hold_in_store(hdrs, env, principal, admitted)

    async def _hold_in_store(
        self,
        hdrs: dict[str, str],
        env: dict[str, Any],
        principal: str,
        admitted: bool,
        *,
        local: bool = False,
    ) -> None:
        assert self.spend is not None
        scopes = (
            self._cached_scopes(hdrs, principal) if local else await self._scopes(hdrs, principal)
        )
        if not scopes:
            return
        model = hdrs.get(H.MODEL) or str(env.get("model", ""))
        price = self.prices(model)
        if price is None or not (price.input or price.output or price.cached_input):
            self._unpriced(model, principal)
            if price is None:
                return
        tokens = estimate_tokens(env)
        params = env.get("params") or {}
        out = min(tokens, int(params.get("max_tokens", 0) or 0))
        amount = budgets.cost(price, tokens - out, out)
        rid = hdrs.get(H.REQUEST_ID) or str(env.get("request_id", ""))
        deadline = marks.deadline_ms(hdrs)
        deadline_s = deadline / 1000 if deadline else time.time() + 600
        attempt = marks.attempt(hdrs.get(H.MIGRATION))
        name = hold_key(rid, attempt)
        if attempt > 0 and not admitted:
            # No ticket proves a migration here (a key without limits): its hold is its own,
            # whatever id it names.
            name = f"{name}~{marks.new_request_id()[:12]}"
        try:
            if local:
                share = self.limiter.cut_off_share
                hold = self.spend.reserve_locally(scopes, name, amount, deadline_s, share)
            else:
                hold = await self.spend.reserve(scopes, name, amount, deadline_s)
        except E.TokenbusError as exc:
            tracing.verdict(subjects.STAGE_RATELIMIT, "deny", {tracing.ERROR_TYPE: exc.code})
            raise
        hdrs[H.SPEND] = spend_header(model, hold)
        if not admitted:
            hdrs[H.RATELIMIT] = f"0,0,,{self.limiter.owner}"

    def _unpriced(self, model: str, principal: str) -> None:
        """A request held to a budget for a model without a price costs $0: said once a
        minute per model (log and counter), never silently."""
        UNPRICED.labels(model).inc()
        now = time.monotonic()
        if now - self._unpriced_said.get(model, -1e9) >= 60:
            self._unpriced_said[model] = now
            self.log.warning(
                "budget_without_price",
                model=model,
                key_id=principal,
                hint="budgets exist but every price of this model is 0: its requests count "
                "$0. Set router.price or router.models.<model>.price (TOKENBUS_ROUTER__PRICE) "
                "for every bridge and ratelimit process",
            )

    def _cached_scopes(self, hdrs: dict[str, str], principal: str) -> list[budgets.Budget]:
        """:meth:`_scopes` with the owner's budget as last read (the store out of reach)."""
        assert self.spend is not None
        key_budget, owner = budgets.parse_header(hdrs.get(H.BUDGET))
        scopes = [] if key_budget is None else [self._key_scope(key_budget, principal)]
        owner_budget = self.spend.cached_owner_budget(owner)
        return scopes if owner_budget is None else [*scopes, owner_budget]

    def _key_scope(self, key_budget: budgets.Budget, principal: str) -> budgets.Budget:
        return budgets.Budget(
            f"k.{principal}",
            key_budget.period,
            key_budget.hard,
            key_budget.soft,
            f"key:{principal}",
        )

    async def _scopes(self, hdrs: dict[str, str], principal: str) -> list[budgets.Budget]:
        """The budgets a request of ``principal`` is held to: its key's (``Tb-Budget``) and
        its owner's."""
        assert self.spend is not None
        key_budget, owner = budgets.parse_header(hdrs.get(H.BUDGET))
        scopes = [] if key_budget is None else [self._key_scope(key_budget, principal)]
        try:
            owner_budget = await self.spend.owner_budget(owner)
        except Exception as exc:
            raise E.ServiceUnavailable(f"the spend book cannot be read ({exc}); retry") from None
        if owner_budget is not None:
            scopes.append(owner_budget)
        return scopes

    async def _settle_spend(self, u: dict[str, Any]) -> None:
        """Charge a finished attempt what it cost and drop its hold, from its usage report
        (whichever limiter took it: a hold settled once charges nothing again); alert on a
        soft threshold crossed."""
        if self.spend is None or "spend" not in u:
            return
        if self.spend.local:  # holds taken while cut off go into the store first
            await self.spend.flush_local()
        held = read_spend(str(u["spend"]))
        if held is None:
            self.log.warning("spend_report_unreadable", request_id=u.get("request_id"))
            return
        hold, model = held
        price = self.prices(model)
        superseding = "resumed" in u
        produced = None
        if superseding:  # moved by its caller: the output the caller says it got, a price
            # that holds only until the attempt's own worker reports what it produced (the
            # next attempt's report pays the prompt and the rest)
            prompt, completion, cached = 0, int(u["resumed"]), 0
        else:
            prompt = int(u.get("prompt", u.get("used", 0)))
            completion, cached = int(u.get("completion", 0)), int(u.get("cached", 0))
            produced = budgets.cost(price, 0, completion)
        actual = budgets.cost(price, prompt, completion, cached)
        crossed = await self.spend.settle(
            hold,
            actual,
            superseding=superseding,
            produced=produced,
            counted=bool(u.get("counted")),
            duplicate=str(u["dup"])[:128] if u.get("dup") else None,
        )
        if crossed:
            await self.spend.alert(crossed, model)

    async def _prior(
        self, ticket: str | None, principal: str, rid: str, attempt: int
    ) -> tuple[Ticket | None, bool]:
        """The earlier attempt's admission named by a migration's ticket (one this bus's
        limiters signed for this key and an earlier attempt), and whether this migration
        claimed it: a ticket proves the request once."""
        if not ticket or attempt < 1:
            return None, False
        t = read_ticket(self.limiter.secret, ticket, principal, time.time())
        if t is None or t.attempt >= attempt:
            return None, False
        if not await self.limiter.claim(t.sig):
            self.log.warning("admission_ticket_replayed", principal=principal, request_id=rid)
            return t, False
        return t, True

    async def _supersede(
        self, prior: Ticket, principal: str, rid: str, env: dict[str, Any], hdrs: dict[str, str]
    ) -> None:
        """Tell the limiter that admitted the earlier attempt what the caller got from it
        (and, where it held spend, any limiter: the earlier attempt's hold is named by its
        request and attempt, its budgets are this request's)."""
        resume = env.get("resume")
        got = 0
        if isinstance(resume, dict):  # tokens: all the caller holds; since: before that attempt
            got = int(resume.get("tokens", 0) or 0) - int(resume.get("since", 0) or 0)
        body = {
            "principal": principal,
            "request_id": rid,
            "window": prior.window,
            "reserved": prior.reserved,
            "used": 0,
            "flags": prior.flags,
            "attempt": prior.attempt,
            "resumed": max(0, got),
        }
        if hdrs.get(H.GATEWAY_COUNTED) == "1":  # counted by the bridge, not a client's word
            body["counted"] = True
        if hdrs.get(H.BUDGET) and self.spend is not None and prior.owner:
            # Spend: its budgets read and the report kept by the stream off the admission's
            # path, each tried while the bus does not answer. A supersede lost to a stream
            # without a leader, or sent without its spend when the owner's budget could
            # not be read for a moment, left what the caller got from an attempt whose
            # worker died uncharged (its hold ran out).
            model = hdrs.get(H.MODEL) or str(env.get("model", ""))
            budget = {H.BUDGET: hdrs[H.BUDGET]}
            work = self._supersede_spend(body, budget, prior, model, time.time())
            self._spawn_settle(work, subjects.usage_spend(prior.owner))
            return
        await self._publish_supersede(body, prior)

    async def _publish_supersede(self, body: dict[str, Any], prior: Ticket) -> None:
        """Tokens and slots only: the admitting limiter's alone, over core NATS."""
        with contextlib.suppress(Exception):
            await self._nc.publish(subjects.usage(prior.owner or None), codec.encode(body))

    async def _supersede_spend(
        self, body: dict[str, Any], budget: dict[str, str], prior: Ticket, model: str, at: float
    ) -> None:
        """The supersede of an attempt held to budgets, kept by the spend stream: its
        budgets (the key's and its owner's) read again until the spend book answers, up to
        :data:`SUPERSEDE_FOR_S`; then published until the stream acknowledges it."""
        give_up = time.monotonic() + SUPERSEDE_FOR_S
        while True:
            try:
                scopes = await self._scopes(budget, str(body["principal"]))
                break
            except E.ServiceUnavailable:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(0.5)
        was = budgets.Hold(hold_key(str(body["request_id"]), prior.attempt), 0)
        was.budgets = [(b, b.entry(at)) for b in scopes]
        if not was.budgets:
            await self._publish_supersede(body, prior)
            return
        body["spend"] = spend_header(model, was)
        ident = f"supersede.{was.request_id}"
        await self._keep(subjects.usage_spend(prior.owner), codec.encode(body), ident)

    async def _keep(self, subject: str, data: bytes, ident: str) -> None:
        """Publish ``data`` to the spend stream, tried again with its message id (the
        stream drops a repeat) until acknowledged, up to :data:`SUPERSEDE_FOR_S`."""
        js = self._nc.jetstream(timeout=5)
        await buckets.through_stall(
            lambda: js.publish(
                subject, data, stream=subjects.SPEND_STREAM, headers={"Nats-Msg-Id": ident}
            ),
            what="supersede",
            stall_s=SUPERSEDE_FOR_S,
            stream_exists=True,
        )

    async def start(self, nc: NATS) -> None:
        """Listen for the usage reports of requests this instance admitted, and settle the
        spend of every limiter's from the stream that keeps them."""
        self._nc = nc
        owner = self.limiter.owner
        self._usage_sub = await nc.subscribe(subjects.usage(owner), cb=self._on_usage)
        if self.spend is not None:
            self._spend_sub = await nc.subscribe(subjects.usage_spend(owner), cb=self._on_usage)
            self._spend_task = asyncio.get_running_loop().create_task(self._spend_reports())
            if self.limiter.cut_off_share:
                self._flush_task = asyncio.get_running_loop().create_task(self._flush_local())

    async def _flush_local(self) -> None:
        """Cut-off mode: the holds taken while the store was out of reach, written into it
        as soon as it answers (within a second or so of the link's return: before another
        limiter may settle their reports from the stream, after ``owner_grace_s``)."""
        assert self.spend is not None
        while True:
            await asyncio.sleep(0.5)
            if self.spend.local:
                try:
                    await self.spend.flush_local()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # still cut off: again
                    self.log.debug("spend_local_not_flushed", error=repr(exc)[:200])

    async def _spend_reports(self) -> None:
        """Settle the spend reports kept in the stream (one durable consumer all limiters
        share): those this instance settled already charge nothing again; those of a
        limiter that died are charged here. A report is acknowledged once settled."""
        js = self._nc.jetstream(timeout=5)
        sub = None
        while sub is None:
            try:
                await buckets.open_stream(js, spend_stream_config())
                sub = await js.pull_subscribe(
                    subjects.usage_spend_wildcard(),
                    durable=subjects.SPEND_CONSUMER,
                    stream=subjects.SPEND_STREAM,
                    config=api.ConsumerConfig(
                        ack_policy=api.AckPolicy.EXPLICIT, ack_wait=SPEND_ACK_WAIT_S
                    ),
                )
                self._spend_pull = sub
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no JetStream yet (a node catching up): again soon
                self.log.warning("spend_stream_unavailable", error=repr(exc)[:200])
                await asyncio.sleep(2.0)
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # nothing waiting (a timeout), or the node moving: again
                await asyncio.sleep(0.05)
                continue
            await asyncio.gather(*(self._settle_kept(m) for m in msgs))

    async def _settle_kept(self, msg: Any) -> None:
        if msg.subject != subjects.usage_spend(self.limiter.owner):
            # Another limiter's report: its owner settles it (it heard it directly, and its
            # book alone remembers what it charged, which a later supersede corrects). Taken
            # here only once the owner had ``owner_grace_s`` to do it: a dead owner's.
            grace = self.owner_grace_s
            try:
                age = time.time() - msg.metadata.timestamp.timestamp()
            except Exception:
                age = grace
            if age < grace:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=grace - age)
                return
        try:
            u = codec.decode_map(msg.data)
        except Exception:
            self.log.warning("spend_report_unreadable", subject=msg.subject)
            with contextlib.suppress(Exception):
                await msg.ack()
            return
        try:
            await self._settle_spend(u)
        except Exception as exc:  # the spend book did not answer: redelivered later
            self.log.warning(
                "spend_not_settled",
                error=str(exc),
                subject=msg.subject,
                request_id=u.get("request_id"),
                redelivered=True,
            )
            return
        with contextlib.suppress(Exception):
            await msg.ack()

    async def stop(self) -> None:
        await cancel_and_wait(self._flush_task)
        await cancel_and_wait(self._spend_task)  # (its cancel can be lost in a fetch)
        # Unsubscribed here, not drained with the connection: a fetch cut off by the
        # cancellation leaves nothing for the drain to wait on.
        for s in (self._spend_pull, self._spend_sub):
            if s is not None:
                with contextlib.suppress(Exception):
                    await s.unsubscribe()
        with contextlib.suppress(Exception):
            await self._usage_sub.unsubscribe()
        if self._settling:  # reports already taken are settled before the limiter closes
            await asyncio.wait(self._settling, timeout=5)
            for task in list(self._settling):  # not after it: a late one would take slots back
                task.cancel()
        await self.limiter.close()

    async def _on_usage(self, msg: Msg) -> None:
        """Settle a usage report in its own task. nats-py runs a subscription's callbacks one
        after another, so awaiting the store's round trip here would settle one request per
        round trip, however many finished meanwhile; as tasks, the reports that arrive while
        one key's compare-and-set is in flight go together in its next one."""
        try:
            u = codec.decode_map(msg.data)
            if "spend" in u:
                self._spawn_settle(self._settle_spend(u), msg.subject)
            opt = {k: int(u[k]) for k in ("prompt", "completion", "resumed") if k in u}
            settle = self.limiter.settle(
                str(u["principal"]),
                str(u["request_id"]),
                int(u.get("used", 0)),
                attempt=int(u.get("attempt", 0)),
                **opt,
            )
        except Exception as exc:
            self.log.warning("usage_not_settled", error=str(exc))
            return
        task = asyncio.get_running_loop().create_task(self._settle(settle, msg.subject))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _spawn_settle(self, work: Coroutine[Any, Any, Any], subject: str) -> None:
        """Settle a report's spend in its own task (as :meth:`_on_usage` settles tokens)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                self.log.warning("spend_not_settled", error=str(exc), subject=subject)

        task = asyncio.get_running_loop().create_task(run())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, settle: Coroutine[Any, Any, bool], subject: str) -> None:
        try:
            settled = await settle
        except Exception as exc:
            self.log.warning("usage_not_settled", error=str(exc))
            return
        if not settled:
            # Not an attempt this instance admitted (or one it has forgotten): a report
            # never charges or frees anything it did not reserve.
            self.log.debug("usage_of_unknown_attempt", subject=subject)


# How long a spend report fetched from the stream may stay unacknowledged before another
# limiter is given it (its settler died mid-way).
SPEND_ACK_WAIT_S = 10.0
# How long a spend report kept in the stream is left to the limiter it names (which heard it
# directly) before any other settles it: a paused or cut-off owner that comes back in time
# settles its own, so a moved attempt's charge is corrected in the book that made it.
SPEND_OWNER_GRACE_S = 5.0


def spend_stream_config() -> api.StreamConfig:
    """The spend reports' stream: a work queue (a report settled and acknowledged is gone),
    file storage, the buckets' replicas, a day at most."""
    return api.StreamConfig(
        name=subjects.SPEND_STREAM,
        subjects=[subjects.usage_spend_wildcard()],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=kv_replicas(),
        max_age=86400.0,
    )


def hold_key(rid: str, attempt: int) -> str:
    """The name of one attempt's hold in a budget entry (a migrated request holds again
    under its next attempt)."""
    return f"{rid}#{attempt}"


def spend_header(model: str, hold: budgets.Hold) -> str:
    """``Tb-Spend``: what ``hold`` holds, for whichever limiter settles it."""
    return json.dumps(
        {
            "m": model,
            "k": hold.request_id,
            "b": [[b.scope, b.period, b.hard, b.soft, b.name, entry] for b, entry in hold.budgets],
        },
        separators=(",", ":"),
    )


def read_spend(value: str) -> tuple[budgets.Hold, str] | None:
    """The hold and model a ``Tb-Spend`` names; None when it is not one."""
    try:
        d = json.loads(value)
        hold = budgets.Hold(str(d["k"]), 0)
        for scope, period, hard, soft, name, entry in d["b"]:
            b = budgets.Budget(
                str(scope),
                str(period),
                None if hard is None else int(hard),
                None if soft is None else int(soft),
                str(name),
            )
            hold.budgets.append((b, str(entry)))
        return hold, str(d.get("m", ""))
    except (ValueError, KeyError, TypeError):
        return None


class RateLimit(Service):
    """Holds every key to its RPM, TPM and concurrency limits across all instances."""

    name = subjects.STAGE_RATELIMIT

    async def setup(self) -> None:
        self.check = await RateLimitCheck.open(
            self.nc, self.settings, f"ratelimit-{self.id}", self.log
        )
        await self.stage_endpoints(subjects.STAGE_RATELIMIT).add("ratelimit", self.handle)

    @property
    def limiter(self) -> Limiter:
        return self.check.limiter

    async def on_stop(self) -> None:
        await self.check.stop()

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        data = msg.data
        if (H.LIMITS in hdrs or H.BUDGET in hdrs) and H.PRINCIPAL in hdrs:
            env = codec.decode_map(msg.data)
            check_envelope(env)
            if await self.check.apply(hdrs, env):
                data = bodies.encode(env)
        await self.forward_next(msg, hdrs, data)
