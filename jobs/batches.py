"""Batches (OpenAI's Batch API): a file of requests run in the background, on JetStream.
This module is the batch's state and what creates it; :mod:`jobs.batch_runner` runs its
lines, :mod:`gateway.batches_api` serves ``/v1/batches`` over HTTP.

**State.** A batch is a record in the KV bucket ``tokenbus_batches`` (the OpenAI batch
object, its owner: the id of the key that made it, and its line count), changed only by
compare-and-set. Its lines are messages in the stream ``TOKENBUS_BATCH`` (work-queue
retention, subjects ``tb.v1.batch.work.<batch>.line``), beside one ``validate`` message per
new batch. Each line's answer is written once, create-only, to the KV bucket
``tokenbus_batch_results`` under ``<batch>.<line>``: that write is what makes every line
answered exactly once, whatever runs it twice.

**NATS clients.** Ingress answers ``tb.v1.req.batches.<action>`` with the same stores
(:class:`BatchState`): files and batches for clients that speak NATS, not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from jobs.batch_status import OPEN, allowed, transition
from jobs.files import FileStore
from jobs.job_records import BatchError, BatchObject, BatchRecord, InputLine, ResultLine
from jobs.storage import BatchStorage, FileStorage
from services import buckets
from services import logging as tlog
from services.bodies import THRESHOLD
from services.config import BatchSettings, Settings, kv_replicas
from services.runtime import reply_subject

BATCHES = "tokenbus_batches"
OPEN_BATCHES = "tokenbus_batches_open"  # the ids of batches not yet finished: what sweeps read
BY_OWNER = "tokenbus_batches_by_owner"  # <owner>.<batch id>: what a key's listing reads
RESULTS = "tokenbus_batch_results"
STREAM = "TOKENBUS_BATCH"
# Work too large for one message (a line or a background request past max_payload: issue 67)
# is kept whole in this object store, under its message id; the message, its header naming
# the object, carries the rest (the batch id, a line's number and custom_id) without the
# request. Runners delete the object once the work is acknowledged; it expires with batches.
WORK_LARGE_BUCKET = "tokenbus_batch_work_large"
WORK_OBJECT = "Tokenbus-Work-Object"
CONSUMER = "runners"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 86400}
MAX_ERRORS = 1000  # validation errors listed
log = tlog.get("batches")


def unavailable(exc: BaseException) -> E.ServiceUnavailable:
    """JetStream did not answer: retryable."""
    log.warning("batch_store_unavailable", error=repr(exc)[:300])
    return E.ServiceUnavailable("the batch store (JetStream) did not answer; retry")


def not_found(batch_id: str) -> E.NotFound:
    return E.NotFound(f"no batch with id {batch_id!r}", param="batch_id")


def new_batch(
    endpoint: str, input_file_id: str, window: str, metadata: dict[str, str] | None
) -> BatchObject:
    """A new OpenAI batch object (``validating``)."""
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex[:24]}",
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOWS[window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def check_create(body: Any) -> tuple[str, str, str, dict[str, str] | None]:
    """(input_file_id, endpoint, completion_window, metadata) of a create request; 400s."""
    if not isinstance(body, dict):
        raise E.InvalidRequest("the body must be a JSON object")
    fid = body.get("input_file_id")
    if not isinstance(fid, str) or not fid:
        raise E.InvalidRequest("input_file_id: a file id is required", param="input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise E.InvalidRequest(f"endpoint: must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise E.InvalidRequest("completion_window: only '24h' is served", param="completion_window")
    meta = body.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict)
        or len(meta) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in meta.items()
        )
    ):
        raise E.InvalidRequest(
            "metadata: at most 16 string pairs (keys up to 64, values up to 512 characters)",
            param="metadata",
        )
    return fid, str(endpoint), str(window), meta


def parse_input(
    data: bytes, endpoint: str, max_lines: int
) -> tuple[list[InputLine], list[BatchError]]:
    """The lines of a batch input file (JSONL) and what is wrong with it: a line that is
    not a JSON object with a ``custom_id`` of its own, ``method: POST``, the batch's
    ``url`` and a ``body`` object makes the whole file invalid (the errors name the lines,
    from 1); a line's request being wrong is not checked here (it is an error line)."""
    errors: list[BatchError] = []

    def bad(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        bad("invalid_file", "the file is not UTF-8 text", None)
        return [], errors
    lines: list[InputLine] = []
    seen: set[str] = set()
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            bad("invalid_json_line", f"line {i} is not valid JSON", i)
            continue
        if not isinstance(obj, dict):
            bad("invalid_json_line", f"line {i} is not a JSON object", i)
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad("missing_required_parameter", f"line {i} has no custom_id", i, "custom_id")
            continue
        if cid in seen:
            bad("duplicate_custom_id", f"line {i}: custom_id {cid!r} is used twice", i, "custom_id")
            continue
        seen.add(cid)
        if obj.get("method") != "POST":
            bad("invalid_value", f"line {i}: method must be POST", i, "method")
            continue
        if obj.get("url") != endpoint:
            bad("mismatched_endpoint", f"line {i}: url must be the batch's {endpoint}", i, "url")
            continue
        if not isinstance(obj.get("body"), dict):
            bad("missing_required_parameter", f"line {i}: body must be a JSON object", i, "body")
            continue
        lines.append({"n": len(lines), "line": i, "custom_id": cid, "body": obj["body"]})
    if not lines and not errors:
        bad("empty_file", "the file holds no requests", None)
    if len(lines) > max_lines:
        bad("too_many_lines", f"a batch holds at most {max_lines} requests", None)
    return lines, errors


class _NoChange(Exception):
    """A batch change that changes nothing (or no such batch): nothing is written."""


class BatchStore:
    """Batch records, line results and the work stream (see the module docstring)."""

    def __init__(self, nc: NATS, settings: BatchSettings, ttl_s: float) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.ttl_s = ttl_s
        self.batches: KeyValue | None = None
        self.results: KeyValue | None = None
        self.open_index: KeyValue | None = None
        self.owner_index: KeyValue | None = None
        self.large: ObjectStore | None = None

    async def open(self) -> BatchStore:
        self.batches = await self._bucket(BATCHES, self.ttl_s)
        self.results = await self._bucket(RESULTS, self.ttl_s)
        self.open_index = await self._bucket(OPEN_BATCHES, self.ttl_s)

        async def fill(kv: KeyValue) -> None:
            # New here (a store from before the index): filled from the records.
            self.owner_index = kv
            for rec in await self.all():
                await self._index_owner(rec)

        self.owner_index = await buckets.open_kv(
            self.js, BY_OWNER, ttl=self.ttl_s, on_create=fill, stall_s=0
        )
        config = api.StreamConfig(
            name=STREAM,
            subjects=[subjects.batch_work_wildcard()],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            num_replicas=kv_replicas(),
            duplicate_window=120.0,
        )
        await buckets.open_stream(self.js, config, stall_s=0)
        self.large = await buckets.open_objects(
            self.js,
            WORK_LARGE_BUCKET,
            ttl=self.ttl_s,
            storage=api.StorageType.FILE,
            description="tokenbus: batch lines and background requests too large for a message",
            stall_s=0,
        )
        return self

    async def _bucket(self, name: str, ttl: float) -> KeyValue:
        # Opened once: a JetStream that does not answer is said at once (stall_s=0).
        return await buckets.open_kv(self.js, name, ttl=ttl, stall_s=0)

    def _kv(self) -> KeyValue:
        if self.batches is None:
            raise E.ServiceUnavailable("the batch store (JetStream) is not open; retry")
        return self.batches

    # -- records ------------------------------------------------------------------------------
    async def load(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            entry = await self._kv().get(subjects.token(batch_id))
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None:
            return None
        rec = json.loads(entry.value)
        rec.pop(buckets.MARK, None)
        return cast(BatchRecord, rec), int(entry.revision or 0)

    async def get(self, batch_id: str, owner: str) -> BatchRecord:
        found = await self.load(batch_id)
        if found is None or found[0]["owner"] != owner:
            raise not_found(batch_id)
        return found[0]

    async def create(self, rec: BatchRecord) -> None:
        key = subjects.token(rec["batch"]["id"])
        await buckets.create(self._kv(), key, json.dumps(rec).encode())
        if self.open_index is not None:
            await self.open_index.put(key, b"")
        await self._index_owner(rec)

    async def _index_owner(self, rec: BatchRecord) -> None:
        if self.owner_index is not None:
            await self.owner_index.put(
                f"{_owner_token(rec['owner'])}.{subjects.token(rec['batch']['id'])}", b""
            )

    async def owned(self, owner: str) -> list[BatchObject]:
        """``owner``'s batch objects, newest first: its index entries read, not every
        batch's record."""
        if self.owner_index is None:
            recs = [r for r in await self.all() if r["owner"] == owner]
        else:
            # The owner's keys only (nats-py's keys(filters=) reads every key and filters by
            # substring).
            keys = await buckets.keys(self.owner_index, f"{_owner_token(owner)}.>", live=True)
            recs = []
            for k in keys:
                found = await self.load(k.rpartition(".")[2])
                if found is not None and found[0]["owner"] == owner:
                    recs.append(found[0])
        mine = [r["batch"] for r in recs]
        return sorted(mine, key=lambda b: (b["created_at"], b["id"]), reverse=True)

    async def open_ids(self) -> list[str]:
        """Ids of the batches not finished (the sweep's list: finished ones are never read)."""
        if self.open_index is None:
            return []
        try:
            return await buckets.keys(self.open_index, live=True)
        except NotFoundError:
            return []

    async def closed(self, batch_id: str) -> None:
        """``batch_id`` finished: out of the sweep's list."""
        if self.open_index is not None:
            with contextlib.suppress(Exception):
                await self.open_index.delete(subjects.token(batch_id))

    async def update(
        self, batch_id: str, change: Callable[[BatchRecord], bool]
    ) -> BatchRecord | None:
        """Apply ``change`` (in place; False: no change) by compare-and-set until it holds
        (through a stalled stream leader too, never twice: services.buckets.cas); the record
        after it, or None when there is no such batch."""
        kept: list[BatchRecord] = []

        def apply(state: dict[str, Any]) -> dict[str, Any]:
            if not state:
                raise _NoChange  # no such batch
            if not change(cast(BatchRecord, state)):  # the KV's JSON, changed in place
                kept.append(cast(BatchRecord, state))
                raise _NoChange
            return state

        try:
            _, changed = await buckets.cas(self._kv(), subjects.token(batch_id), apply, tries=200)
        except _NoChange:
            return kept[-1] if kept else None
        rec = cast(BatchRecord, changed)
        if rec["batch"]["status"] not in OPEN:
            await self.closed(batch_id)
        return rec

    async def all(self) -> list[BatchRecord]:
        try:
            keys = await buckets.keys(self._kv())
        except NotFoundError:
            return []
        out: list[BatchRecord] = []
        for k in keys:
            with contextlib.suppress(KeyNotFoundError, NotFoundError):
                entry = await self._kv().get(k)
                if entry.value:
                    rec = json.loads(entry.value)
                    rec.pop(buckets.MARK, None)
                    out.append(rec)
        return out

    async def cancel(self, batch_id: str, owner: str) -> BatchObject:
        """Ask ``owner``'s batch to stop: ``cancelling`` (runners skip its lines), then
        ``cancelled`` once none is left; 400 for a batch already finished."""
        await self.get(batch_id, owner)

        def change(rec: BatchRecord) -> bool:
            b = rec["batch"]
            if not allowed(b["status"], "cancelling"):  # validating or in_progress
                return False
            b["status"] = transition(b["status"], "cancelling")
            b["cancelling_at"] = int(time.time())
            return True

        rec = await self.update(batch_id, change)
        if rec is None:
            raise not_found(batch_id)
        if rec["batch"]["status"] != "cancelling":
            raise E.InvalidRequest(
                f"the batch is {rec['batch']['status']}: only a validating or running batch "
                "can be cancelled (cancelling again is answered as the first time)",
                param="batch_id",
            )
        return rec["batch"].copy()

    # -- results ------------------------------------------------------------------------------
    async def record_result(self, batch_id: str, n: int, line: Mapping[str, object]) -> bool:
        """Write line ``n``'s answer once; False when it has one already."""
        assert self.results is not None
        try:
            await buckets.create(
                self.results, f"{subjects.token(batch_id)}.{n}", json.dumps(line).encode()
            )
        except (KeyWrongLastSequenceError, BadRequestError):
            return False
        return True

    async def answered(self, batch_id: str, n: int) -> bool:
        """Whether line ``n`` has its answer written (a runner that died before it
        acknowledged the line)."""
        assert self.results is not None
        try:
            entry = await self.results.get(f"{subjects.token(batch_id)}.{n}")
        except (KeyNotFoundError, NotFoundError):
            return False
        return bool(entry.value)

    async def collect(self, batch_id: str, total: int) -> list[ResultLine]:
        assert self.results is not None
        out: list[ResultLine] = []
        for n in range(total):
            with contextlib.suppress(KeyNotFoundError, NotFoundError):
                entry = await self.results.get(f"{subjects.token(batch_id)}.{n}")
                if entry.value:
                    out.append(json.loads(entry.value))
        return out

    async def remaining(self, batch_id: str) -> int:
        """Work messages of the batch still in the stream (not yet acknowledged)."""
        info = await self.js.stream_info(
            STREAM, subjects_filter=subjects.batch_work_wildcard(batch_id)
        )
        return sum((info.state.subjects or {}).values())

    async def publish(
        self, batch_id: str, what: str, body: Mapping[str, object], msg_id: str
    ) -> None:
        data = codec.encode(body)
        headers = {"Nats-Msg-Id": msg_id}
        if len(data) > THRESHOLD:  # past what one message takes: the object store holds it
            if self.large is None:
                raise E.ServiceUnavailable("the batch store (JetStream) is not open; retry")
            await self.large.put(msg_id, data)  # a repeat writes the same bytes again
            headers[WORK_OBJECT] = msg_id
            data = codec.encode({k: v for k, v in body.items() if k != "body"})
        await self.js.publish(
            subjects.batch_work(batch_id, what), data, stream=STREAM, headers=headers
        )

    async def work_object(self, name: str) -> bytes | None:
        """The work kept aside under ``name`` (its digest checked); None when it is gone."""
        if self.large is None:
            raise E.ServiceUnavailable("the batch store (JetStream) is not open; retry")
        try:
            got = await buckets.get_object(self.large, name)
        except (ObjectNotFoundError, NotFoundError):
            return None
        return got.data or b""

    async def drop_work_object(self, name: str) -> None:
        """Delete the work kept aside under ``name`` (what expires on its own otherwise)."""
        if self.large is not None:
            with contextlib.suppress(Exception):
                await self.large.delete(name)


# -- NATS clients -------------------------------------------------------------------------
class BatchState:
    """Files and batches for NATS clients (``Client.files_create``, ``Client.batches_create``
    ...): ingress answers ``tb.v1.req.batches.<action>`` requests with the stores the bridges
    use, checking the key each carries where the pipeline has auth. The stores open at the
    first request (an ingress that never sees one never touches them). The lines run in the
    bridges' runners, as an HTTP client's do."""

    def __init__(
        self,
        nc: NATS,
        settings: Settings,
        more: Mapping[str, Callable[[str, str, dict[str, Any], BatchStore], Awaitable[Any]]]
        | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings
        # More actions on the same subjects: action -> handler(action, owner, body, store)
        # -> what the answer adds (background responses: jobs/background.py).
        self.more = dict(more or {})
        self.files: FileStore | None = None
        self.store: BatchStore | None = None
        self.keys: Any = None
        self._opening: asyncio.Lock = asyncio.Lock()

    async def _open(self) -> tuple[FileStore, BatchStore]:
        async with self._opening:
            if self.files is None or self.store is None:
                from auth.store import KeyStore

                try:
                    files = await FileStore(self.nc, self.settings.files).open()
                    store = await BatchStore(
                        self.nc, self.settings.batches, self.settings.files.ttl_s
                    ).open()
                except Exception as exc:
                    log.warning("batches_unavailable", error=repr(exc))
                    raise E.ServiceUnavailable(
                        "files and batches need JetStream, which did not answer; retry"
                    ) from None
                if subjects.STAGE_AUTH in self.settings.ingress.pipeline:
                    self.keys = await KeyStore(self.nc).open()
                self.files, self.store = files, store
        return self.files, self.store

    async def close(self) -> None:
        if self.keys is not None:
            await self.keys.close()

    async def handle(self, msg: Any) -> None:
        """One request; errors go back as error frames (the service runtime sends them)."""
        if not reply_subject(msg, trust_header=False, service="ingress"):
            return  # none, or not the sender's own inbox: nothing is done
        try:
            await self._handle(msg)
        except E.TokenbusError:
            raise
        except Exception as exc:  # JetStream did not answer (a node down, a leader election)
            raise unavailable(exc) from None

    async def _handle(self, msg: Any) -> None:
        if not self.settings.batches.enabled:
            raise E.NotFound("batches are not served here (batches.enabled is false)")
        files, store = await self._open()
        action = msg.subject.rpartition(".")[2]
        body = codec.decode_map(msg.data)
        key = (msg.headers or {}).get(H.API_KEY)
        owner = self.keys.lookup(key).id if self.keys is not None else ""
        out: dict[str, Any] = {"t": "ok"}
        ident = body.get("id")
        if action in ("file_get", "file_content", "file_delete", "get", "cancel") and not (
            isinstance(ident, str) and ident
        ):
            raise E.InvalidRequest(f"{action} needs an 'id'", param="id")
        if action in self.more:
            out.update(await self.more[action](action, owner, body, store))
        elif action == "file_create":
            data, name, purpose = body.get("data"), body.get("filename"), body.get("purpose")
            if not isinstance(data, bytes) or not isinstance(name, str):
                raise E.InvalidRequest("file_create needs 'data' (bytes) and a 'filename'")
            if purpose != "batch":
                raise E.InvalidRequest(
                    f"purpose: {purpose!r} is not served; use 'batch'", param="purpose"
                )
            if len(data) > self.settings.files.max_file_bytes:
                raise E.PayloadTooLarge(
                    f"the file is larger than {self.settings.files.max_file_bytes} bytes"
                )
            out["file"] = await files.upload(owner, name[:255], purpose, data)
        elif action == "file_get":
            out["file"] = await files.get(str(ident), owner)
        elif action == "file_content":
            out["data"] = await files.content(str(ident), owner)
        elif action == "file_delete":
            await files.delete(str(ident), owner)
        elif action == "file_list":
            out["files"] = await files.list(owner, body.get("purpose"))
        elif action == "create":
            out["batch"] = await create_batch(store, files, owner, body)
        elif action == "get":
            out["batch"] = (await store.get(str(ident), owner))["batch"]
        elif action == "list":
            out["batches"] = await store.owned(owner)
        elif action == "cancel":
            out["batch"] = await store.cancel(str(ident), owner)
        else:
            raise E.NotFound(f"no batches action {action!r}")
        await self.nc.publish(msg.reply, codec.encode(out))


async def create_batch(
    store: BatchStorage, files: FileStorage, owner: str, body: Any
) -> BatchObject:
    """Check a create request and its input file, keep the batch and queue its validation:
    the new batch object (HTTP and NATS clients alike)."""
    fid, endpoint, window, meta = check_create(body)
    try:
        info = await files.get(fid, owner)
    except E.NotFound:
        raise E.NotFound(f"input_file_id: no file with id {fid!r}", param="input_file_id") from None
    if info.get("purpose") != "batch":
        raise E.InvalidRequest(
            "input_file_id: the file's purpose must be 'batch'", param="input_file_id"
        )
    batch = new_batch(endpoint, fid, window, meta)
    await store.create({"owner": owner, "batch": batch, "total": 0})
    await store.publish(batch["id"], "validate", {"batch": batch["id"]}, batch["id"])
    return batch


def _owner_token(owner: str) -> str:
    """An owner (a key id, or "" in an open deployment) as one KV key token."""
    return "k-" + subjects.token(owner) if owner else "open"
