"""The listing of background responses: a small index entry per background response, in
the KV bucket ``tokenbus_background``, so the console lists them without reading every
stored response (a stored record holds the whole conversation).

An entry is keyed ``<owner>.<response id>`` (the owner as one key token, as the batches'
owner index keeps it) and holds the response's id, owner, ``created_at`` (when it was
queued), status, model and, once it has them, its output tokens and error code. The
response store writes it with every write of a background record
(:class:`jobs.response_store.ResponseStore`), so its status follows the record's; a
response deleted takes its entry with it. The bucket keeps what the responses keep
(``responses.ttl_s``) and at most :data:`MAX_ENTRIES` entries (the oldest changed dropped
first): a listing reads at most that many small entries. One owner's listing reads only
the entries under its keys.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any, TypedDict

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.kv import KeyValue

from bus_schemas import errors as E
from bus_schemas import subjects
from services import buckets
from services import logging as tlog

BUCKET = "tokenbus_background"
MAX_ENTRIES = 10_000
# An owner session's keys are read each under its own filter up to this many keys; more
# read the whole index and keep theirs (a consumer's filters are a list the server checks).
MAX_FILTERS = 64
OPEN = ("queued", "in_progress")
# When an entry was first written (Unix time, to the microsecond): the order of responses
# queued in the same second (``created_at`` counts seconds). Not shown.
ORDER = "noted_at"
log = tlog.get("background")


class IndexEntry(TypedDict, total=False):
    """What the listing shows of one background response."""

    id: str
    owner: str
    created_at: int
    status: str
    model: str
    output_tokens: int
    error: str


def owner_token(owner: str) -> str:
    """An owner (a key id, or "" in an open deployment) as one KV key token."""
    return "k-" + subjects.token(owner) if owner else "open"


def entry_of(response_id: str, record: Mapping[str, Any]) -> IndexEntry:
    """The index entry of a stored background record (what a tenant chose in it, its
    model name, cut short: it is shown as text, never as HTML)."""
    resp = record.get("response")
    resp = resp if isinstance(resp, dict) else {}
    created = resp.get("created_at")
    out: IndexEntry = {
        "id": response_id,
        "owner": str(record.get("owner") or ""),
        "created_at": int(created) if isinstance(created, int | float) else int(time.time()),
        "status": str(resp.get("status") or "")[:32],
        "model": str(resp.get("model") or "")[:256],
    }
    usage = resp.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
        out["output_tokens"] = int(usage["output_tokens"])
    error = resp.get("error")
    if isinstance(error, dict) and error.get("code"):
        out["error"] = str(error["code"])[:64]
    return out


class _Ended(Exception):
    """The entry says the response ended: a late write of it open changes nothing."""


class BackgroundIndex:
    """Note, drop and list the background responses' index entries."""

    def __init__(self, nc: NATS, ttl_s: float, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.ttl_s = ttl_s
        self.bucket = bucket
        self.kv: KeyValue | None = None

    async def open(self) -> BackgroundIndex:
        # Opened with the response store (stall_s=0: a JetStream that does not answer is
        # said at once, and the store tries again at its next use).
        self.kv = await buckets.open_kv(
            self.nc.jetstream(),
            self.bucket,
            ttl=self.ttl_s,
            storage=api.StorageType.FILE,
            discard_old=True,
            max_msgs=MAX_ENTRIES,
            description="tokenbus: the listing of background responses",
            stall_s=0,
        )
        return self

    @staticmethod
    def key(owner: str, response_id: str) -> str:
        return f"{owner_token(owner)}.{response_id}"

    async def note(self, response_id: str, record: Mapping[str, Any]) -> None:
        """Keep the entry of a background record just written: its status and what it has
        now, the first ``created_at`` kept. An entry that says the response ended is not
        taken back to queued or in_progress (a write that lost a race with its end).
        Best effort: an entry not written is logged, the response is not failed for it."""
        if self.kv is None:
            return
        new = entry_of(response_id, record)

        def change(old: dict[str, Any]) -> dict[str, Any]:
            if old.get("status") not in (None, *OPEN) and new["status"] in OPEN:
                raise _Ended
            first = {k: old[k] for k in ("created_at", ORDER) if old.get(k)}
            return {**new, ORDER: time.time(), **first}

        try:
            await buckets.cas(self.kv, self.key(new["owner"], response_id), change)
        except _Ended:
            pass
        except Exception as exc:
            log.warning("background_index_not_kept", response_id=response_id, error=repr(exc))

    async def drop(self, response_id: str, owner: str) -> None:
        """A deleted response's entry goes with it (nothing left under its key)."""
        if self.kv is None:
            return
        subject = f"$KV.{self.bucket}.{self.key(owner, response_id)}"
        with contextlib.suppress(Exception):
            await self.nc.jetstream().purge_stream(f"KV_{self.bucket}", subject=subject)

    async def newest_first(self, owners: list[str] | None) -> list[IndexEntry]:
        """The entries of ``owners``' responses (None: everyone's), newest first (the
        console pages them as every list of the API is paged)."""
        if self.kv is None:
            raise E.ServiceUnavailable("the background responses' index is not open; retry")
        if owners is not None and not owners:
            return []
        mine = None if owners is None else {owner_token(o) for o in owners}
        patterns = [">"] if mine is None or len(mine) > MAX_FILTERS else [f"{t}.>" for t in mine]
        try:
            found, _ = await buckets.values(self.kv, sorted(patterns), most=MAX_ENTRIES)
        except Exception:
            raise E.ServiceUnavailable(
                "the background responses' index (JetStream) did not answer; retry"
            ) from None
        order: list[tuple[float, Any]] = []
        for key, value in found:
            if mine is not None and key.split(".", 1)[0] not in mine:
                continue
            with contextlib.suppress(ValueError, TypeError):
                entry = json.loads(value)
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    entry.pop(buckets.MARK, None)
                    order.append((float(entry.pop(ORDER, 0) or 0), entry))
        order.sort(key=lambda o: (int(o[1].get("created_at") or 0), o[0], o[1]["id"]), reverse=True)
        return [e for _, e in order]  # the JSON this module wrote
