"""Stored responses of the Responses API, in a JetStream KV bucket.

``store: true`` (the default) keeps a finished response: the response object, the input
items of its request, and the conversation as chat messages (output included), which a
later request's ``previous_response_id`` continues. Each record names its owner, the id of
the API key that made it (empty where the pipeline checks no keys); a read or delete by
another key is answered exactly as for an id that does not exist.

The bucket has a TTL (``responses.ttl_s``) and a size bound (``responses.max_bytes``), and
unlike the other buckets it drops its *oldest* records when full (a cache of conversations,
not a ledger: a new response must not be refused because old ones fill the bucket). It is
replicated like the others (``kv_replicas``). Every bridge process and every ingress shares
it, so a conversation may continue through any of them.

Each write of a background response's record also keeps its entry in the listing of
background responses (:mod:`jobs.background_index`), which the console pages through.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from auth.store import KeyStore
from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from dialects.responses import RESPONSE_ID
from jobs.background_index import BUCKET as INDEX_BUCKET
from jobs.background_index import BackgroundIndex
from jobs.job_records import LargeRef, ResponseRecord
from jobs.storage import ResponseStorage
from services import buckets
from services import logging as tlog
from services.config import ResponsesSettings, Settings
from services.runtime import reply_subject

BUCKET = "tokenbus_responses"
# Records larger than one message (a large request's input and conversation: issue 67) are
# kept whole in this object store; the KV entry then holds their owner, size and sha256.
LARGE_BUCKET = "tokenbus_responses_large"
LARGE = 512 * 1024  # as services.bodies.THRESHOLD: a KV value shares max_payload too
log = tlog.get("responses")
# Reads of a large record whose pointer and object disagree before it is called damaged.
LARGE_READS = 3


class _Rewritten(Exception):
    """A large record's object does not match its pointer (rewritten meanwhile, or
    damaged)."""


def not_found(response_id: str) -> E.NotFound:
    """The answer for a response that does not exist, or is not the caller's to see."""
    return E.NotFound(f"no response with id {response_id!r}", param="response_id")


def unavailable(exc: BaseException) -> E.ServiceUnavailable:
    """JetStream did not answer (a node down, the cluster electing a leader): retryable."""
    log.warning("response_store_unavailable", error=repr(exc))
    return E.ServiceUnavailable("the response store (JetStream) did not answer; retry")


async def open_store(nc: NATS, settings: ResponsesSettings) -> ResponseStore:
    """The store, opened now where JetStream answers. Where it does not (no JetStream on
    the bus, or a node down or electing a leader as this process starts), it is logged and
    the store opens at its first use after (:meth:`ResponseStore.opened`): a process that
    started during a fault is not left without stored responses for the rest of its life.
    Until then a response is served with ``store: false`` and a read is a retryable 503."""
    store = ResponseStore(nc, settings)
    try:
        await store.open()
    except Exception as exc:
        log.warning("responses_store_not_open", reason="JetStream unavailable", error=repr(exc))
    return store


async def _exists(kv: KeyValue, key: str) -> bool:
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return False
    return bool(entry.value)


class ResponseStore:
    """Put, get and delete stored responses, each readable only by its owner."""

    # A store that could not be opened is tried again at most this often (each use until
    # then is a 503 at once, not a wait on JetStream per request).
    REOPEN_EVERY_S = 1.0

    def __init__(self, nc: NATS, settings: ResponsesSettings, bucket: str = BUCKET) -> None:
        self.nc = nc
        self.settings = settings
        self.bucket = bucket
        self.kv: KeyValue | None = None
        self.large: ObjectStore | None = None
        # The listing of background responses, opened with the bucket.
        self.index: BackgroundIndex | None = None
        self._opening = asyncio.Lock()
        self._next_try = 0.0

    async def open(self) -> ResponseStore:
        """Bind the bucket, creating it when it does not exist yet."""
        # A cache of conversations: a full bucket drops its oldest records (discard_old).
        # Opened once: a JetStream that does not answer is said at once (stall_s=0). The
        # bucket is set last: one not set is opened again whole at the next use.
        kv = await buckets.open_kv(
            self.nc.jetstream(),
            self.bucket,
            ttl=self.settings.ttl_s,
            max_bytes=self.settings.max_bytes,
            storage=api.StorageType.FILE,
            discard_old=True,
            description="tokenbus: stored responses of the Responses API",
            stall_s=0,
        )
        self.large = await buckets.open_objects(
            self.nc.jetstream(),
            f"{self.bucket}_large" if self.bucket != BUCKET else LARGE_BUCKET,
            ttl=self.settings.ttl_s,
            max_bytes=self.settings.max_bytes,
            storage=api.StorageType.FILE,
            description="tokenbus: stored responses too large for one message",
            stall_s=0,
        )
        index = INDEX_BUCKET if self.bucket == BUCKET else f"{self.bucket}_background"
        self.index = await BackgroundIndex(self.nc, self.settings.ttl_s, index).open()
        self.kv = kv
        return self

    async def opened(self) -> KeyValue:
        """The bucket; opened here when :meth:`open` could not (a retryable 503 when it
        still cannot, tried again at most every :attr:`REOPEN_EVERY_S`)."""
        if self.kv is not None:
            return self.kv
        async with self._opening:
            if self.kv is None:
                if time.monotonic() < self._next_try:
                    raise E.ServiceUnavailable("the response store (JetStream) is not open; retry")
                try:
                    await self.open()
                except Exception as exc:
                    self._next_try = time.monotonic() + self.REOPEN_EVERY_S
                    raise unavailable(exc) from None
                log.info("responses_store_opened")
            assert self.kv is not None
            return self.kv

    async def put(self, response_id: str, record: Mapping[str, object]) -> bool:
        """Keep ``record`` (see :func:`dialects.responses.record`) under a new id; False
        when it could not be kept (the id is taken, larger than the bus carries, JetStream
        unavailable), which is logged. Never overwrites: nobody replaces another's record."""
        return await self._write(response_id, record, create=True)

    async def _write(self, response_id: str, record: Mapping[str, object], *, create: bool) -> bool:
        data = json.dumps(record, separators=(",", ":")).encode()
        whole = data
        if len(data) > LARGE:  # the record in the object store, a pointer in KV
            pointer = {
                "owner": record.get("owner", ""),
                "large": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()},
            }
            data = json.dumps(pointer, separators=(",", ":")).encode()
        try:
            # Through a stalled stream leader too (services.buckets).
            kv = await self.opened()
            if whole is not data:
                assert self.large is not None
                if create and await _exists(kv, response_id):
                    raise E.InvalidRequest(f"response {response_id} exists")  # never overwritten
                await self.large.put(response_id, whole)
            if create:
                await buckets.create(kv, response_id, data)
            else:
                # The bucket exists (opened): "no response from stream" is its leader
                # gone for the moment, tried again as a stall.
                await buckets.through_stall(
                    lambda: kv.put(response_id, data), what="response", stream_exists=True
                )
        except Exception as exc:
            log.warning(
                "response_not_stored", response_id=response_id, bytes=len(data), error=repr(exc)
            )
            return False
        if record.get("background") and self.index is not None:
            await self.index.note(response_id, record)
        return True

    async def replace(self, response_id: str, record: Mapping[str, object]) -> bool:
        """Write ``record`` over the one kept under ``response_id`` (a background response
        moving from queued to its end; only the process running it does this)."""
        return await self._write(response_id, record, create=False)

    async def get(self, response_id: str, owner: str) -> ResponseRecord:
        """The record of ``response_id`` if ``owner`` made it; else 404. A large record read
        while it is rewritten (a background response ending: object first, then pointer)
        can pair the old pointer with the new object: read again before calling it
        damaged."""
        for _ in range(LARGE_READS - 1):
            with contextlib.suppress(_Rewritten):
                return await self._get(response_id, owner)
            await asyncio.sleep(0.05)
        try:
            return await self._get(response_id, owner)
        except _Rewritten:
            log.warning("response_record_damaged", response_id=response_id)
            raise not_found(response_id) from None

    async def _get(self, response_id: str, owner: str) -> ResponseRecord:
        if not RESPONSE_ID.match(response_id):
            raise not_found(response_id)
        try:
            entry = await (await self.opened()).get(response_id)
        except (KeyNotFoundError, KeyDeletedError):
            raise not_found(response_id) from None
        except Exception as exc:
            raise unavailable(exc) from None
        if not entry.value:
            raise not_found(response_id)
        rec: ResponseRecord = json.loads(entry.value)
        if rec.get("owner", "") != owner:
            raise not_found(response_id)
        if "large" in rec:
            rec = await self._large(response_id, rec["large"])
        return rec

    async def _large(self, response_id: str, ref: LargeRef) -> ResponseRecord:
        """A record kept in the object store, checked against its pointer's size and digest."""
        if self.large is None:
            raise E.ServiceUnavailable("the response store (JetStream) is not open; retry")
        try:
            got = await buckets.get_object(self.large, response_id)
        except NotFoundError:
            raise not_found(response_id) from None  # expired with, or before, its pointer
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise unavailable(exc) from None
        data = got.data or b""
        if len(data) != ref.get("size") or hashlib.sha256(data).hexdigest() != ref.get("sha256"):
            raise _Rewritten(response_id)
        return cast(ResponseRecord, json.loads(data))

    async def delete(self, response_id: str, owner: str) -> None:
        """Delete ``response_id`` if ``owner`` made it; else 404."""
        rec = await self.get(response_id, owner)
        try:
            await (await self.opened()).purge(response_id)
        except Exception as exc:
            raise unavailable(exc) from None
        if rec.get("background") and self.index is not None:
            await self.index.drop(response_id, owner)
        if self.large is not None:
            with contextlib.suppress(Exception):  # a small record has none; TTL otherwise
                await self.large.delete(response_id)


async def conversation(
    store: ResponseStorage | None, response_id: str | None, owner: str
) -> list[dict[str, Any]] | None:
    """The conversation a ``previous_response_id`` continues (404 when it is not one of
    ``owner``'s stored responses; 400 where nothing is stored)."""
    if response_id is None:
        return None
    if store is None:
        raise E.InvalidRequest(
            "previous_response_id: this server keeps no responses; send the whole "
            "conversation as input",
            param="previous_response_id",
        )
    try:
        rec = await store.get(response_id, owner)
    except E.NotFound:
        raise E.NotFound(
            f"previous_response_id: no stored response with id {response_id!r}",
            param="previous_response_id",
        ) from None
    return list(rec.get("messages") or [])


class ResponsesState:
    """The stored responses of NATS clients: ingress answers ``responses_state`` requests
    (get, put, delete) from a client's ``Client.responses`` with this, checking the key the
    request carries (where the pipeline has auth) and keeping records under its id, as the
    bridge does for HTTP clients; so a conversation may continue over either."""

    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.settings = settings
        self.store: ResponseStore | None = None
        self.keys: KeyStore | None = None

    async def open(self) -> ResponsesState:
        self.store = await open_store(self.nc, self.settings.responses)
        if subjects.STAGE_AUTH in self.settings.ingress.pipeline:
            self.keys = await KeyStore(self.nc).open()
        return self

    async def close(self) -> None:
        if self.keys is not None:
            await self.keys.close()

    async def handle(self, msg: Msg) -> None:
        """One request; errors go back as error frames (the service runtime sends them)."""
        reply = reply_subject(msg, trust_header=False, service="ingress")
        if not reply:  # none, or not the sender's own inbox: nothing is done
            return
        store = self.store
        if store is None:
            raise E.ServiceUnavailable("this ingress is still starting; retry")
        action = msg.subject.rpartition(".")[2]
        body = codec.decode_map(msg.data)
        response_id = body.get("id")
        if not isinstance(response_id, str):
            raise E.InvalidRequest("a stored-response request needs an 'id'", param="id")
        key = (msg.headers or {}).get(H.API_KEY)
        owner = self.keys.lookup(key).id if self.keys is not None else ""
        out: dict[str, Any] = {"t": "ok"}
        if action == subjects.RESPONSES_GET:
            out["record"] = await store.get(response_id, owner)
        elif action == subjects.RESPONSES_DELETE:
            await store.delete(response_id, owner)
        elif action == subjects.RESPONSES_PUT:
            rec = body.get("record")
            if not RESPONSE_ID.match(response_id) or not isinstance(rec, dict):
                raise E.InvalidRequest("a put needs a response id and a record", param="record")
            # The owner is the key's, whatever the record says; and a client's record is
            # never a background response's (those are queued, run and listed by tokenbus).
            mine = {k: v for k, v in rec.items() if k != "background"}
            out["stored"] = await store.put(response_id, {**mine, "owner": owner})
        else:
            raise E.NotFound(f"no stored-response action {action!r}")
        await self.nc.publish(reply, codec.encode(out))
