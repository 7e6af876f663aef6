"""The Batch API (``/v1/batches``): a file of requests run in the background, on JetStream.

**State.** A batch is a record in the KV bucket ``tokenbus_batches`` (the OpenAI batch
object, its owner: the id of the key that made it, and its line count), changed only by
compare-and-set. Its lines are messages in the stream ``TOKENBUS_BATCH`` (work-queue
retention, subjects ``tb.v1.batch.work.<batch>.line``), beside one ``validate`` message per
new batch. Each line's answer is written once, create-only, to the KV bucket
``tokenbus_batch_results`` under ``<batch>.<line>``: that write is what makes every line
answered exactly once, whatever runs it twice.

**Runners.** Every bridge process runs lines (:class:`BatchRunner`) from one durable pull
consumer (``runners``) that all of them share: more bridges, more runners. A runner takes a
line, runs it through this process's own OpenAI app as an HTTP request would go (the
endpoint's validation, the key's limits and filter, routing, telemetry), in the lowest
class (``batches.priority``, ``flex``: workers serve it from spare capacity, docs/flow.md),
on behalf of the batch's key (checked by id: a key revoked since stops its batch's lines).
While a line runs its message is kept in progress; a runner that dies (kill -9) leaves it
unacknowledged and JetStream hands it to another after ``batches.ack_wait_s``. A retryable
answer (429, 5xx: no replica, replica lost) is tried again, up to ``batches.max_deliver``
deliveries; any other answer is final: 2xx lines go to the output file, the rest to the
error file, in OpenAI's line format.

**Finishing.** When the stream holds no more lines of a batch, a runner wins the change to
``finalizing`` (compare-and-set), writes the output and error files from the results (ids
derived from the batch's, so a retried finalizer rewrites the same files) and marks the
batch ``completed`` (or ``cancelled``, ``expired``). A sweep every few seconds finishes what
a dead runner left. The finished batch object is announced on ``tb.v1.batch.done.<key id>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from gateway.asgi import (
    Receive,
    Scope,
    Send,
    list_page,
    query_of,
    send_error,
    send_json,
)
from gateway.files import OUTPUT_PURPOSE, FileStore, owner_of
from gateway.openai_api import InProcess, read_body
from services import buckets
from services import logging as tlog
from services.config import BatchSettings, Settings, kv_replicas

BATCHES = "tokenbus_batches"
OPEN_BATCHES = "tokenbus_batches_open"  # the ids of batches not yet finished: what sweeps read
BY_OWNER = "tokenbus_batches_by_owner"  # <owner>.<batch id>: what a key's listing reads
RESULTS = "tokenbus_batch_results"
STREAM = "TOKENBUS_BATCH"
CONSUMER = "runners"
PREFIX = "/v1/batches"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 86400}
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
MAX_ERRORS = 1000  # validation errors listed
SWEEP_S = 3.0
GAUGE_SWEEPS = 10  # the gauges (which read every batch) every 10th sweep
FLUSH_S = 1.0
STALE_FINALIZING_S = 60.0
RETRY_STATUSES = (429, 500, 502, 503, 504)
log = tlog.get("batches")

# Metrics (docs/telemetry.md): a bridge process's own runner, and the deployment's batches as
# its sweep last saw them (every bridge reports the same: take the max across them).
LINES = Counter(
    "tokenbus_batch_lines_total",
    "Batch lines this process's runner settled (ok, error) or handed back to retry (retried).",
    ["outcome"],
)
BATCH_COUNT = Gauge("tokenbus_batches", "Batches by status (the deployment's).", ["status"])
PENDING = Gauge(
    "tokenbus_batch_lines_pending",
    "Batch lines waiting in the work queue or running (the deployment's).",
)
OLDEST = Gauge(
    "tokenbus_batch_oldest_open_age_seconds",
    "Age of the oldest batch not yet finished (0: none open).",
)
STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "cancelling",
    "completed",
    "failed",
    "expired",
    "cancelled",
)


def unavailable(exc: BaseException) -> E.ServiceUnavailable:
    """JetStream did not answer: retryable."""
    log.warning("batch_store_unavailable", error=repr(exc)[:300])
    return E.ServiceUnavailable("the batch store (JetStream) did not answer; retry")


def not_found(batch_id: str) -> E.NotFound:
    return E.NotFound(f"no batch with id {batch_id!r}", param="batch_id")


def new_batch(
    endpoint: str, input_file_id: str, window: str, metadata: dict[str, str] | None
) -> dict[str, Any]:
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
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The lines of a batch input file (JSONL) and what is wrong with it: a line that is
    not a JSON object with a ``custom_id`` of its own, ``method: POST``, the batch's
    ``url`` and a ``body`` object makes the whole file invalid (the errors name the lines,
    from 1); a line's request being wrong is not checked here (it is an error line)."""
    errors: list[dict[str, Any]] = []

    def bad(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        bad("invalid_file", "the file is not UTF-8 text", None)
        return [], errors
    lines: list[dict[str, Any]] = []
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

    async def open(self) -> BatchStore:
        self.batches = await self._bucket(BATCHES, self.ttl_s)
        self.results = await self._bucket(RESULTS, self.ttl_s)
        self.open_index = await self._bucket(OPEN_BATCHES, self.ttl_s)
        try:
            self.owner_index = await self.js.key_value(BY_OWNER)
        except (BucketNotFoundError, NotFoundError):
            # New here (a store from before the index): made, then filled from the records.
            self.owner_index = await self._bucket(BY_OWNER, self.ttl_s)
            for rec in await self.all():
                await self._index_owner(rec)
        config = api.StreamConfig(
            name=STREAM,
            subjects=[subjects.batch_work_wildcard()],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            num_replicas=kv_replicas(),
            duplicate_window=120.0,
        )
        try:
            await self.js.stream_info(STREAM)
        except NotFoundError:
            with contextlib.suppress(BadRequestError):  # made meanwhile by another process
                await self.js.add_stream(config)
        return self

    async def _bucket(self, name: str, ttl: float) -> KeyValue:
        try:
            return await self.js.key_value(name)
        except (BucketNotFoundError, NotFoundError):
            with contextlib.suppress(BadRequestError):
                return await self.js.create_key_value(
                    bucket=name, history=1, ttl=ttl, replicas=kv_replicas()
                )
            return await self.js.key_value(name)

    def _kv(self) -> KeyValue:
        if self.batches is None:
            raise E.ServiceUnavailable("the batch store (JetStream) is not open; retry")
        return self.batches

    # -- records ------------------------------------------------------------------------------
    async def load(self, batch_id: str) -> tuple[dict[str, Any], int] | None:
        try:
            entry = await self._kv().get(subjects.token(batch_id))
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None:
            return None
        rec = json.loads(entry.value)
        rec.pop(buckets.MARK, None)
        return rec, int(entry.revision or 0)

    async def get(self, batch_id: str, owner: str) -> dict[str, Any]:
        found = await self.load(batch_id)
        if found is None or found[0]["owner"] != owner:
            raise not_found(batch_id)
        return found[0]

    async def create(self, rec: dict[str, Any]) -> None:
        key = subjects.token(rec["batch"]["id"])
        await buckets.create(self._kv(), key, json.dumps(rec).encode())
        if self.open_index is not None:
            await self.open_index.put(key, b"")
        await self._index_owner(rec)

    async def _index_owner(self, rec: dict[str, Any]) -> None:
        if self.owner_index is not None:
            await self.owner_index.put(
                f"{_owner_token(rec['owner'])}.{subjects.token(rec['batch']['id'])}", b""
            )

    async def owned(self, owner: str) -> list[dict[str, Any]]:
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
        self, batch_id: str, change: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        """Apply ``change`` (in place; False: no change) by compare-and-set until it holds
        (through a stalled stream leader too, never twice: services.buckets.cas); the record
        after it, or None when there is no such batch."""
        kept: list[dict[str, Any]] = []

        def apply(state: dict[str, Any]) -> dict[str, Any]:
            if not state:
                raise _NoChange  # no such batch
            if not change(state):
                kept.append(state)
                raise _NoChange
            return state

        try:
            _, rec = await buckets.cas(self._kv(), subjects.token(batch_id), apply, tries=200)
        except _NoChange:
            return kept[-1] if kept else None
        if rec["batch"]["status"] not in OPEN:
            await self.closed(batch_id)
        return rec

    async def all(self) -> list[dict[str, Any]]:
        try:
            keys = await buckets.keys(self._kv())
        except NotFoundError:
            return []
        out = []
        for k in keys:
            with contextlib.suppress(KeyNotFoundError, NotFoundError):
                entry = await self._kv().get(k)
                if entry.value:
                    rec = json.loads(entry.value)
                    rec.pop(buckets.MARK, None)
                    out.append(rec)
        return out

    async def cancel(self, batch_id: str, owner: str) -> dict[str, Any]:
        """Ask ``owner``'s batch to stop: ``cancelling`` (runners skip its lines), then
        ``cancelled`` once none is left; 400 for a batch already finished."""
        await self.get(batch_id, owner)

        def change(rec: dict[str, Any]) -> bool:
            b = rec["batch"]
            if b["status"] not in ("validating", "in_progress"):
                return False
            b["status"], b["cancelling_at"] = "cancelling", int(time.time())
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
        return dict(rec["batch"])

    # -- results ------------------------------------------------------------------------------
    async def record_result(self, batch_id: str, n: int, line: dict[str, Any]) -> bool:
        """Write line ``n``'s answer once; False when it has one already."""
        assert self.results is not None
        try:
            await buckets.create(
                self.results, f"{subjects.token(batch_id)}.{n}", json.dumps(line).encode()
            )
        except (KeyWrongLastSequenceError, BadRequestError):
            return False
        return True

    async def collect(self, batch_id: str, total: int) -> list[dict[str, Any]]:
        assert self.results is not None
        out = []
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

    async def publish(self, batch_id: str, what: str, body: dict[str, Any], msg_id: str) -> None:
        await self.js.publish(
            subjects.batch_work(batch_id, what),
            codec.encode(body),
            stream=STREAM,
            headers={"Nats-Msg-Id": msg_id},
        )


class BatchAPI:
    """``/v1/batches`` on an ASGI route table (``mount``)."""

    def __init__(self, store: BatchStore, files: FileStore, owner: Any, settings: Settings) -> None:
        self.store = store
        self.files = files
        self.owner = owner
        self.settings = settings

    def mount(self, app: Any) -> None:
        app.add_route("POST", PREFIX, self.create)
        app.add_route("GET", PREFIX, self.listing)
        app.add_prefix(PREFIX, self.by_id)

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = owner_of(self.owner, scope)
            body = await read_body(scope, receive, 1 << 20)
            batch = await create_batch(self.store, self.files, owner, body)
            await send_json(send, 200, batch)
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))

    async def listing(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = owner_of(self.owner, scope)
            mine = await self.store.owned(owner)
            await send_json(send, 200, list_page(mine, query_of(scope)))
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))

    async def by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``."""
        method = scope["method"]
        path = scope["path"].rstrip("/")
        parts = path[len(PREFIX) + 1 :].split("/")
        try:
            owner = owner_of(self.owner, scope)
            if len(parts) == 1 and parts[0] and method == "GET":
                await send_json(send, 200, (await self.store.get(parts[0], owner))["batch"])
            elif len(parts) == 2 and parts[1] == "cancel" and method == "POST":
                await send_json(send, 200, await self.store.cancel(parts[0], owner))
            else:
                raise E.NotFound(f"no route for {method} {path}")
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))


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
        # -> what the answer adds (background responses: gateway/background.py).
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
        if not msg.reply:
            return
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
            out["file"] = await files.put(owner, name[:255], purpose, data)
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
    store: BatchStore, files: FileStore, owner: str, body: Any
) -> dict[str, Any]:
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


# -- running lines ----------------------------------------------------------------------------
class BatchRunner:
    """Runs batch work from the shared durable consumer (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        store: BatchStore,
        files: FileStore,
        app: Callable[[Scope, Receive, Send], Any],
        settings: BatchSettings,
        handlers: Mapping[str, Callable[[dict[str, Any]], Awaitable[bool]]] | None = None,
    ) -> None:
        self.nc = nc
        self.store = store
        self.files = files
        self.app = app
        self.settings = settings
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[None] | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._sweeps = 0
        self._tally: dict[str, list[int]] = {}  # batch -> [ok, failed] not yet in its record
        self._records: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._slots = asyncio.Semaphore(settings.concurrency)
        # More kinds of work on the same queue: kind -> handler(body) -> settled (a
        # background response: gateway/background.py).
        self.handlers = dict(handlers or {})
        self.lines_run = 0

    async def start(self) -> None:
        js = self.nc.jetstream()
        config = api.ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait_s,
            max_deliver=-1,  # a line's tries are counted here (_line), never dropped unanswered
            max_ack_pending=-1,
            filter_subject=subjects.batch_work_wildcard(),
        )
        self.sub = await js.pull_subscribe(
            subjects.batch_work_wildcard(), durable=CONSUMER, stream=STREAM, config=config
        )
        self._loop = asyncio.get_running_loop().create_task(self._pull())
        self._sweep = asyncio.get_running_loop().create_task(self._sweeper())
        self._flushing = asyncio.get_running_loop().create_task(self._flusher())

    async def stop(self, grace_s: float = 0.0) -> None:
        """Take no more work; let the lines running finish (up to ``grace_s``), then stop.
        A line cut off is not acknowledged: JetStream gives it to another runner."""
        for t in (self._loop, self._sweep, self._flushing):
            if t is not None:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if self._tasks and grace_s > 0:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._flush(), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.sub.unsubscribe(), 2.0)

    async def _pull(self) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while True:
            await self._slots.acquire()
            free = 1
            while free < self.settings.concurrency and not self._slots.locked():
                await self._slots.acquire()
                free += 1
            try:
                msgs = await self.sub.fetch(batch=free, timeout=1.0)
            except (NatsTimeout, TimeoutError):
                msgs = []
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch_fetch_failed", error=repr(exc))
                msgs = []
                await asyncio.sleep(0.5)
            for _ in range(free - len(msgs)):
                self._slots.release()
            for msg in msgs:
                task = asyncio.get_running_loop().create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, msg: Any) -> None:
        what = msg.subject.rpartition(".")[2]
        try:
            body = _work(msg.data, what)
        except (E.TokenbusError, KeyError, TypeError, ValueError) as exc:
            # Not work a service queued (only bridges and ingress may publish here): dropped
            # for good, never tried again.
            log.warning("batch_work_malformed", subject=msg.subject[:200], error=repr(exc)[:200])
            with contextlib.suppress(Exception):
                await msg.term()
            return
        batch_id = str(body["batch"])
        try:
            if what == "validate":
                await self._validate(batch_id)
                await msg.ack()
                await self._maybe_finish(batch_id)
            elif what == "line":
                if await self._line(batch_id, body, msg):
                    await msg.ack()
            elif what in self.handlers:
                keep = asyncio.get_running_loop().create_task(self._keep_in_progress(msg))
                try:
                    settled = await self.handlers[what](body)
                finally:
                    keep.cancel()
                if settled:
                    await msg.ack()
                else:
                    await msg.nak(delay=1.0)
            else:
                await msg.term()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # JetStream away, a bad message: tried again later
            log.warning("batch_work_failed", subject=msg.subject, error=repr(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    # -- validation ---------------------------------------------------------------------------
    async def _validate(self, batch_id: str) -> None:
        found = await self.store.load(batch_id)
        if found is None:
            return
        rec = found[0]
        b = rec["batch"]
        if b["status"] == "cancelling":
            await self._finish(batch_id)
            return
        if b["status"] not in ("validating", "in_progress"):
            return
        try:
            data = await self.files.content(b["input_file_id"], rec["owner"])
        except E.NotFound:
            await self._fail(batch_id, [_err("file_not_found", "the input file is gone")])
            return
        lines, errors = parse_input(data, b["endpoint"], self.settings.max_lines)
        if errors:
            await self._fail(batch_id, errors)
            return
        for start in range(0, len(lines), 256):
            await asyncio.gather(
                *(
                    self.store.publish(
                        batch_id,
                        "line",
                        {"batch": batch_id, **line, "url": b["endpoint"]},
                        f"{batch_id}.{line['n']}",
                    )
                    for line in lines[start : start + 256]
                )
            )

        def running(rec: dict[str, Any]) -> bool:
            if rec["batch"]["status"] != "validating":
                return False
            rec["total"] = len(lines)
            rec["batch"]["request_counts"]["total"] = len(lines)
            rec["batch"]["status"] = "in_progress"
            rec["batch"]["in_progress_at"] = int(time.time())
            return True

        await self.store.update(batch_id, running)

    async def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        def failed(rec: dict[str, Any]) -> bool:
            b = rec["batch"]
            if b["status"] not in ("validating", "cancelling"):
                return False
            b["status"], b["failed_at"] = "failed", int(time.time())
            b["errors"] = {"object": "list", "data": errors}
            return True

        rec = await self.store.update(batch_id, failed)
        if rec is not None:
            await self._announce(rec)

    # -- one line -----------------------------------------------------------------------------
    async def _line(self, batch_id: str, body: dict[str, Any], msg: Any) -> bool:
        """Run one line; True when it is settled (answered, or not to be run), False when
        it goes back to the queue (nak'd) for another try."""
        rec = await self._status(batch_id)
        if rec is None:
            return True  # the batch is gone: its lines with it
        b = rec["batch"]
        n = int(body["n"])
        if b["status"] in ("cancelling", "cancelled", "failed"):
            return True
        delivered = int(getattr(msg.metadata, "num_delivered", 1) or 1)
        if delivered > self.settings.max_deliver:
            # Its runners died with it every time (or it kept failing): answered, not lost.
            err = _err("line_failed", f"the line was tried {delivered - 1} times without an answer")
            await self._record(batch_id, n, _line_out(body, None, err), ok=False)
            return True
        if time.time() > b["expires_at"]:
            line = _line_out(body, None, _err("batch_expired", "the batch expired first"))
            await self._record(batch_id, n, line, ok=False)
            return True
        status, answer, rid = await self._run(rec["owner"], str(body["url"]), body["body"], msg)
        if status in RETRY_STATUSES and delivered < self.settings.max_deliver:
            LINES.labels("retried").inc()
            await msg.nak(delay=min(30.0, 0.5 * 2**delivered))
            return False
        out = _line_out(body, {"status_code": status, "request_id": rid, "body": answer}, None)
        await self._record(batch_id, n, out, ok=200 <= status < 300)
        return True

    async def _run(
        self, owner: str, url: str, body: dict[str, Any], msg: Any
    ) -> tuple[int, Any, str]:
        """The line's request through this process's app: (status, JSON body, request id)."""
        rid = uuid.uuid4().hex
        payload = {**body}
        payload.pop("stream", None)  # a batch line's answer is whole
        payload.pop("stream_options", None)
        line = InProcess(
            url,
            payload,
            owner,
            [
                (b"x-request-id", rid.encode()),
                (b"x-tokenbus-service-tier", self.settings.priority.encode()),
            ],
        )
        keep = asyncio.get_running_loop().create_task(self._keep_in_progress(msg))
        try:
            await asyncio.wait_for(line.run(self.app), self.settings.line_timeout_s)
        except TimeoutError:
            return 504, {"error": E.Timeout("the line took too long").to_dict()}, rid
        finally:
            keep.cancel()
        self.lines_run += 1
        raw = line.answer
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = {"error": {"message": raw.decode("utf-8", "replace")[:2000]}}
        return line.status or 500, answer, rid

    async def _keep_in_progress(self, msg: Any) -> None:
        """Tell JetStream the line is still running, so nobody else is given it."""
        while True:
            await asyncio.sleep(max(1.0, self.settings.ack_wait_s / 3))
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _record(self, batch_id: str, n: int, line: dict[str, Any], ok: bool) -> None:
        if not await self.store.record_result(batch_id, n, line):
            return  # answered before (a retried runner): counted then
        LINES.labels("ok" if ok else "error").inc()
        # Counted into the record once a second (one compare-and-set per batch, not one per
        # line: hundreds of lines a second on one record would mostly retry). A count lost
        # with its runner is made exact when the batch is finalized, from the results.
        tally = self._tally.setdefault(batch_id, [0, 0])
        tally[0 if ok else 1] += 1

    async def _flush(self) -> None:
        """Add this runner's counts to the batch records; finish those with no line left."""
        tallies, self._tally = self._tally, {}
        for batch_id, (ok, bad) in tallies.items():

            def count(rec: dict[str, Any], ok: int = ok, bad: int = bad) -> bool:
                if rec["batch"]["status"] not in OPEN:
                    return False
                counts = rec["batch"]["request_counts"]
                counts["completed"] += ok
                counts["failed"] += bad
                return True

            await self.store.update(batch_id, count)
            await self._maybe_finish(batch_id)

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch_flush_failed", error=repr(exc))

    async def _status(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's record as of at most :data:`FLUSH_S` ago (a line needs its status,
        owner and expiry; every line reading the record again would flood the bucket)."""
        now = time.monotonic()
        cached = self._records.get(batch_id)
        if cached is not None and now - cached[0] < FLUSH_S:
            return cached[1]
        found = await self.store.load(batch_id)
        rec = found[0] if found is not None else None
        self._records[batch_id] = (now, rec)
        if len(self._records) > 10_000:
            self._records.pop(next(iter(self._records)))
        return rec

    # -- finishing ----------------------------------------------------------------------------
    async def _maybe_finish(self, batch_id: str) -> None:
        if await self.store.remaining(batch_id) == 0:
            await self._finish(batch_id)

    async def _finish(self, batch_id: str) -> None:
        """Write the output and error files and close the batch (once: compare-and-set)."""
        now = time.time()
        mine = uuid.uuid4().hex

        def finalizing(rec: dict[str, Any]) -> bool:
            b = rec["batch"]
            stale = b["status"] == "finalizing" and now - (b["finalizing_at"] or 0) > (
                STALE_FINALIZING_S
            )
            if b["status"] not in ("in_progress", "cancelling") and not stale:
                return False
            if b["status"] != "finalizing":
                rec["ending"] = "cancelled" if b["status"] == "cancelling" else "completed"
            b["status"], b["finalizing_at"] = "finalizing", int(now)
            rec["finalizer"] = mine
            return True

        rec = await self.store.update(batch_id, finalizing)
        if rec is None or rec.get("finalizer") != mine:
            return  # not to be finished, or another runner finishes it
        results = await self.store.collect(batch_id, int(rec["total"]))
        ok = [r for r in results if r.get("ok")]
        bad = [r for r in results if not r.get("ok")]
        out_id = err_id = None
        name = f"{batch_id}"
        if ok:
            out_id = f"file-{batch_id[6:]}-out"
            await self.files.put(
                rec["owner"], f"{name}_output.jsonl", OUTPUT_PURPOSE, _jsonl(ok), out_id
            )
        if bad:
            err_id = f"file-{batch_id[6:]}-err"
            await self.files.put(
                rec["owner"], f"{name}_error.jsonl", OUTPUT_PURPOSE, _jsonl(bad), err_id
            )
        expired = any((r.get("error") or {}).get("code") == "batch_expired" for r in bad)
        ending = rec.get("ending") or "completed"
        if ending == "completed" and expired:
            ending = "expired"

        def done(rec: dict[str, Any]) -> bool:
            b = rec["batch"]
            if b["status"] != "finalizing":
                return False
            b["status"] = ending
            b[f"{ending}_at"] = int(time.time())
            b["output_file_id"], b["error_file_id"] = out_id, err_id
            b["request_counts"] = {
                "total": int(rec["total"]),
                "completed": len(ok),
                "failed": len(bad),
            }
            return True

        final = await self.store.update(batch_id, done)
        if final is not None and final["batch"]["status"] == ending:
            await self._announce(final)

    async def _announce(self, rec: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.batch_done(rec["owner"]), json.dumps(rec["batch"]).encode()
            )

    async def _gauges(self, recs: list[dict[str, Any]]) -> None:
        by = dict.fromkeys(STATUSES, 0)
        now = time.time()
        oldest = 0.0
        for rec in recs:
            b = rec["batch"]
            by[b["status"]] = by.get(b["status"], 0) + 1
            if b["status"] in OPEN:
                oldest = max(oldest, now - b["created_at"])
        for status, n in by.items():
            BATCH_COUNT.labels(status).set(n)
        OLDEST.set(oldest)
        info = await self.nc.jetstream().consumer_info(STREAM, CONSUMER)
        PENDING.set(int(info.num_pending or 0) + int(info.num_ack_pending or 0))

    async def _sweeper(self) -> None:
        """Finish what a dead runner left: batches with no line left to run, finalizers
        that stopped, cancelled batches whose lines are all settled."""
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                for bid in await self.store.open_ids():
                    found = await self.store.load(bid)
                    status = found[0]["batch"]["status"] if found is not None else None
                    if status in ("in_progress", "cancelling", "finalizing"):
                        await self._maybe_finish(bid)
                    elif status not in OPEN:  # gone, or finished by a runner that then died
                        await self.store.closed(bid)
                self._sweeps += 1
                if self._sweeps % GAUGE_SWEEPS == 1:
                    await self._gauges(await self.store.all())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch_sweep_failed", error=repr(exc))


def _work(data: bytes, what: str) -> dict[str, Any]:
    """A work message's body, checked for what its kind reads."""
    body = codec.decode_map(data)
    if not isinstance(body.get("batch"), str) or not body["batch"]:
        raise ValueError("no batch id")
    if what == "line":
        int(body["n"])
        if not isinstance(body.get("url"), str) or not isinstance(body.get("body"), dict):
            raise ValueError("a line needs its url and body")
        if not isinstance(body.get("custom_id"), str):
            raise ValueError("a line needs its custom_id")
    if what == "response" and (
        not isinstance(body.get("body"), dict) or not isinstance(body.get("owner", ""), str)
    ):
        raise ValueError("a background response needs its body")
    return body


def _owner_token(owner: str) -> str:
    """An owner (a key id, or "" in an open deployment) as one KV key token."""
    return "k-" + subjects.token(owner) if owner else "open"


def _err(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


def _line_out(
    body: dict[str, Any], response: dict[str, Any] | None, error: dict[str, Any] | None
) -> dict[str, Any]:
    """A line of the output or error file (OpenAI's shape), with ``ok`` for sorting."""
    ok = error is None and response is not None and 200 <= response["status_code"] < 300
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": body["custom_id"],
        "response": response,
        "error": None if error is None else {"code": error["code"], "message": error["message"]},
        "ok": ok,
        "n": int(body["n"]),
    }


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    out = []
    for line in sorted(lines, key=lambda r: r["n"]):
        shown = {k: v for k, v in line.items() if k not in ("ok", "n")}
        out.append(json.dumps(shown))
    return ("\n".join(out) + "\n").encode()
