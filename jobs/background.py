"""Background responses (``POST /v1/responses`` with ``background: true``), on the batch
runners (:mod:`jobs.batch_runner`).

The bridge that takes the request validates it, keeps a ``queued`` response under its id in
the response store and queues a ``response`` message on the batch work stream; it answers at
once with the queued response (or, with ``stream: true``, follows its events). A runner, in
any bridge process, takes the message, marks the response ``in_progress`` and runs it
through its own process's Responses API as a streamed request on the key's behalf: every
event it makes is published to ``tb.v1.batch.events.<response id>`` in the stream
``TOKENBUS_BATCH_EVENTS``, and the finished response is written over the queued one.

* ``GET /v1/responses/{id}`` shows where it stands (queued, in_progress, then its end).
* ``GET /v1/responses/{id}?stream=true&starting_after=N`` replays its events after sequence
  number N from JetStream and follows the rest as they come: a client that lost its
  connection resumes where it was.
* ``POST /v1/responses/{id}/cancel`` marks it ``cancelled`` and tells the runner, which stops
  the generation and ends the events with ``response.cancelled``.

NATS clients do the same through ingress (:class:`BackgroundState`:
``Client.background_response``, ``response_cancel``, ``response_events``; ``get_response``
reads the stored response as for any other), as requests on
``tb.v1.req.batches.response_<action>``; the bridges' runners run them.

A runner killed mid-response leaves the message unacknowledged; another runs the response
again from the start after ``batches.ack_wait_s`` (its earlier events are dropped first, so
a follower sees the new run's events, numbered from 0 again). The rerun is sent under the
same request id with the lost run's last admission, kept in the record: the key pays for
one answer (docs/batches.md, "Paid for once").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api

from bus_schemas import errors as E
from bus_schemas import subjects
from dialects import responses as R
from jobs.batches import BatchStore
from jobs.inprocess import BACKGROUND, RERUN, TIMEOUT, App, InProcess
from jobs.job_records import ResponseEnd, ResponseRecord, ResponseWork, RunState
from jobs.response_store import conversation, open_store
from jobs.storage import ResponseStorage, WorkQueue
from services import buckets
from services import logging as tlog
from services.caller import MAX_MIGRATIONS, Rerun
from services.config import Settings
from services.runtime import cancel_and_wait

EVENTS_STREAM = "TOKENBUS_BATCH_EVENTS"
ENDINGS = ("response.completed", "response.failed", "response.incomplete", "response.cancelled")
OPEN = ("queued", "in_progress")
IDLE_CHECK_S = 2.0
log = tlog.get("background")


class Background:
    """Queue, run, follow and cancel background responses."""

    def __init__(
        self,
        nc: NATS,
        store: WorkQueue,
        responses: ResponseStorage,
        app: App | None,
        check: Callable[[dict[str, Any]], object],
    ) -> None:
        """``app``: the process's own HTTP app the runner runs responses through (None: this
        process queues and reads, it runs none); ``check``: how a chat request is validated
        (the gateway's, as for any request), so a bad one is refused when queued."""
        self.nc = nc
        self.check = check
        self.js = nc.jetstream()
        self.store = store
        self.responses = responses
        self.app = app
        self._writes: set[asyncio.Task[None]] = set()  # admissions being kept

    async def open(self, max_age_s: float) -> Background:
        config = api.StreamConfig(
            name=EVENTS_STREAM,
            subjects=[f"{subjects.PREFIX}.batch.events.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=max_age_s,
            num_replicas=self.store_replicas(),
        )
        await buckets.open_stream(self.js, config, stall_s=0)
        return self

    @staticmethod
    def store_replicas() -> int:
        from services.config import kv_replicas

        return kv_replicas()

    async def queue(
        self,
        req: R.ResponsesRequest,
        body: dict[str, Any],
        owner: str,
        previous: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        """Check a background request as any Responses request is checked, keep it
        ``queued`` and queue its run: the queued response (HTTP and NATS clients alike)."""
        turn = R.translate(req, body, previous)
        self.check(turn.chat)  # a bad request is refused now, not later
        b = R.ResponseBuilder(turn, events=False)
        queued = b.response("queued")
        rec = R.record(turn, b, queued, owner)
        rec["background"] = True
        if not await self.responses.put(turn.response_id, rec):
            raise E.ServiceUnavailable("the response store (JetStream) did not answer; retry")
        await self.submit(turn.response_id, owner, body)
        return queued

    async def events(
        self, response_id: str, after: int, cursor: int = 0, limit: int = 1000
    ) -> tuple[list[Any], bool, int]:
        """What a NATS client polls: the response's events numbered after ``after`` that
        JetStream holds now (at most ``limit``), in order; whether one that ends it is among
        those read; and the cursor to read on from (the stream sequence of the last one
        read: the next poll starts after it, not at the response's first event)."""
        from nats.errors import TimeoutError as NatsTimeout

        where: dict[str, Any] = {"deliver_policy": api.DeliverPolicy.ALL}
        if cursor > 0:
            where = {
                "deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE,
                "config": api.ConsumerConfig(opt_start_seq=cursor + 1),
            }
        sub = await self.js.subscribe(
            subjects.batch_events(response_id), ordered_consumer=True, **where
        )
        out: list[Any] = []
        ended = False
        try:
            while len(out) < limit:
                try:
                    msg = await sub.next_msg(timeout=0.25)
                except (NatsTimeout, TimeoutError):
                    break  # none kept (yet)
                cursor = max(cursor, int(msg.metadata.sequence.stream))
                ev = json.loads(msg.data)
                ended = ended or ev.get("type") in ENDINGS
                if int(ev.get("sequence_number", -1)) > after:
                    out.append(ev)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out, ended, cursor

    async def submit(self, response_id: str, owner: str, body: dict[str, Any]) -> None:
        work: ResponseWork = {"batch": response_id, "owner": owner, "body": body}
        await self.store.publish(response_id, "response", work, response_id)

    # -- following ----------------------------------------------------------------------------
    async def follow(
        self, response_id: str, owner: str, after: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The response's events numbered after ``after``, replayed from JetStream, then
        live, until one that ends it (the HTTP handler writes them as server-sent events)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def on_event(msg: Any) -> None:
            queue.put_nowait(msg.data)

        sub = await self.js.subscribe(
            subjects.batch_events(response_id),
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        try:
            while True:
                try:
                    data = await asyncio.wait_for(queue.get(), IDLE_CHECK_S)
                except TimeoutError:
                    # Quiet: a response that ended while its events aged out ends here too.
                    rec = await self.responses.get(response_id, owner)
                    if rec["response"]["status"] not in OPEN and queue.empty():
                        end: ResponseEnd = {
                            "type": f"response.{rec['response']['status']}",
                            "response": rec["response"],
                            "sequence_number": after + 1,
                        }
                        yield dict(end)
                        break
                    continue
                ev = json.loads(data)
                if int(ev.get("sequence_number", -1)) <= after:
                    continue
                after = int(ev["sequence_number"])
                yield ev
                if ev.get("type") in ENDINGS:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def events_kept(self, response_id: str) -> int:
        """How many events of the response JetStream holds now: its progress while it runs
        (the streaming events so far, a text delta per piece of text the engine sent)."""
        subject = subjects.batch_events(response_id)
        info = await self.js.stream_info(EVENTS_STREAM, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    # -- cancelling ---------------------------------------------------------------------------
    async def cancel(self, response_id: str, rec: ResponseRecord) -> dict[str, Any]:
        """Mark an open background response cancelled and tell its runner; a finished one
        is answered as it is."""
        resp: dict[str, Any] = rec["response"]
        if resp["status"] in OPEN:
            queued = resp["status"] == "queued"
            resp["status"] = "cancelled"
            await self.responses.replace(response_id, rec)
            with contextlib.suppress(Exception):
                await self.nc.publish(subjects.batch_cancel(response_id), b"")
            if queued:  # no runner will: its events end here (a runner that just took it
                # drops them, and ends its own with response.cancelled)
                with contextlib.suppress(Exception):
                    end: ResponseEnd = {
                        "type": "response.cancelled",
                        "response": resp,
                        "sequence_number": 0,
                    }
                    await _Events(self.js, subjects.batch_events(response_id)).publish(end)
        return resp

    # -- running (a batch runner's work) ------------------------------------------------------
    async def run(self, body: ResponseWork) -> bool:
        """Run one background response (see the module docstring); True: settled."""
        response_id, owner = str(body["batch"]), str(body.get("owner") or "")
        cancelled = asyncio.Event()

        async def on_cancel(_msg: Any) -> None:
            cancelled.set()

        # Listening before it reads the record: a cancel sent from here on is heard, one sent
        # before is in the record.
        sub = await self.nc.subscribe(subjects.batch_cancel(response_id), cb=on_cancel)
        try:
            return await self._run(response_id, owner, body, cancelled)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _run(
        self, response_id: str, owner: str, body: ResponseWork, cancelled: asyncio.Event
    ) -> bool:
        try:
            rec = await self.responses.get(response_id, owner)
        except E.NotFound:
            return True  # deleted meanwhile
        if rec["response"]["status"] not in OPEN:
            return True  # cancelled before it ran, or run already
        # Which run this is: a run before it died (its runner lost before the end was kept)
        # if the record says so. This run numbers its attempts after every attempt that run
        # could have made, under the same request id, and sends the admission of its last
        # one: the limiter charges that attempt nothing, so the response is paid for once.
        run: RunState = rec.get("run") or {}
        rerun = Rerun(
            first=int(run.get("next", 0) or 0),
            ticket=str(run.get("ticket") or ""),
            on_accept=lambda n, t: self._admitted(response_id, n, t),
        )
        rid = str(run.get("rid") or uuid.uuid4().hex)
        rec["run"] = {**run, "rid": rid, "next": rerun.first + MAX_MIGRATIONS + 1}
        rec["response"]["status"] = "in_progress"
        if not await self.responses.replace(response_id, rec):
            return False  # not run unnumbered: tried again from the queue
        if rerun.first:
            log.info(
                "background_rerun",
                response_id=response_id,
                first_attempt=rerun.first,
                lost_run_admitted=bool(rerun.ticket),
            )
        with contextlib.suppress(Exception):  # a run before this one died: start afresh
            await self.js.purge_stream(EVENTS_STREAM, subject=subjects.batch_events(response_id))
        events = _Events(self.js, subjects.batch_events(response_id))
        task = asyncio.get_running_loop().create_task(
            self._request(response_id, owner, dict(body["body"]), events, rid, rerun)
        )
        stop = asyncio.get_running_loop().create_task(cancelled.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                # The app writes the response's end over its record; a write it could not
                # make (JetStream stalled past its patience) leaves the record open, and
                # the work goes back to the queue to be run again, not acknowledged.
                return await self._ended(response_id, owner)
            events.closed = True  # what the request says as it is torn down is not its end
            # Cancelled until it ends: Python 3.11's wait_for (inside nats-py's publish and
            # request) swallows a cancellation that lands as its future completes, and the
            # request then ran on to its end (seen in CI as a cancel that never ended).
            await cancel_and_wait(task, within_s=math.inf)
            latest = await self.responses.get(response_id, owner)
            latest["response"]["status"] = "cancelled"
            await self.responses.replace(response_id, latest)
            cancelled_end: ResponseEnd = {
                "type": "response.cancelled",
                "response": latest["response"],
                "sequence_number": events.last + 1,
            }
            await events.publish(cancelled_end)
            return True
        finally:
            stop.cancel()

    async def _ended(self, response_id: str, owner: str) -> bool:
        """Whether the record says the response ended (a record gone counts as ended)."""
        try:
            rec = await self.responses.get(response_id, owner)
        except E.NotFound:
            return True
        if rec["response"]["status"] in OPEN:
            log.warning("background_end_not_stored", response_id=response_id)
            return False
        return True

    def _admitted(self, response_id: str, attempt: int, ticket: str) -> None:
        """An attempt of the run was admitted: its ticket is kept in the record (while the
        response is open) for a rerun to send."""
        task = asyncio.get_running_loop().create_task(
            self._keep_admission(response_id, attempt, ticket)
        )
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _keep_admission(self, response_id: str, attempt: int, ticket: str) -> None:
        def keep(rec: dict[str, Any]) -> dict[str, Any]:
            run = rec.get("run") or {}
            if rec.get("response", {}).get("status") not in OPEN:
                raise _Kept  # ended (or gone): nothing to run again
            if int(run.get("attempt", -1)) >= attempt:
                raise _Kept  # a later attempt's kept already
            return {**rec, "run": {**run, "attempt": attempt, "ticket": ticket}}

        try:
            await buckets.cas(await self.responses.opened(), response_id, keep)
        except _Kept:
            pass
        except Exception as exc:  # a rerun then pays for this run's attempt too
            log.warning("background_admission_not_kept", response_id=response_id, error=repr(exc))

    async def _request(
        self,
        response_id: str,
        owner: str,
        body: dict[str, Any],
        events: _Events,
        rid: str,
        rerun: Rerun,
    ) -> None:
        assert self.app is not None, "a runner runs through its process's app"
        body["stream"] = True
        req = InProcess(
            "/v1/responses",
            body,
            owner,
            headers=[(b"x-request-id", rid.encode())],
            extra={
                BACKGROUND: response_id,
                RERUN: rerun,
                TIMEOUT: self.store.settings.line_timeout_s,
            },
            on_body=events.feed,
        )
        await req.run(self.app)
        status, error = req.status, req.answer
        # Cancelled (closed): the app may answer a cancelled request as a client that left,
        # before any status; run() ends it as cancelled, not failed.
        if status != 200 and not events.closed:
            await self._failed(response_id, owner, status, error, events)

    async def _failed(
        self, response_id: str, owner: str, status: int, raw: bytes, events: _Events
    ) -> None:
        """Refused before it ran (its key revoked since, no replica...): failed, with the
        error an HTTP client would have had."""
        try:
            err = json.loads(raw).get("error") or {}
        except ValueError:
            err = {}
        rec = await self.responses.get(response_id, owner)
        rec["response"]["status"] = "failed"
        rec["response"]["error"] = {
            "code": str(err.get("code") or status),
            "message": str(err.get("message") or "the response could not be run"),
        }
        if not await self.responses.replace(response_id, rec):
            raise E.ServiceUnavailable(f"{response_id}: its failure could not be stored; retry")
        failed: ResponseEnd = {
            "type": "response.failed",
            "response": rec["response"],
            "sequence_number": events.last + 1,
        }
        await events.publish(failed)


class _Kept(Exception):
    """Nothing to keep: the response ended, or a later attempt's ticket is kept."""


class _Events:
    """Server-sent event text in, events out to JetStream, in order."""

    def __init__(self, js: Any, subject: str) -> None:
        self.js = js
        self.subject = subject
        self.buf = b""
        self.last = -1
        self.closed = False  # cancelled: the request's own last words are dropped
        self.run = uuid.uuid4().hex[:12]  # this run's events (a rerun starts over)

    async def feed(self, chunk: bytes) -> None:
        if self.closed:
            return
        self.buf += chunk
        while b"\n\n" in self.buf:
            block, self.buf = self.buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data: "):
                    ev = json.loads(line[6:])
                    self.last = max(self.last, int(ev.get("sequence_number", self.last)))
                    await self.publish(ev)

    async def publish(self, ev: Mapping[str, Any]) -> None:
        """One event, through a stalled stream leader too: its id (the response's subject,
        this run, the event's sequence number) makes a repeat a no-op."""
        data = json.dumps(ev).encode()
        seq = ev.get("sequence_number")
        ident = f"{self.subject}.{self.run}.{seq}" if isinstance(seq, int) else uuid.uuid4().hex
        hdrs = {"Nats-Msg-Id": ident}
        # The events' stream exists (opened before the run): "no response from stream" is
        # its leader gone for the moment, not a stream to make.
        await buckets.through_stall(
            lambda: self.js.publish(self.subject, data, stream=EVENTS_STREAM, headers=hdrs),
            what="background response event",
            stream_exists=True,
        )


class BackgroundState:
    """Background responses for NATS clients: ingress answers the ``response_*`` actions of
    ``tb.v1.req.batches`` (:class:`~jobs.batches.BatchState` hands them here, with the
    owner it checked and its batch store). The response store and the events stream open at
    the first request."""

    ACTIONS = tuple(a for a in subjects.BATCH_ACTIONS if a.startswith("response_"))

    def __init__(
        self, nc: NATS, settings: Settings, check: Callable[[dict[str, Any]], object]
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.check = check
        self.bg: Background | None = None
        self._opening = asyncio.Lock()

    async def _open(self, store: BatchStore) -> Background:
        async with self._opening:
            if self.bg is None:
                responses = await open_store(self.nc, self.settings.responses)
                self.bg = await Background(self.nc, store, responses, None, self.check).open(
                    self.settings.responses.ttl_s
                )
        return self.bg

    async def handle(
        self, action: str, owner: str, body: dict[str, Any], store: BatchStore
    ) -> dict[str, Any]:
        bg = await self._open(store)
        if action == "response_create":
            raw = body.get("body")
            if not isinstance(raw, dict):
                raise E.InvalidRequest("response_create needs the request as 'body'")
            req = R.parse(raw)
            if not req.background:
                raise E.InvalidRequest(
                    "response_create runs background responses: set background to true "
                    "(or stream the response with Client.responses)",
                    param="background",
                )
            previous = await conversation(bg.responses, req.previous_response_id, owner)
            return {"response": await bg.queue(req, raw, owner, previous)}
        ident = body.get("id")
        if not isinstance(ident, str) or not ident:
            raise E.InvalidRequest(f"{action} needs an 'id'", param="id")
        rec = await bg.responses.get(ident, owner)
        if not rec.get("background"):
            raise E.InvalidRequest(
                "only background responses keep events and can be cancelled", param="id"
            )
        if action == "response_cancel":
            return {"response": await bg.cancel(ident, rec)}
        after, cursor = body.get("starting_after", -1), body.get("cursor", 0)
        for name, v in (("starting_after", after), ("cursor", cursor)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise E.InvalidRequest(f"{name}: an integer", param=name)
        events, ended, cursor = await bg.events(ident, after, max(0, cursor))
        return {"events": events, "ended": ended, "cursor": cursor}
