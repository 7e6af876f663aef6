"""Where a service may answer: the requester's own inbox, nothing else (issue 64).

nats-server does not check the reply subject a client sets on a message, and a service
answers with its own rights. Before this check, a tenant's connection published a malformed
request with the reply subject ``$KV.tokenbus_keys.<another key's id>`` and ingress wrote its
error frame there, over that key's record; ``$KV.tokenbus_secrets.admission`` replaced the
admission tickets' signing secret. So every reply subject a service publishes to passes
:func:`allowed`:

- an inbox: under ``_INBOX.`` (where NATS clients and every tokenbus process take replies),
  never a stream's, a bucket's, an object store's or the API's subjects (``$KV.``, ``$JS.``,
  ``$O.``, ``$SYS.``, ``tb.v1.``), of an inbox's length and without wildcards;
- under a key's inbox root (``_INBOX.tbk.<key id>.``, the only place the locked bus lets a
  connection logged in with that key subscribe) only for a request of that key: the key id
  auth verified (``Tb-Principal``) once it has, else the id inside the key the request
  carries (``Tb-Api-Key``). A request of key A never has an answer written into key B's
  inboxes.

Anything else is dropped: never answered, counted (``tokenbus_bad_reply_total{service}``)
and logged once per sender and service.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from prometheus_client import Counter

from bus_schemas import headers as H
from bus_schemas import subjects

# What a reply subject may be: tokens without whitespace or wildcards, of an inbox's length
# (a subject past the server's 4 KiB command line would close the connection).
_REPLY = re.compile(r"[^\s.*>]+(?:\.[^\s.*>]+)*")
MAX_REPLY_LEN = 512
INBOX_ROOT = "_INBOX."
KEY_INBOX_ROOT = subjects.key_inbox_root("x")[: -len("x")]  # "_INBOX.tbk."

BAD_REPLY = Counter(
    "tokenbus_bad_reply_total",
    "Requests whose reply subject was not the requester's own inbox: dropped, never answered",
    ["service"],
)
_said: set[tuple[str, str]] = set()
_SAID_KEPT = 10_000


def allowed(reply: str, headers: Mapping[str, str] | None) -> bool:
    """Whether a service may publish an answer to ``reply`` for a request with ``headers``."""
    if len(reply) > MAX_REPLY_LEN or not reply.startswith(INBOX_ROOT):
        return False
    if not _REPLY.fullmatch(reply):
        return False
    if not reply.startswith(KEY_INBOX_ROOT):
        return True
    owner = reply[len(KEY_INBOX_ROOT) :].partition(".")[0]
    hdrs = headers or {}
    key_id = hdrs.get(H.PRINCIPAL) or subjects.api_key_id(hdrs.get(H.API_KEY) or "")
    return key_id is not None and key_id != "" and owner == subjects.token(key_id)


def refused(service: str, reply: str, headers: Mapping[str, str] | None, log: object) -> None:
    """Count a dropped reply subject, and log it once per sender and service."""
    BAD_REPLY.labels(service).inc()
    hdrs = headers or {}
    sender = hdrs.get(H.PRINCIPAL) or subjects.api_key_id(hdrs.get(H.API_KEY) or "") or "anonymous"
    if (service, sender) in _said:
        return
    if len(_said) >= _SAID_KEPT:
        _said.clear()
    _said.add((service, sender))
    warn = getattr(log, "warning", None)
    if warn is not None:
        warn(
            "reply_subject_refused",
            service=service,
            sender=sender,
            reply=reply[:64],
            hint="a request may be answered only in its sender's own inbox; it was dropped",
        )
