"""Every NATS subject, queue group and inbox prefix tokenbus uses, built in one place.

No other module writes a ``tb.`` subject literal; they call these functions.
"""

from __future__ import annotations

import re

PREFIX = "tb.v1"

# Stage names double as queue group names and as entries of the routing slip.
STAGE_INGRESS = "ingress"
STAGE_AUTH = "auth"
STAGE_RATELIMIT = "ratelimit"
STAGE_FILTER = "filter"
STAGE_ROUTE = "route"
STAGES = (STAGE_AUTH, STAGE_RATELIMIT, STAGE_FILTER, STAGE_ROUTE)

QUEUE_INGRESS = "ingress"
QUEUE_TELEMETRY = "telemetry"

KIND_CHAT = "chat"
KIND_COMPLETIONS = "completions"
KIND_EMBEDDINGS = "embeddings"
KINDS = (KIND_CHAT, KIND_COMPLETIONS, KIND_EMBEDDINGS)

_SAFE = re.compile(r"[A-Za-z0-9_\-]")


def token(name: str) -> str:
    """Escape an arbitrary name (a model id such as ``org/model-7b.v2``) into one subject token.

    Characters other than letters, digits, ``_`` and ``-`` become ``~XX`` (hex), so the
    mapping is reversible and two different names never share a token.
    """
    if not name:
        raise ValueError("subject token must not be empty")
    return "".join(c if _SAFE.match(c) else "".join(f"~{b:02X}" for b in c.encode()) for c in name)


def untoken(tok: str) -> str:
    """Reverse :func:`token`; ValueError for a token :func:`token` never makes."""
    out = bytearray()
    i = 0
    while i < len(tok):
        if tok[i] == "~":
            pair = tok[i + 1 : i + 3]
            if len(pair) != 2:
                raise ValueError(f"subject token {tok!r}: '~' takes two hex digits")
            out.append(int(pair, 16))
            i += 3
        else:
            out.extend(tok[i].encode())
            i += 1
    return out.decode()


def request(kind: str) -> str:
    """Where clients publish requests (ingress listens here)."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}")
    return f"{PREFIX}.req.{kind}"


def request_prefix() -> str:
    """What every request subject (:func:`request`) starts with."""
    return f"{PREFIX}.req."


def requests_wildcard() -> str:
    """Every request subject, for the ingress subscription."""
    return f"{PREFIX}.req.*"


# What a NATS client may do with its stored Responses API responses (ingress answers).
RESPONSES_GET = "get"
RESPONSES_PUT = "put"
RESPONSES_DELETE = "delete"
RESPONSES_ACTIONS = (RESPONSES_GET, RESPONSES_PUT, RESPONSES_DELETE)


def responses_state(action: str) -> str:
    """Where a NATS client reads, keeps or deletes a stored response (request-reply)."""
    if action not in RESPONSES_ACTIONS:
        raise ValueError(f"unknown responses action {action!r}")
    return f"{PREFIX}.req.responses.{action}"


def responses_state_wildcard() -> str:
    """Every stored-response action, for the ingress subscription (requests_wildcard's
    one token does not reach these)."""
    return f"{PREFIX}.req.responses.*"


# What a NATS client may do with files and batches (ingress answers; docs/batches.md).
BATCH_ACTIONS = (
    "file_create",
    "file_get",
    "file_content",
    "file_delete",
    "file_list",
    "create",
    "get",
    "list",
    "cancel",
    # Background responses (jobs/background.py).
    "response_create",
    "response_cancel",
    "response_events",
)


def batches_state(action: str) -> str:
    """Where a NATS client uploads files and makes, reads or cancels batches
    (request-reply)."""
    if action not in BATCH_ACTIONS:
        raise ValueError(f"unknown batches action {action!r}")
    return f"{PREFIX}.req.batches.{action}"


def batches_state_wildcard() -> str:
    return f"{PREFIX}.req.batches.*"


def stage(name: str) -> str:
    """The subject a pipeline stage (auth, ratelimit, filter, route) listens on."""
    return f"{PREFIX}.stage.{name}"


# Members of a queue group (ingress, and each stage: its name) beat on their own subject,
# and each also listens on a subject of its own (``tb.v1.to.<member>.<subject>``): a
# request can then be sent past a member that stopped beating (paused, cut off), which
# the queue group would still pick at random until the server drops it (services/members.py).
MEMBER_GROUPS = (QUEUE_INGRESS, *STAGES)


def members(group: str) -> str:
    """Where the members of queue group ``group`` beat."""
    return f"{PREFIX}.members.{token(group)}"


def members_wildcard() -> str:
    return f"{PREFIX}.members.*"


def member_group(subject: str) -> str | None:
    """The queue group whose members take ``subject`` (a request or stage subject), or None
    for any other subject."""
    parts = subject.split(".")
    if len(parts) == 4 and subject.startswith(f"{PREFIX}."):
        if parts[2] == "req" and parts[3] in KINDS:
            return QUEUE_INGRESS
        if parts[2] == "stage" and parts[3] in STAGES:
            return parts[3]
    return None


def to_member(member: str, subject: str) -> str:
    """``subject`` (a request or stage subject, or a wildcard of them) addressed to one
    member of its queue group only; the last token stays the kind or stage name."""
    return f"{PREFIX}.to.{token(member)}.{subject[len(PREFIX) + 1 :]}"


def to_any_member(subject: str) -> str:
    """Every member's own subject for ``subject`` (permissions)."""
    return f"{PREFIX}.to.*.{subject[len(PREFIX) + 1 :]}"


def engine_generate(model: str, replica: str) -> str:
    """One replica's generate subject (no queue group: the router picks the replica)."""
    return f"{PREFIX}.engine.{token(model)}.{token(replica)}.generate"


def engine_body(replica: str, object_id: str) -> str:
    """Where a caller sends the chunks of a request body to the replica that asked for it (a
    claim by pull, services/bodies.py), ``.<n>`` after it per chunk. Under the replica's own
    engine subjects: a GPU host's login hears its replicas' bodies only. ``~body`` is no model
    token (``token`` writes ``~`` only before two hex digits)."""
    return f"{PREFIX}.engine.~body.{token(replica)}.{object_id}"


def worker_cancel(replica: str) -> str:
    """Where a caller asks a replica to abort a request."""
    return f"{PREFIX}.worker.{token(replica)}.cancel"


def replica_claim(replica: str) -> str:
    """Where the processes started with one replica id say who they are: the oldest keeps
    it, the others refuse to serve (engine_worker/claim.py)."""
    return f"{PREFIX}.replica.{token(replica)}.claim"


def heartbeat(model: str, replica: str) -> str:
    """Where a replica announces itself and its load."""
    return f"{PREFIX}.heartbeat.{token(model)}.{token(replica)}"


def heartbeat_wildcard() -> str:
    """Every replica's heartbeats (routers, bridges, ``tokenbus status``)."""
    return f"{PREFIX}.heartbeat.*.*"


def batch_work(batch_id: str, what: str) -> str:
    """A unit of batch work in the JetStream work queue (docs/batches.md): ``validate`` a
    new batch, or run one of its lines (``line``)."""
    return f"{PREFIX}.batch.work.{token(batch_id)}.{what}"


def batch_work_wildcard(batch_id: str | None = None) -> str:
    return f"{PREFIX}.batch.work.{token(batch_id) if batch_id else '*'}.>"


def batch_events(response_id: str) -> str:
    """A background response's streaming events, kept in JetStream to be read again from any
    sequence number (docs/batches.md)."""
    return f"{PREFIX}.batch.events.{token(response_id)}"


def batch_cancel(response_id: str) -> str:
    """Where a background response's cancellation reaches the runner running it."""
    return f"{PREFIX}.batch.cancel.{token(response_id)}"


def batch_done(owner: str) -> str:
    """Where a finished batch (completed, failed, expired, cancelled) is announced, per
    owner (an API key id; ``_`` for an open deployment), for NATS clients to wait on."""
    return f"{PREFIX}.batch.done.{token(owner or '_')}"


def kv_events(model: str, replica: str) -> str:
    """Where a replica publishes its prefix cache's events, in batches
    (:mod:`bus_schemas.kv_events`)."""
    return f"{PREFIX}.kv.{token(model)}.{token(replica)}"


def kv_events_wildcard(model: str | None = None) -> str:
    """Every replica's KV events (routers, bridges), or those of ``model``'s replicas."""
    return f"{PREFIX}.kv.{token(model) if model else '*'}.*"


def kv_snapshot(model: str, replica: str) -> str:
    """Where a replica answers requests for a snapshot of its prefix cache. Beside its
    generate subject: only who may dispatch to a replica (router, bridge) may ask it."""
    return f"{PREFIX}.engine.{token(model)}.{token(replica)}.kv_snapshot"


def worker_adapters(model: str, replica: str) -> str:
    """Where a replica loads, unloads and lists LoRA adapters at run time (docs/adapters.md).
    Beside its generate subject: only who may dispatch to a replica (router, bridge, admin)
    may change what it serves."""
    return f"{PREFIX}.engine.{token(model)}.{token(replica)}.adapters"


# What routers and bridges hold per model and class (``telemetry(TELEMETRY_QUEUE)``).
TELEMETRY_QUEUE = "queue"
# A spend budget's soft threshold crossed (``telemetry(TELEMETRY_BUDGET)``: auth.budgets).
TELEMETRY_BUDGET = "budget"


def telemetry(kind: str) -> str:
    """Telemetry events (fire and forget)."""
    return f"{PREFIX}.telemetry.{kind}"


def telemetry_wildcard() -> str:
    return f"{PREFIX}.telemetry.>"


def usage(owner: str | None = None) -> str:
    """Where a worker reports what a finished request really used (rate-limit
    reconciliation): to the limiter instance ``owner`` that admitted it."""
    return f"{PREFIX}.usage" if owner is None else f"{PREFIX}.usage.{token(owner)}"


def usage_spend(owner: str | None = None) -> str:
    """A usage report that settles spend (the request held some): to the limiter ``owner``
    as :func:`usage`, and kept in :data:`SPEND_STREAM` until a limiter has settled it."""
    return f"{usage(owner)}.spend" if owner else f"{PREFIX}.usage.spend"


def usage_spend_wildcard() -> str:
    return f"{PREFIX}.usage.*.spend"


def is_usage_spend(subject: str) -> bool:
    """Whether ``subject`` is one :data:`SPEND_STREAM` keeps (``usage_spend(<owner>)``)."""
    parts, n = subject.split("."), PREFIX.count(".") + 1
    return len(parts) == n + 3 and parts[n] == "usage" and parts[-1] == "spend"


# Usage reports that settle spend, kept until settled: a limiter that dies holding requests
# leaves their reports to the others (auth.ratelimit).
SPEND_STREAM = "TOKENBUS_SPEND_REPORTS"
SPEND_CONSUMER = "spend"


def audit(action: str) -> str:
    """Where one audit event of ``action`` (``key.created``, ``routing.changed``...) is
    published; each dotted part becomes one subject token."""
    return f"{PREFIX}.audit." + ".".join(token(part) for part in action.split("."))


def audit_wildcard() -> str:
    """Every audit event: the subjects of the audit stream."""
    return f"{PREFIX}.audit.>"


def admin(service: str, action: str) -> str:
    """Administrative calls handled by one service."""
    return f"{PREFIX}.admin.{service}.{action}"


# The last token of a batch message under a client's inbox prefix. Stream tokens are hex
# ids, so this one can never name a stream.
INBOX_BATCH_TOKEN = "_batch"


def inbox_batch(prefix: str) -> str:
    """Where a worker sends several frames for several streams of one client in one message."""
    return f"{prefix}.{INBOX_BATCH_TOKEN}"


def split_inbox(reply: str) -> tuple[str, str] | None:
    """(prefix, stream token) of a tokenbus client inbox, or None for any other subject."""
    if not reply.startswith("_INBOX.tb."):
        return None
    prefix, _, tok = reply.rpartition(".")
    return prefix, tok


def inbox_prefix(owner: str) -> str:
    """A per-process inbox prefix; replies for every request of that process land under it."""
    return f"_INBOX.tb.{token(owner)}"


# The JetStream stream that keeps usage records until a telemetry service stored them, and
# the durable consumer all telemetry services share (telemetry.records).
RECORDS_STREAM = "TOKENBUS_USAGE"
RECORDS_CONSUMER = QUEUE_TELEMETRY


def records_ack_root() -> str:
    """Where the stream's acks of usage records come back to their publishers (workers,
    bridges: telemetry.records.Recorder)."""
    return "_INBOX.tb.records"


_API_KEY_ID = re.compile(r"tb-([0-9a-f]{12})_")


def api_key_id(key: str) -> str | None:
    """The id at the head of an API key (``tb-<id>_<secret>``), or None: what the key claims
    to be, not yet checked (auth.keys checks the whole key)."""
    m = _API_KEY_ID.match(key.strip())
    return m.group(1) if m else None


def key_inbox_root(key_id: str) -> str:
    """Where the inboxes of every NATS connection logged in with API key ``key_id`` live: on
    the locked bus such a connection may subscribe under it and nowhere else."""
    return f"_INBOX.tbk.{token(key_id)}"


# Claim checks (services/bodies.py): a request too large for one bus message keeps its large
# parts as chunks in this JetStream stream, under its caller's owner (the two tokens of the
# caller's inbox root after ``_INBOX``: ``tb.<process>`` or ``tbk.<key id>``), so that a
# key's connection may be allowed to write its own bodies and nobody else's.
BODIES_STREAM = "TOKENBUS_BODIES"


def bodies_wildcard() -> str:
    """Every chunk of every claim-checked request body."""
    return f"{PREFIX}.body.>"


def body_owner(inbox: str) -> str | None:
    """The body owner of a caller's inbox (prefix or reply subject), or None if not one."""
    parts = inbox.split(".")
    if len(parts) < 3 or parts[0] != "_INBOX" or parts[1] not in ("tb", "tbk"):
        return None
    return f"{parts[1]}.{parts[2]}"


def key_bodies(key_id: str) -> str:
    """The chunks API key ``key_id``'s connections may write (and nothing else)."""
    return f"{PREFIX}.body.tbk.{token(key_id)}.>"


def body_chunk(owner: str, object_id: str, n: int) -> str:
    """Chunk ``n`` of body object ``object_id`` of ``owner``."""
    return f"{PREFIX}.body.{owner}.{object_id}.{n}"


def body_object(owner: str, object_id: str) -> str:
    """Every chunk of one body object (what a purge names)."""
    return f"{PREFIX}.body.{owner}.{object_id}.>"


# The last token of a body object's end marker (:func:`body_done`).
BODY_DONE = "done"
_KEY_BODIES_HEAD = f"{PREFIX}.body.tbk."


def body_done(owner: str, object_id: str) -> str:
    """A body object's end (its caller's stream ended): a key's connection, which may not
    delete, writes this empty message under its own owner, and the auth service's janitor
    (auth/bodyquota.py) removes the object for it."""
    return f"{PREFIX}.body.{owner}.{object_id}.{BODY_DONE}"


def key_body_owner(key_id: str) -> str:
    """The body owner of API key ``key_id``'s connections (its inbox root's two tokens)."""
    return f"tbk.{token(key_id)}"


def body_subject_parts(subject: str) -> tuple[str, str, str] | None:
    """(owner, object id, rest) of a subject in the bodies stream under a key's owner
    (``tb.v1.body.tbk.<key id>.<object>.<rest>``), or None for any other subject."""
    if not subject.startswith(_KEY_BODIES_HEAD):
        return None
    parts = subject[len(_KEY_BODIES_HEAD) :].split(".", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        return None
    return f"tbk.{parts[0]}", parts[1], parts[2] if len(parts) > 2 else ""


def body_quota_notice(key_id: str) -> str:
    """Where the janitor says it removed key ``key_id``'s bodies for its quota (a reader that
    finds an object missing tells the caller why); not under the key's owner, so that the
    key cannot write it and a purge of the key's bodies keeps it."""
    return f"{PREFIX}.body.quota.{token(key_id)}"


def body_quota_notices() -> str:
    """Every key's quota notice (what the auth role may publish in the bodies stream)."""
    return f"{PREFIX}.body.quota.>"


def bodies_reply_root() -> str:
    """Where a worker's reads of body objects are answered (its connection's inbox root: the
    locked bus lets workers subscribe there and to no other inbox)."""
    return "_INBOX.tb.bodies"
