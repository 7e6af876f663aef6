"""Ingress: validates requests from NATS clients and the bridge, builds the envelope, and
starts it down the pipeline (a routing slip in the ``Tb-Route`` header)."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from bus_schemas import codec, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CLAIM, CLAIMED, envelope_chars
from gateway import validation
from gateway.validation import client_label
from jobs.background import BackgroundState
from jobs.batches import BatchState
from jobs.response_store import ResponsesState
from services import bodies, tracing
from services.config import Settings
from services.runtime import Service, reply_subject

CLIENT_HEADERS = (
    H.REQUEST_ID,
    H.CLIENT_REQUEST_ID,  # a migration's label (checked as a label: Ingress.envelope)
    H.DEADLINE,
    H.T0,
    H.API_KEY,
    H.SESSION,
    H.TRACEPARENT,
    H.TRACE_LINK,
    H.MIGRATION,
    H.RESUME,
    H.KEEPALIVE,
    H.WHOLE,
    H.ADMISSION,
    H.PRIORITY,
    H.FAIRNESS,
    H.TTFT_OBJECTIVE,
)
# OpenAI's service tiers as classes (engine_worker/flow.py): ``auto`` is the key's default;
# ``scale`` (OpenAI's reserved capacity), ``fast`` and ``ultrafast`` are served as ``priority``.
SERVICE_TIERS = {
    "auto": "",
    "default": "default",
    "flex": "flex",
    "priority": "priority",
    "scale": "priority",
    "fast": "priority",
    "ultrafast": "priority",
}
MAX_REQUEST_ID = 128


def service_tier(body: dict[str, Any], hdrs: dict[str, str]) -> None:
    """The class the request asks for, from its ``service_tier`` (or, when the body has
    none, the client's header), as the ``Tb-Priority`` header auth settles; 400 for a tier
    OpenAI does not define."""
    asked = hdrs.pop(H.PRIORITY, "")
    tier = body.get("service_tier")
    param = "service_tier"
    if tier is None:
        tier = asked or None
        param = "X-Tokenbus-Service-Tier"
    if tier is None:
        return
    if not isinstance(tier, str) or tier not in SERVICE_TIERS:
        raise E.InvalidRequest(
            f"{param}: {tier!r} is not a service tier (one of auto, default, flex, priority)",
            param=param if param == "service_tier" else None,
        )
    if SERVICE_TIERS[tier]:
        hdrs[H.PRIORITY] = SERVICE_TIERS[tier]


class Admission:
    """Ingress' work on one request: validate, build the envelope and the stage headers.

    Used by the ingress service for NATS clients and in-process by the HTTP bridge, which
    has parsed the request already and so skips a hop.
    """

    def __init__(self, settings: Settings) -> None:
        cfg = settings.ingress
        pipeline = list(cfg.pipeline)
        if not pipeline or pipeline[-1] != subjects.STAGE_ROUTE:
            pipeline = [s for s in pipeline if s != subjects.STAGE_ROUTE] + [subjects.STAGE_ROUTE]
        self.first = subjects.stage(pipeline[0])
        self.has_auth = subjects.STAGE_AUTH in pipeline
        self.rest = ",".join(pipeline[1:])
        self.default_max_tokens = cfg.default_max_tokens
        self.max_prompt_chars = cfg.max_prompt_chars
        self.max_request_ms = int(cfg.max_request_s * 1000)

    def admit(
        self,
        kind: str,
        req: validation.Request,
        body: dict[str, Any],
        hdrs: dict[str, str],
        t1: int,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """The envelope for ``req``; fills ``hdrs`` (request id, model, route, marks).

        The request id is the gateway's own: ``request_id`` where the bridge made it, a new
        one otherwise. What the client sent as its id travels as a label only
        (``Tb-Client-Request-Id``)."""
        if validation.prompt_chars(req) > self.max_prompt_chars:
            raise E.PayloadTooLarge(f"the prompt is longer than {self.max_prompt_chars} characters")
        if not self.has_auth:
            hdrs.pop(H.API_KEY, None)  # nobody checks it: it must not travel on
        given = hdrs.pop(H.REQUEST_ID, None)
        # A migration names the gateway's id and carries its client's label as it was (the
        # records of every attempt are under it); else the id the client gave is the label.
        label = client_label(hdrs.pop(H.CLIENT_REQUEST_ID, None))
        if label is None and given != request_id:
            label = client_label(given)
        if label:
            hdrs[H.CLIENT_REQUEST_ID] = label
        rid = request_id or marks.new_request_id()
        hdrs[H.REQUEST_ID] = rid
        # Bounded in time whatever the client asked: every stage and the worker read this.
        cap = marks.now_ms() + self.max_request_ms
        asked = marks.deadline_ms(hdrs)
        if asked is None or asked > cap:
            hdrs[H.DEADLINE] = str(cap)
        env = validation.envelope(
            kind,
            req,
            body,
            rid,
            default_max_tokens=self.default_max_tokens,
            deadline_ms=marks.deadline_ms(hdrs),
        )
        hdrs[H.MODEL] = req.model
        hdrs[H.KIND] = kind
        service_tier(body, hdrs)
        if self.rest:
            hdrs[H.ROUTE] = self.rest
        else:
            hdrs.pop(H.ROUTE, None)
        marks.append(hdrs, "ingress", t1)
        return env


def keep_claim(env: dict[str, Any], body: dict[str, Any], claim: dict[str, Any]) -> None:
    """Carry the client's claim on ``env`` when the envelope's claimed parts are the object's
    as sent (chat messages, a completion's one string prompt); 400 otherwise. Its text's
    characters are counted here, from what was fetched: the client's count is not trusted."""
    for k in CLAIMED:
        if (k in env or k in body) and env.get(k) != body.get(k):
            raise E.InvalidRequest(
                f"{k}: a request sent by claim check must carry it as the envelope does (one "
                "prompt string, the messages as a list); send it so",
                param=k,
            )
    env[CLAIM] = {**claim, "chars": envelope_chars(env)}


class Ingress(Service):
    """Validates requests and forwards them to the first pipeline stage."""

    name = subjects.STAGE_INGRESS
    trust_reply_header = False

    async def setup(self) -> None:
        self.admission = Admission(self.settings)
        try:  # the store of large request bodies; without JetStream they get 503
            await bodies.open_stream(self.nc)
        except Exception as exc:
            self.log.warning("bodies_store_unavailable", error=repr(exc))
        ingress = self.add_group(queue_group=subjects.QUEUE_INGRESS)
        await ingress.add(
            "requests", self.handle, subject=subjects.requests_wildcard(), member=True
        )
        # NATS clients' files and batches (docs/batches.md).
        # Background responses ride the same subjects (response_<action>).
        background = BackgroundState(self.nc, self.settings, validation.check_chat)
        self.batches = BatchState(
            self.nc, self.settings, dict.fromkeys(BackgroundState.ACTIONS, background.handle)
        )
        await ingress.add("batches", self.batches.handle, subject=subjects.batches_state_wildcard())
        # NATS clients' stored Responses API responses (docs/responses.md).
        self.responses = await ResponsesState(self.nc, self.settings).open()
        await ingress.add(
            "responses", self.responses.handle, subject=subjects.responses_state_wildcard()
        )

    async def on_stop(self) -> None:
        responses = getattr(self, "responses", None)
        if responses is not None:
            await responses.close()
        batches = getattr(self, "batches", None)
        if batches is not None:
            await batches.close()
        await super().on_stop()

    async def _claimed(self, body: Any, reply: str) -> dict[str, Any] | None:
        """A NATS client's claim-checked body made whole (services/bodies.py): the claim,
        taken off ``body``, or None. Hostile input: a claim may name only an object of the
        sender's own (its reply inbox's owner; on the locked bus NATS lets a key write only
        under its own), and what is fetched must match the claim's size and digest."""
        if not isinstance(body, dict) or CLAIM not in body:
            return None
        claim = bodies.check_claim(body.pop(CLAIM))
        if claim["owner"] != subjects.body_owner(reply):
            raise E.InvalidRequest("claim.owner: a request may name only its own body objects")
        if any(k in body for k in CLAIMED):
            raise E.InvalidRequest("claim: a claim-checked body carries its messages in the object")
        body.update(await bodies.fetch(self.nc, claim))
        return claim

    async def handle(self, msg: Msg) -> None:
        reply = reply_subject(msg, trust_header=False, service=self.name, log=self.log)
        if not reply:  # none, or not the sender's own inbox (counted, logged once): dropped
            if not msg.reply:
                self.log.warning("request_without_reply_subject", subject=msg.subject)
            return
        t1 = marks.now_ns()
        kind = msg.subject.rpartition(".")[2]
        if kind not in subjects.KINDS:
            raise E.NotFound(f"unknown request kind {kind!r}")
        body = codec.decode(msg.data)
        claim = await self._claimed(body, reply)
        req = validation.parse(kind, body)
        # Only what a client may say travels on; stage headers are the stages' own.
        given = msg.headers or {}
        hdrs = {h: given[h] for h in CLIENT_HEADERS if h in given}
        # A new request gets an id of ours; a migration keeps the one it was given (proved,
        # or replaced, by its ticket in the ratelimit stage), so its records stay one row.
        again = marks.attempt(hdrs.get(H.MIGRATION)) > 0
        rid = marks.our_request_id(hdrs.get(H.REQUEST_ID)) if again else None
        env = self.admission.admit(kind, req, body, hdrs, t1, request_id=rid)
        if claim is not None:
            keep_claim(env, body, claim)
        if tracing.on():
            tracing.set_attributes(
                tracing.current(),
                {tracing.MODEL: req.model, tracing.REQUEST_ID: hdrs[H.REQUEST_ID]},
            )
        await self.forward(self.admission.first, bodies.encode(env), hdrs, reply)
