"""The audit trail: who changed API keys and routing, and when, kept in a JetStream stream.

Every key created, updated or revoked and every routing or alias change made through the bridge's
admin API or the ``tokenbus`` CLI is one event (JSON, like the values of the KV buckets)
published with the JetStream acknowledgement to ``tb.v1.audit.<action>`` and kept in the
stream ``TOKENBUS_AUDIT``: ``ts`` (ISO 8601, UTC) and ``ts_unix``, ``action``
(``key.created``...), ``target`` (a key id, a model), ``actor`` (``key:<admin key id>`` over
HTTP, ``cli:<os user>@<host>`` from the CLI), ``details`` (the fields set, the previous
values, the routing) and the ``request_id`` where there is one. Never a key's secret: only
key ids; a string shaped like a key is redacted before publishing, whatever the caller
passed.

A change is refused when its event cannot be written (a trail with holes is worse than an
operation to retry): :func:`change` makes the stream ready before the change (creating it
if missing) and records the event after it. Should the event fail after the change was
made, the error says so (a new key is deleted again instead: nobody has seen it). Every
failure is logged at warning.

The stream refuses message deletes and purges to everyone (``deny_delete``,
``deny_purge``: the server will not lift them) and keeps events for a year or 64 MiB,
whichever comes first (then the oldest go). On the locked bus only the admin role may
delete it or change its limits (:mod:`services.natsconf`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NoStreamResponseError, NotFoundError
from pydantic import BaseModel, Field, ValidationError

from bus_schemas import errors as E
from bus_schemas import subjects
from services import buckets
from services import logging as tlog
from services.config import kv_replicas

STREAM = "TOKENBUS_AUDIT"
MAX_AGE_S = 365 * 86400.0
MAX_BYTES = 64 * 1024 * 1024
# Copies: TOKENBUS_KV_REPLICAS, like the KV buckets (tokenbus_keys, tokenbus_routing); 3 on a
# 3-node cluster. A stream made before that is raised with `nats stream edit --replicas`.
TIMEOUT_S = 5.0

KEY_CREATED = "key.created"
KEY_UPDATED = "key.updated"
KEY_REVOKED = "key.revoked"
KEY_ROTATED = "key.rotated"
ROUTING_CHANGED = "routing.changed"
ALIAS_CHANGED = "alias.changed"
ADAPTER_LOADED = "adapter.loaded"  # a LoRA adapter loaded at run time (router.adapters)
ADAPTER_UNLOADED = "adapter.unloaded"
BUDGET_CHANGED = "budget.changed"  # an owner's spend budget (auth.budgets)

# A tokenbus API key (auth.keys' shape; the kit cannot import the auth actor).
_SECRET = re.compile(r"tb-([0-9a-f]{12})_[A-Za-z0-9_\-]{43}")

log = tlog.get("audit")


class AuditUnavailable(E.ServiceUnavailable):
    """The audit trail cannot be written, so the change was refused (nothing was changed)."""


class AuditIncomplete(E.InternalError):
    """The change was made, but its audit event could not be written."""

    reason = ""  # why the event was not written


class AuditEvent(BaseModel):
    """One entry of the audit trail."""

    id: str = Field(description="Unique event id (also the stream's de-duplication id).")
    ts: str = Field(description="When, ISO 8601 in UTC.")
    ts_unix: float = Field(description="When, Unix time.")
    action: str = Field(
        description="key.created, key.updated, key.revoked, routing.changed, alias.changed, "
        "budget.changed, adapter.loaded, adapter.unloaded."
    )
    target: str = Field(description="What changed: a key id, a model, an alias.")
    actor: str = Field(description="Who: key:<admin key id> (HTTP) or cli:<user>@<host>.")
    details: dict[str, Any] = Field(default_factory=dict, description="What changed, how.")
    request_id: str | None = Field(default=None, description="The HTTP request's id.")
    seq: int | None = Field(default=None, description="Stream sequence (set when read).")

    @classmethod
    def new(
        cls,
        action: str,
        target: str,
        actor: str,
        details: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AuditEvent:
        now = time.time()
        return cls(
            id=uuid.uuid4().hex,
            ts=_iso(now),
            ts_unix=now,
            action=action,
            target=target,
            actor=actor,
            details=details or {},
            request_id=request_id,
        )


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="milliseconds")


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def scrub(text: str) -> str:
    """``text`` with every API key's secret replaced (the id stays)."""
    return _SECRET.sub(r"tb-\1_[REDACTED]", text)


def key_actor(key_id: str) -> str:
    """The actor of a change made over HTTP with the admin key ``key_id``."""
    return f"key:{key_id}"


def cli_actor() -> str:
    """The actor of a change made from the CLI: ``cli:<os user>@<host>``."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no name for this uid (a bare container)
        user = f"uid{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


def stream_config() -> StreamConfig:
    return StreamConfig(
        name=STREAM,
        description="tokenbus audit trail: key and routing changes",
        subjects=[subjects.audit_wildcard()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=MAX_AGE_S,
        max_bytes=MAX_BYTES,
        discard=DiscardPolicy.OLD,
        num_replicas=kv_replicas(),
        duplicate_window=120.0,
        deny_delete=True,
        deny_purge=True,
    )


async def ensure_stream(nc: NATS) -> None:
    """The audit stream, created if missing; :class:`AuditUnavailable` when it cannot be
    reached or is not the trail's (wrong subjects, or deletes allowed)."""
    js = nc.jetstream(timeout=TIMEOUT_S)

    async def created(_info: Any) -> None:
        log.info("audit_stream_created", stream=STREAM)

    try:
        # A trail that does not answer is said at once (stall_s=0): nothing is changed.
        info = await buckets.open_stream(js, stream_config(), on_create=created, stall_s=0)
    except Exception as exc:
        log.warning("audit_unavailable", stream=STREAM, error=_why(exc))
        raise AuditUnavailable(
            f"the audit trail (JetStream stream {STREAM}) cannot be reached, so nothing was "
            f"changed; retry: {_why(exc)}"
        ) from None
    cfg = info.config
    if cfg.subjects != [subjects.audit_wildcard()] or not (cfg.deny_delete and cfg.deny_purge):
        log.warning("audit_stream_misconfigured", stream=STREAM, subjects=cfg.subjects)
        raise AuditUnavailable(
            f"the JetStream stream {STREAM} is not the audit trail tokenbus creates (it needs "
            f"subjects [{subjects.audit_wildcard()}] and deny_delete, deny_purge); nothing was "
            "changed. An operator must fix or remove it."
        )


async def record(
    nc: NATS,
    action: str,
    target: str,
    actor: str,
    details: dict[str, Any] | None = None,
    *,
    request_id: str | None = None,
) -> AuditEvent:
    """Publish one event and wait for the stream's acknowledgement (the stream is created
    if missing); :class:`AuditUnavailable` when it is not stored."""
    ev = AuditEvent.new(action, target, actor, details, request_id)
    data = scrub(ev.model_dump_json(exclude={"seq"})).encode()
    js = nc.jetstream(timeout=TIMEOUT_S)
    subject = subjects.audit(action)
    try:
        try:
            # Through a stalled stream leader too: the message id makes a repeat a no-op.
            ack = await buckets.through_stall(
                lambda: js.publish(subject, data, stream=STREAM, headers={"Nats-Msg-Id": ev.id}),
                what=f"audit {action}",
            )
        except NoStreamResponseError:
            await ensure_stream(nc)
            ack = await js.publish(subject, data, stream=STREAM, headers={"Nats-Msg-Id": ev.id})
    except AuditUnavailable:
        raise
    except Exception as exc:
        log.warning("audit_write_failed", action=action, target=target, error=_why(exc))
        raise AuditUnavailable(
            f"the audit event {action} {target} could not be written to the JetStream "
            f"stream {STREAM}: {_why(exc)}"
        ) from None
    ev.seq = ack.seq
    return ev


class Change:
    """What an audited change fills in while it runs: its target and details."""

    def __init__(self, action: str, target: str) -> None:
        self.action = action
        self.target = target
        self.details: dict[str, Any] = {}
        self.event: AuditEvent | None = None


@contextlib.asynccontextmanager
async def change(
    nc: NATS, action: str, target: str, actor: str | None, *, request_id: str | None = None
) -> AsyncIterator[Change]:
    """Around one administrative change by ``actor``: the stream is made ready first (when
    it cannot be, :class:`AuditUnavailable` and the change is not made), the block makes the
    change and fills in the :class:`Change`, then the event is recorded (when that fails,
    :class:`AuditIncomplete`: the change stands). A block that raises records nothing.
    ``actor`` None records nothing (internal callers, tests)."""
    c = Change(action, target)
    if actor is None:
        yield c
        return
    await ensure_stream(nc)
    yield c
    try:
        c.event = await record(nc, c.action, c.target, actor, c.details, request_id=request_id)
    except AuditUnavailable as exc:
        log.warning("audit_incomplete", action=c.action, target=c.target, actor=actor)
        err = AuditIncomplete(
            f"{c.action} {c.target} was done, but its audit event is missing: {exc.message}"
        )
        err.reason = exc.message
        raise err from None


async def read(nc: NATS, since: float | None = None, limit: int | None = 100) -> list[AuditEvent]:
    """Events oldest first: those stored at or after ``since`` (Unix time) when given, the
    newest ``limit`` of them when given. No stream yet: none."""
    js = nc.jetstream(timeout=TIMEOUT_S)
    try:
        info = await js.stream_info(STREAM)
    except NotFoundError:
        return []
    if not info.state.messages or limit == 0:
        return []
    name = f"audit-read-{uuid.uuid4().hex[:12]}"
    cfg = ConsumerConfig(
        name=name,
        filter_subject=subjects.audit_wildcard(),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    if since is not None:
        cfg.deliver_policy = DeliverPolicy.BY_START_TIME
        cfg.opt_start_time = dt.datetime.fromtimestamp(since, dt.UTC)
    elif limit is not None:
        cfg.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        cfg.opt_start_seq = max(info.state.first_seq, info.state.last_seq - limit + 1)
    left = (await js.add_consumer(STREAM, config=cfg)).num_pending or 0
    out: deque[AuditEvent] = deque(maxlen=limit)

    def keep(msgs: list[Msg]) -> None:
        for m in msgs:
            out.append(_event(m.data, m.metadata.sequence.stream, m.metadata.timestamp))

    await buckets.read_consumer(js, STREAM, name, left, keep, timeout=TIMEOUT_S)
    return list(out)


def _event(data: bytes, seq: int, stored: dt.datetime) -> AuditEvent:
    """An event from the stream; one that does not parse is shown, not hidden."""
    try:
        ev = AuditEvent.model_validate_json(data)
    except ValidationError:
        unix = stored.timestamp()
        ev = AuditEvent(
            id="",
            ts=_iso(unix),
            ts_unix=unix,
            action="unreadable",
            target="",
            actor="",
            details={"raw": scrub(data[:2000].decode(errors="replace"))},
        )
    ev.seq = seq
    return ev
