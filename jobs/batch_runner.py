"""The batch runners: every bridge process runs batch lines and background responses from
the work stream that :mod:`jobs.batches` fills.

**Runners.** Every bridge process runs lines (:class:`BatchRunner`) from one durable pull
consumer (``runners``) that all of them share: more bridges, more runners. A runner takes a
line, runs it through this process's own OpenAI app as an HTTP request would go
(:class:`jobs.inprocess.InProcess`: the endpoint's validation, the key's limits and filter,
routing, telemetry), in the lowest class (``batches.priority``, ``flex``: workers serve it
from spare capacity, docs/flow.md), on behalf of the batch's key (checked by id: a key
revoked since stops its batch's lines). While a line runs its message is kept in progress;
a runner that dies (kill -9) leaves it unacknowledged and JetStream hands it to another
after ``batches.ack_wait_s``. A retryable answer (429, 5xx: no replica, replica lost) is
tried again, up to ``batches.max_deliver`` deliveries; any other answer is final: 2xx lines
go to the output file, the rest to the error file, in OpenAI's line format.

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
from typing import Any, Literal, cast

from nats.aio.client import Client as NATS
from nats.js import api
from prometheus_client import Counter, Gauge

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from jobs.batch_status import OPEN, STATUSES, allowed, transition
from jobs.batches import CONSUMER, STREAM, WORK_OBJECT, parse_input
from jobs.files import OUTPUT_PURPOSE
from jobs.inprocess import TIMEOUT, App, InProcess
from jobs.job_records import (
    BatchError,
    BatchRecord,
    LineError,
    LineResponse,
    LineWork,
    ResultLine,
)
from jobs.storage import BatchStorage, FileStorage
from services import logging as tlog
from services.config import BatchSettings
from services.runtime import cancel_and_wait

Ending = Literal["completed", "cancelled", "expired"]  # how a finished batch ends
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


# -- running lines ----------------------------------------------------------------------------
class BatchRunner:
    """Runs batch work from the shared durable consumer (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        store: BatchStorage,
        files: FileStorage,
        app: App,
        settings: BatchSettings,
        handlers: Mapping[str, Callable[[Any], Awaitable[bool]]] | None = None,
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
        self._records: dict[str, tuple[float, BatchRecord | None]] = {}
        self._slots = asyncio.Semaphore(settings.concurrency)
        # More kinds of work on the same queue: kind -> handler(body) -> settled (a
        # background response: jobs/background.py, its body a ResponseWork).
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
            await cancel_and_wait(t)  # (the pull loop's cancel can be lost in a fetch)
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
        aside = (msg.headers or {}).get(WORK_OBJECT)
        try:
            data = msg.data
            if aside:  # too large for the message: kept in the object store
                kept = await self.store.work_object(aside)
                if kept is None:  # expired, or deleted after an ack the server lost
                    await self._work_object_missing(msg, what)
                    return
                data = kept
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # JetStream away: tried again later
            log.warning("batch_work_failed", subject=msg.subject, error=repr(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        if await self._handle_work(msg, what, data) and aside:
            await self.store.drop_work_object(aside)

    async def _work_object_missing(self, msg: Any, what: str) -> None:
        """A work message whose body kept aside is gone: a line is answered with an error
        (its message names it), unless it was answered before; nothing else is run."""
        log.warning("batch_work_object_missing", subject=msg.subject[:200])
        with contextlib.suppress(Exception):
            stub = codec.decode_map(msg.data)
            if what == "line" and isinstance(stub.get("batch"), str):
                err = _err("line_body_missing", "the line's request expired before it ran")
                line = _line_out(cast(LineWork, {**stub, "body": {}}), None, err)
                await self._record(str(stub["batch"]), int(stub["n"]), line, ok=False)
        with contextlib.suppress(Exception):
            await msg.term()

    async def _handle_work(self, msg: Any, what: str, data: bytes) -> bool:
        """Do one work message; whether it is done for good (acknowledged or terminated),
        not to be delivered again."""
        try:
            body = _work(data, what)
        except (E.TokenbusError, KeyError, TypeError, ValueError) as exc:
            # Not work a service queued (only bridges and ingress may publish here): dropped
            # for good, never tried again.
            log.warning("batch_work_malformed", subject=msg.subject[:200], error=repr(exc)[:200])
            with contextlib.suppress(Exception):
                await msg.term()
            return True
        batch_id = str(body["batch"])
        try:
            if what == "validate":
                await self._validate(batch_id)
                await msg.ack()
                await self._maybe_finish(batch_id)
            elif what == "line":
                if not await self._line(batch_id, cast(LineWork, body), msg):
                    return False
                await msg.ack()
            elif what in self.handlers:
                keep = asyncio.get_running_loop().create_task(self._keep_in_progress(msg))
                try:
                    settled = await self.handlers[what](body)
                finally:
                    keep.cancel()
                if not settled:
                    await msg.nak(delay=1.0)
                    return False
                await msg.ack()
            else:
                await msg.term()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # JetStream away, a bad message: tried again later
            log.warning("batch_work_failed", subject=msg.subject, error=repr(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return False
        return True

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

        def running(rec: BatchRecord) -> bool:
            if not allowed(rec["batch"]["status"], "in_progress"):  # validating only
                return False
            rec["total"] = len(lines)
            rec["batch"]["request_counts"]["total"] = len(lines)
            rec["batch"]["status"] = transition(rec["batch"]["status"], "in_progress")
            rec["batch"]["in_progress_at"] = int(time.time())
            return True

        await self.store.update(batch_id, running)

    async def _fail(self, batch_id: str, errors: list[BatchError]) -> None:
        def failed(rec: BatchRecord) -> bool:
            b = rec["batch"]
            if not allowed(b["status"], "failed"):  # validating or cancelling
                return False
            b["status"], b["failed_at"] = transition(b["status"], "failed"), int(time.time())
            b["errors"] = {"object": "list", "data": errors}
            return True

        rec = await self.store.update(batch_id, failed)
        if rec is not None:
            await self._announce(rec)

    # -- one line -----------------------------------------------------------------------------
    async def _line(self, batch_id: str, body: LineWork, msg: Any) -> bool:
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
        if delivered > 1 and await self.store.answered(batch_id, n):
            # Its runner died after writing the answer, before acknowledging the line: not
            # run (and paid for) again.
            return True
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
        answered: LineResponse = {"status_code": status, "request_id": rid, "body": answer}
        out = _line_out(body, answered, None)
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
            extra={TIMEOUT: self.settings.line_timeout_s},
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

    async def _record(self, batch_id: str, n: int, line: ResultLine, ok: bool) -> None:
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

            def count(rec: BatchRecord, ok: int = ok, bad: int = bad) -> bool:
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

    async def _status(self, batch_id: str) -> BatchRecord | None:
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

        def finalizing(rec: BatchRecord) -> bool:
            b = rec["batch"]
            again = b["status"] == "finalizing"  # taken over only from a finalizer that stopped
            stale = again and now - (b["finalizing_at"] or 0) > STALE_FINALIZING_S
            if not allowed(b["status"], "finalizing") or (again and not stale):
                return False
            if not again:
                rec["ending"] = "cancelled" if b["status"] == "cancelling" else "completed"
            b["status"], b["finalizing_at"] = transition(b["status"], "finalizing"), int(now)
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
        expired = any(
            (e := r.get("error")) is not None and e.get("code") == "batch_expired" for r in bad
        )
        ending: Ending = rec.get("ending") or "completed"
        if ending == "completed" and expired:
            ending = "expired"

        def done(rec: BatchRecord) -> bool:
            b = rec["batch"]
            if b["status"] != "finalizing":
                return False
            b["status"] = transition(b["status"], ending)
            _ended_at(rec, ending, int(time.time()))
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

    async def _announce(self, rec: BatchRecord) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.batch_done(rec["owner"]), json.dumps(rec["batch"]).encode()
            )

    async def _gauges(self, recs: list[BatchRecord]) -> None:
        by: dict[str, int] = dict.fromkeys(STATUSES, 0)
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


def _ended_at(rec: BatchRecord, ending: Ending, at: int) -> None:
    """Stamp the batch's ``<ending>_at``."""
    b = rec["batch"]
    if ending == "completed":
        b["completed_at"] = at
    elif ending == "expired":
        b["expired_at"] = at
    else:
        b["cancelled_at"] = at


def _err(code: str, message: str) -> BatchError:
    return {"code": code, "message": message, "param": None, "line": None}


def _line_out(
    body: LineWork, response: LineResponse | None, error: BatchError | LineError | None
) -> ResultLine:
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


def _jsonl(lines: list[ResultLine]) -> bytes:
    out = []
    for line in sorted(lines, key=lambda r: r["n"]):
        shown = {k: v for k, v in line.items() if k not in ("ok", "n")}
        out.append(json.dumps(shown))
    return ("\n".join(out) + "\n").encode()
