"""Per-request records: every stage's timestamps turned into the latency breakdown.

The DESIGN.md definitions: t0 the client sends, t1 the gateway receives, t2 the engine
starts, t3 the engine has the first token, t4 the gateway gets it, t5 the client gets it,
t6 the client gets the last. Gateway latency = (t2 - t0) + (t5 - t3); engine latency =
t3 - t2.

A worker publishes a record for every request it served (``source: worker``: what the
engine saw, for NATS and HTTP callers alike); the HTTP bridge publishes the complete one
for its requests (``source: http``: t1, t5, t6 and the status too). Both go to
``tb.v1.telemetry.request``, fire and forget: a telemetry service that is down or slow never
slows or fails a request. The telemetry service merges them by request id.

A process sends its records together (:class:`Recorder`): the records of up to
``BATCH_WINDOW_S`` in one message, ``{"records": [...]}``, a lone record as itself. Under load
that is one message every 50 ms per process instead of one per request, for the publisher,
nats-server and the telemetry service alike; a record reaches the service at most 50 ms
later, and is sent at once when the process stops. A worker sends the records of requests
that ended with an answer in the same loop turn, ahead of their final frames on the same
connection (:meth:`Recorder.send_now`, engine_worker/outbox.py): a worker killed right after
an answer has handed its record to the bus already.

Records survive a telemetry outage: the subject is captured by the JetStream stream
:data:`STREAM` (``TOKENBUS_USAGE``), and the recorder publishes each message with an id
(``Nats-Msg-Id``, the stream drops a repeat) and waits for the stream's ack off the request's
path, trying again with the same id (a stream whose leader was lost answers "no leader" for
the seconds its replicas take to elect another: nats-server waits 4 to 9 s before an
election, and a node that restarts must catch up first; a site's link to the hub may be cut
for minutes). A message the stream has not acknowledged after :data:`PUBLISH_FOR_S` is
counted in ``tokenbus_telemetry_publish_overdue_total`` and tried every
:data:`PUBLISH_SLOW_S` while the process runs; one it could not even hold (past
:data:`MAX_IN_FLIGHT` waiting) in ``tokenbus_telemetry_publish_failed_total``; never
raised. A worker's usage
reports that settle spend (services/usage.py) go the same way (:meth:`Recorder.send_first`):
the spend stream keeps them, and a report it did not take is a request never charged. Each
record is known by :func:`record_id`, with which the telemetry service stores it once,
however often it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from prometheus_client import Counter

from bus_schemas import codec, subjects
from services import config
from services import logging as tlog
from services.buckets import open_stream
from telemetry.spool import SYNC_EVERY_S, Entry, Spool
from telemetry.store import record_id as record_id  # re-exported: what a record is known by

# Marks a request collects on its way, in path order (Tb-Timings; see bus_schemas.marks).
PATH = ("t0", "ingress", "auth", "ratelimit", "filter", "route", "engine_start")
STAGES = ("ingress", "auth", "ratelimit", "filter", "route")


def subject() -> str:
    return f"{subjects.PREFIX}.telemetry.request"


# The stream that keeps records until a telemetry service stored them (docs/telemetry.md,
# "Durability"), and the durable consumer every telemetry service shares.
STREAM = subjects.RECORDS_STREAM
CONSUMER = subjects.RECORDS_CONSUMER
MSG_ID = "Nats-Msg-Id"
DUPLICATE_WINDOW_S = 120.0  # the stream drops a message id it saw this recently


def stream_config(cfg: config.TelemetrySettings | None = None) -> api.StreamConfig:
    """The records' stream: file storage, limits retention (the consumer's acks do not remove
    a record: a store rebuilt from scratch can read the last ``stream_max_age_s`` again),
    bounded in age and bytes, the oldest dropped first, replicated as the buckets are."""
    cfg = cfg or config.Settings().telemetry
    return api.StreamConfig(
        name=STREAM,
        description="tokenbus per-request usage records (docs/telemetry.md)",
        subjects=[subject()],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.OLD,
        max_age=cfg.stream_max_age_s,
        max_bytes=cfg.stream_max_bytes,
        num_replicas=config.kv_replicas(),
        duplicate_window=DUPLICATE_WINDOW_S,
    )


# Records a publisher could not hand to the stream (no ack after every try): in each
# publishing process's default registry (the bridge's /metrics).
PUBLISH_FAILED = Counter(
    "tokenbus_telemetry_publish_failed_total",
    "Usage records the telemetry stream never acknowledged (lost unless a later try landed)",
)
SPEND_PUBLISH_FAILED = Counter(
    "tokenbus_spend_report_publish_failed_total",
    "Usage reports that settle spend the spend stream never acknowledged (their requests' "
    "holds expire uncharged unless the admitting limiter heard them)",
)
PUBLISH_OVERDUE = Counter(
    "tokenbus_telemetry_publish_overdue_total",
    "Messages (usage records, spend reports) their stream had not acknowledged after "
    "PUBLISH_FOR_S; still tried, every PUBLISH_SLOW_S, while the process runs",
)
PUBLISH_ACK_S = 2.0  # how long one try waits for the stream's ack
# Tries go on at once this long, inside the streams' duplicate windows (two minutes: a try
# whose first copy landed unacknowledged is dropped as a repeat), so a leader election
# (seconds) or a node restarting costs no record and no repeat in the stream. Past it a
# message is overdue (counted, logged) and tried every PUBLISH_SLOW_S for as long as the
# process runs: a site whose link to the hub is cut for minutes (issue 71) delivers its
# records when the link is back. A repeat past the window is one more copy in the stream,
# which its readers drop: the telemetry store keeps a record once by its id, a spend hold
# settles once.
PUBLISH_FOR_S = 60.0
PUBLISH_SLOW_S = 5.0
PUBLISH_BACKOFF_S = (0.1, 0.25, 0.5, 1.0)  # then every second, each spread by ±25 %
MAX_IN_FLIGHT = 8192  # messages waiting for their ack; beyond, a new one counts as failed


def _ms(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1e6, 3)


def stage_ms(timings: dict[str, int]) -> dict[str, float]:
    """Time spent in each stage: from the previous mark on the path to the stage's own."""
    out: dict[str, float] = {}
    prev: int | None = None
    for name in PATH:
        ts = timings.get(name)
        if ts is None:
            continue
        if prev is not None and name in STAGES:
            out[name] = round(max(0, ts - prev) / 1e6, 3)
        prev = ts
    return out


def build(
    *,
    request_id: str,
    source: str,
    model: str,
    timings: dict[str, int],
    outcome: str,
    replica: str | None = None,
    principal: str | None = None,
    kind: str | None = None,
    status: int | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    migrations: int = 0,
    trace_id: str | None = None,
    usage_source: str | None = None,
    streamed: bool = True,
    t1: int | None = None,
    t4: int | None = None,
    t5: int | None = None,
    t6: int | None = None,
    client_request_id: str | None = None,
    cached_tokens: int | None = None,
    kv_predicted_tokens: int | None = None,
    kv_router: str | None = None,
) -> dict[str, Any]:
    """One request's record (times in ms, timestamps in epoch ns). ``request_id`` is the
    gateway's own; ``client_request_id`` the label the client gave it (``X-Request-Id``)."""
    t0 = timings.get("t0") or t1
    t2, t3 = timings.get("engine_start"), timings.get("first_token")
    end = t6 or timings.get("engine_end")
    first = t5 or t3
    gateway = None
    if t0 is not None and t2 is not None and first is not None and t3 is not None:
        gateway = round(((t2 - t0) + (first - t3)) / 1e6, 3)
    tbt = None
    # A whole (non-streamed) answer reaches the client at once: t5 is its arrival, and there
    # is no time between tokens to speak of.
    if streamed and first is not None and end is not None and completion_tokens > 1:
        tbt = round((end - first) / 1e6 / (completion_tokens - 1), 3)
    stages = stage_ms(timings)
    return {
        "request_id": request_id,
        "client_request_id": client_request_id,
        "source": source,
        "ts_ns": t0 or t1 or 0,
        "model": model,
        "replica": replica,
        "principal": principal,
        "kind": kind,
        "outcome": outcome,
        "status": status,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "migrations": migrations,
        "trace_id": trace_id,
        # Where prompt_tokens came from when the engine did not count them (an upstream
        # without usage on streams: "tokenized" or "estimate"; "upstream": it said).
        "usage_source": usage_source,
        # The closed loop on KV-cache hits (docs/routing.md): the prompt tokens the engine
        # read from its cache as it reported them (None: it did not say), and those the
        # router that chose the replica predicted from its KV index (None: no prediction),
        # with that router's id.
        **({"cached_tokens": cached_tokens} if cached_tokens is not None else {}),
        **(
            {"kv_predicted_tokens": kv_predicted_tokens, "kv_router": kv_router}
            if kv_predicted_tokens is not None
            else {}
        ),
        "ttft_ms": _ms(t0, first),
        "tbt_ms": tbt,
        "e2e_ms": _ms(t0, end),
        "gateway_ms": gateway,
        "engine_ms": _ms(t2, t3),
        "prefill_ms": _ms(t2, t3),
        "decode_ms": _ms(t3, timings.get("engine_end")),
        "relay_ms": _ms(t3, first) if t5 and streamed else None,
        "streamed": streamed,
        "stages": stages,
        "t": {k: v for k, v in {**timings, "t1": t1, "t4": t4, "t5": t5, "t6": t6}.items() if v},
    }


BATCH_WINDOW_S = 0.05  # the longest a record waits for others to go with
BATCH_MAX = 64  # records in one message at most (a few hundred bytes each)


def batch(data: dict[str, Any]) -> list[Any]:
    """The records of one message: the list of a batch, or the message itself."""
    recs = data.get("records") if "request_id" not in data else None
    return recs if isinstance(recs, list) else [data]


def spool_for(cfg: config.TelemetrySettings, role: str, name: str) -> Spool | None:
    """The spool of a process ``name`` of ``role`` where ``telemetry.spool_dir`` is set: a
    folder per role, so what a process takes over it may publish itself."""
    return Spool(Path(cfg.spool_dir) / role, name) if cfg.spool_dir else None


class Recorder:
    """One connection's records, sent together: fire and forget for the caller, never raises,
    never waits for the telemetry service. Each message waits for the stream's ack in a
    task of its own (tried again with the same message id until acknowledged, so the stream
    keeps it once while inside its duplicate window); one overdue is counted
    (:data:`PUBLISH_OVERDUE`, :attr:`overdue`), one not held at all too
    (:data:`PUBLISH_FAILED`, :attr:`failed`)."""

    def __init__(self, nc: NATS, spool: Spool | None = None) -> None:
        self.nc = nc
        # Written down before it leaves, until acknowledged (telemetry.spool_dir): a
        # process killed while its messages wait for a stream's ack has them sent again by
        # the next one (telemetry/spool.py). :meth:`open` takes over what the gone left.
        self.spool = spool
        self._syncing: asyncio.Task[None] | None = None
        self._batch: list[dict[str, Any]] = []
        self._first: list[tuple[str, bytes]] = []  # spend reports for the next send_now
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.messages = 0
        self.failed = 0  # records never acknowledged by the stream
        self.failed_reports = 0  # spend reports never acknowledged by theirs
        self.acked = 0  # messages the stream acknowledged (a repeat it dropped included)
        self.retries = 0  # tries that got no ack (each tried again until acknowledged)
        self.overdue = 0  # messages past PUBLISH_FOR_S without an ack, still tried
        self._warned: dict[str, float] = {}  # when each warning was last logged
        # Acks come back under an inbox of this recorder's own (the locked bus lets
        # publishers read ``subjects.records_ack_root()`` and nothing else of other inboxes).
        self._root = f"{subjects.records_ack_root()}.{uuid.uuid4().hex[:12]}"
        self._acks: dict[str, asyncio.Future[bytes]] = {}
        self._ack_sub: Any = None
        self._subscribing = asyncio.Lock()
        self._seq = itertools.count()
        self._made_stream = False

    async def open(self) -> Recorder:
        """With a spool: open it, send again what gone processes' spools still owe, and
        sync it to disk every :data:`spool.SYNC_EVERY_S` from here on."""
        if self.spool is not None:
            for e in await asyncio.to_thread(self.spool.open):
                self._spawn(self._publish(e.data, e.n, e.msg_id, None, e.subject))
            self._syncing = asyncio.get_running_loop().create_task(self._sync())
        return self

    async def _sync(self) -> None:
        spool = self.spool
        assert spool is not None
        while True:
            await asyncio.sleep(SYNC_EVERY_S)
            if spool.dirty:
                await asyncio.to_thread(spool.sync)

    def _write_down(self, msg_id: str, to: str, n: int, data: bytes) -> None:
        if self.spool is not None:
            self.spool.put(Entry(msg_id, to, n, data))

    def add(self, record: dict[str, Any]) -> None:
        self._batch.append(record)
        if len(self._batch) >= BATCH_MAX:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(BATCH_WINDOW_S, self._send)

    def send_first(self, subject: str, data: bytes) -> None:
        """A message for a stream other than the records' (a spend report), handed to the
        connection by the next :meth:`send_now` ahead of the records, and tried again as
        they are until its stream acknowledges it."""
        self._first.append((subject, data))

    def _take(self) -> tuple[bytes, int] | None:
        """The waiting records as one message (None: nothing to send, or no room)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        recs, self._batch = self._batch, []
        if not recs:
            return None
        try:
            data = codec.encode(recs[0] if len(recs) == 1 else {"records": recs})
        except Exception:  # a record that cannot be encoded: fire and forget, never raise
            return None
        self.messages += 1
        if len(self._sending) >= MAX_IN_FLIGHT:
            self._lost(len(recs), "too many records waiting for the stream's ack")
            return None
        return data, len(recs)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _send(self) -> None:
        taken = self._take()
        if taken is not None:
            data, n = taken
            msg_id = uuid.uuid4().hex
            self._write_down(msg_id, "", n, data)
            self._spawn(self._publish(data, n, msg_id))

    @property
    def waiting(self) -> bool:
        """Whether records or reports wait to leave."""
        return bool(self._batch or self._first)

    async def send_now(self) -> None:
        """Hand the waiting records to the connection before this returns, ahead of what is
        published after it (a worker's final frames: the record of a request reaches the bus
        before its caller hears that it ended, so a process killed right after an answer
        has not lost its record). The stream's ack is waited for off the caller's path."""
        first, self._first = self._first, []
        for to, data in first:
            if len(self._sending) >= MAX_IN_FLIGHT:
                self._lost(0, "too many messages waiting for their stream's ack")
                continue
            await self._put_then_publish(data, 0, to)
        taken = self._take()
        if taken is not None:
            await self._put_then_publish(*taken)

    async def _put_then_publish(self, data: bytes, n: int, to: str = "") -> None:
        """Hand ``data`` to the connection now, then wait for its ack (and try again) in a
        task of its own: ``n`` records on the records' subject, or a report on ``to``."""
        msg_id = uuid.uuid4().hex
        self._write_down(msg_id, to, n, data)
        put = await self._put(data, msg_id, to)
        self._spawn(self._publish(data, n, msg_id, put, to))

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._acks.pop(msg.subject, None)
        if fut is not None and not fut.done():
            status = (msg.headers or {}).get("Status", "")
            fut.set_result(b'{"error":{"code":503}}' if status == "503" else msg.data)

    async def _put(
        self, data: bytes, msg_id: str, to: str = ""
    ) -> tuple[str, asyncio.Future[bytes]]:
        """Hand one message to the connection (on ``to``, the records' subject by default):
        (the inbox its ack comes to, the ack)."""
        async with self._subscribing:  # one subscription, however many publish at first
            if self._ack_sub is None:
                self._ack_sub = await self.nc.subscribe(f"{self._root}.*", cb=self._on_ack)
        inbox = f"{self._root}.{next(self._seq)}"
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._acks[inbox] = fut
        try:
            await self.nc.publish(to or subject(), data, reply=inbox, headers={MSG_ID: msg_id})
        except Exception as exc:  # no connection: this try failed
            fut.set_exception(exc)
        return inbox, fut

    async def _try(
        self,
        data: bytes,
        msg_id: str,
        put: tuple[str, asyncio.Future[bytes]] | None = None,
        to: str = "",
    ) -> bool:
        """One publish (or the one ``put`` made already); whether the stream acknowledged
        it."""
        inbox = ""
        try:
            inbox, fut = put if put is not None else await self._put(data, msg_id, to)
            answer = await asyncio.wait_for(fut, PUBLISH_ACK_S)
        except Exception:  # no connection, no ack in time
            return False
        finally:
            self._acks.pop(inbox, None)
        try:
            ack = json.loads(answer)
        except ValueError:
            return False
        if isinstance(ack, dict) and "error" not in ack and "seq" in ack:
            return True
        if isinstance(ack, dict) and not self._made_stream and not to:
            # No stream yet (no telemetry service ever ran on this bus): make it when this
            # connection may (the bridge may; a worker on the locked bus may not).
            self._made_stream = True
            with contextlib.suppress(Exception):
                await open_stream(self.nc.jetstream(timeout=2), stream_config(), stall_s=2)
        return False

    async def _publish(
        self,
        data: bytes,
        n: int,
        msg_id: str = "",
        put: tuple[str, asyncio.Future[bytes]] | None = None,
        to: str = "",
    ) -> None:
        """Try until the stream acknowledges: at once for :data:`PUBLISH_FOR_S`, then, the
        message counted overdue, every :data:`PUBLISH_SLOW_S` while the process runs (a
        process that stops leaves it in its spool, if it has one). ``n``: the records the
        message holds (0: a spend report on ``to``)."""
        msg_id = msg_id or uuid.uuid4().hex
        overdue_at = time.monotonic() + PUBLISH_FOR_S
        overdue = False
        for i in itertools.count():
            if await self._try(data, msg_id, put if i == 0 else None, to):
                self.acked += 1
                if overdue:
                    self.overdue -= 1
                if self.spool is not None:
                    self.spool.acked(msg_id)
                return
            self.retries += 1
            wait = PUBLISH_BACKOFF_S[min(i, len(PUBLISH_BACKOFF_S) - 1)]
            if not overdue and time.monotonic() + wait >= overdue_at:
                overdue = True
                self._overdue(n, to)
            if overdue:
                wait = PUBLISH_SLOW_S
            await asyncio.sleep(wait * random.uniform(0.75, 1.25))  # many messages spread

    def _overdue(self, n: int, to: str) -> None:
        """A message (``n`` records; 0: a spend report) not acknowledged in PUBLISH_FOR_S."""
        self.overdue += 1
        PUBLISH_OVERDUE.inc()
        self._warn(
            "telemetry_publish_overdue",
            records=n,
            overdue_now=self.overdue,
            why=f"{'the spend' if to else 'the telemetry'} stream has not acknowledged "
            f"for {PUBLISH_FOR_S:g} s; still trying every {PUBLISH_SLOW_S:g} s",
        )

    def _warn(self, event: str, **fields: Any) -> None:
        """Log ``event``, one line a minute at most of each event."""
        now = time.monotonic()
        if now - self._warned.get(event, -1e9) > 60:
            self._warned[event] = now
            tlog.get("telemetry").warning(event, **fields)

    def _lost(self, n: int, why: str) -> None:
        """``n`` records (0: one spend report) given up."""
        if n:
            self.failed += n
            PUBLISH_FAILED.inc(n)
        else:
            self.failed_reports += 1
            SPEND_PUBLISH_FAILED.inc()
        self._warn(
            "telemetry_publish_failed",
            records=n,
            failed_total=self.failed,
            spend_reports_failed=self.failed_reports,
            why=why,
        )

    async def flush(self) -> None:
        """Send what waits now and give it up to 2 s to be acknowledged (a stopping
        process)."""
        self._send()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=2.0)
        if self._syncing is not None:
            self._syncing.cancel()
            self._syncing = None
        if self.spool is not None:  # kept where something is owed: the next one sends it
            await asyncio.to_thread(self.spool.close)
