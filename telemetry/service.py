"""The telemetry service: per-request records into Prometheus metrics and the store (SQLite or
PostgreSQL).

``tokenbus serve telemetry``. Records come from the JetStream stream ``TOKENBUS_USAGE``
(which captures ``tb.v1.telemetry.request``) through the durable pull consumer ``telemetry``
that every telemetry service shares (run several: each message goes to one of them). A
message is acknowledged only once its records are committed to the store, and the store
applies a record once by its id: a service killed with records in its buffer loses none (the
stream delivers them again, to it or another), and a redelivery counts nothing twice. The
buffer is bounded (``max_buffer``): full, the service fetches no more until it has written,
and the rest waits in the stream. Heartbeats feed the per-replica load gauges.

A bus without JetStream for the telemetry role (no JetStream, or an old locked-bus config)
gets the records as before: a core subscription in the queue group ``telemetry``, where a
record published while no service runs is lost, and a full buffer drops new ones (counted).

Every ``probe_interval_s`` it also looks at the bus the way an operator would: the round trip
to the NATS server, which tokenbus services answer a ``$SRV.PING`` (a service that lost its
connection stops answering), and whether the API-key store's stream answers. The answers come
back under the service's own inbox root, the one subject tree the locked bus lets the
telemetry role read besides records and heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

from nats.aio.msg import Msg
from nats.js import api
from prometheus_client import start_http_server

from bus_schemas import codec, subjects
from services.buckets import open_stream
from services.discovery import API_PREFIX
from services.runtime import Service, cancel_and_wait, connect
from telemetry import natsmon, records
from telemetry.metrics import Metrics
from telemetry.store import open_store

__all__ = ["INBOX_ROOT", "KEYS_INFO", "PING", "Metrics", "Telemetry"]

# The JetStream stream behind the API-key bucket (auth.store.BUCKET, "tokenbus_keys"; an actor
# may not import another, tests/test_layers.py): its STREAM.INFO is the key store's probe, a
# read of the stream's state that sees no key.
KEYS_INFO = "$JS.API.STREAM.INFO.KV_tokenbus_keys"
# The file store's stream (jobs.files.BUCKET): how full it is, for an alert before it is.
FILES_INFO = "$JS.API.STREAM.INFO.OBJ_tokenbus_files"
PING = f"{API_PREFIX}.PING"
# Where the probes' answers come back (services/natsconf.py lets the telemetry role read it).
INBOX_ROOT = subjects.inbox_prefix("telemetry")
_STREAM_NOT_FOUND = 10059  # JetStream's error code for it
_SERVICE_PREFIX = "tokenbus-"  # discovery names: "tokenbus-<service>" (services.runtime)
FETCH_MAX = 256  # messages one fetch asks for at most
# A consumer that could not be bound at start is tried again after this, then less often.
BIND_RETRY_S = 2.0
_SEEN_KEPT = 200_000  # record ids whose metrics this process counted (redeliveries skip them)


class Telemetry(Service):
    """Records to metrics and to disk."""

    name = "telemetry"
    forwards = False  # answers and reports; never hands a request on

    async def _connect(self) -> Any:
        """Its own connection, with its inbox root as the prefix of every reply subject (the
        JetStream API's answers and fetched records too: the locked bus lets it read there)."""
        return await connect(
            self.settings.url(),
            f"tokenbus-{self.name}-{self.id}",
            on_reconnected=self.on_reconnected,
            inbox_prefix=INBOX_ROOT,
            **self.settings.nats_auth(),
        )

    async def setup(self) -> None:
        cfg = self.settings.telemetry
        self.cfg = cfg
        self.metrics = Metrics()
        self.store = open_store(cfg)  # SQLite, or PostgreSQL (telemetry.store)
        self.buffer: list[dict[str, Any]] = []
        self._acks: list[Msg] = []  # stream messages whose records wait in the buffer
        self._acking: set[asyncio.Task[None]] = set()
        self._seen: dict[str, None] = {}  # record ids counted in the metrics (oldest first)
        self.written = 0
        self.durable = False
        self._fetcher: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        self._buffered = asyncio.Event()  # set once a record waits: idle, the flusher sleeps
        self._full = asyncio.Event()  # the buffer is full: write now
        self._room = asyncio.Event()  # a write made room: fetch again
        psub = await self._open_consumer()
        self._subs = [
            await self.nc.subscribe(subjects.heartbeat_wildcard(), cb=self._on_heartbeat),
            await self.nc.subscribe(
                subjects.telemetry(subjects.TELEMETRY_QUEUE), cb=self._on_queue_report
            ),
            await self.nc.subscribe(
                subjects.telemetry(subjects.TELEMETRY_BUDGET), cb=self._on_budget
            ),
        ]
        self._core: Any = None  # the records' core subscription, while not durable
        self._durable_later: asyncio.Task[None] | None = None
        if psub is not None:
            self._go_durable(psub)
        else:
            self._core = await self.nc.subscribe(
                records.subject(),
                queue=subjects.QUEUE_TELEMETRY,
                cb=self._on_record,
                pending_msgs_limit=max(100_000, cfg.max_buffer),
            )
            # The stream may only be without a leader as this starts (its node down): the
            # consumer is tried again, and taken over from the core subscription once bound.
            self._durable_later = loop.create_task(self._bind_later())
        self._flusher = loop.create_task(self._flush_loop())
        self.metrics.health.nc = self.nc
        self._inbox = f"{INBOX_ROOT}.{self.id}"
        self._seq = itertools.count()
        self._blind_logged = False
        self._prober = loop.create_task(self._probe_loop()) if cfg.probe_interval_s else None
        self.http: Any = None
        if cfg.metrics_port:
            try:
                self.http = start_http_server(
                    cfg.metrics_port, addr=cfg.metrics_host, registry=self.metrics.registry
                )
            except OSError as exc:
                # Another stack's telemetry on this host, most often: the records are still
                # stored, only this endpoint is off. Said once, with what to change.
                self.log.warning(
                    "metrics_port_taken",
                    port=cfg.metrics_port,
                    error=exc.strerror or str(exc),
                    hint="metrics endpoint off; set telemetry.metrics_port "
                    "(TOKENBUS_TELEMETRY__METRICS_PORT) to a free port, or 0",
                )
        self.log.info(
            "telemetry_ready",
            db=str(self.store.path),
            metrics_port=cfg.metrics_port,
            durable=self.durable,
        )

    def _go_durable(self, psub: Any) -> None:
        self.durable = True
        self._psub = psub
        self._fetcher = asyncio.get_running_loop().create_task(self._fetch_loop())

    async def _bind_later(self) -> None:
        """Try the durable consumer again (every 2 s, then at most every 30 s) until it
        binds; then fetch from it and leave the core subscription (what both delivered is
        stored once: record ids)."""
        wait = BIND_RETRY_S
        while True:
            await asyncio.sleep(wait)
            psub = await self._open_consumer(quiet=True)
            if psub is not None:
                break
            wait = min(30.0, wait * 2)
        self._go_durable(psub)
        core, self._core = self._core, None
        if core is not None:
            with contextlib.suppress(Exception):
                await core.unsubscribe()
        self.log.info("telemetry_durable_now")

    async def _open_consumer(self, *, quiet: bool = False) -> Any:
        """The records' stream (made when missing) and the shared durable consumer; None
        when this connection has no JetStream (the core subscription takes over)."""
        cfg = self.cfg
        js = self.nc.jetstream(timeout=2)
        try:
            await open_stream(js, records.stream_config(cfg), stall_s=2)
            return await js.pull_subscribe(
                records.subject(),
                durable=records.CONSUMER,
                stream=records.STREAM,
                config=api.ConsumerConfig(
                    ack_policy=api.AckPolicy.EXPLICIT,
                    deliver_policy=api.DeliverPolicy.ALL,
                    ack_wait=cfg.ack_wait_s,
                    max_ack_pending=max(1000, cfg.max_buffer),
                    max_deliver=-1,
                ),
                pending_msgs_limit=FETCH_MAX * 4,
            )
        except Exception as exc:
            if quiet:
                return None
            self.log.warning(
                "telemetry_not_durable",
                error=str(exc) or type(exc).__name__,
                hint="records come over core NATS until the stream answers (tried again every "
                "few seconds): those published while no telemetry service runs are lost. "
                "Where this persists, give the telemetry role JetStream (regenerate the NATS "
                "config)",
            )
            return None

    async def _fetch_loop(self) -> None:
        while True:
            room = self.cfg.max_buffer - len(self.buffer)
            if room <= 0:
                self._room.clear()
                self._full.set()
                await self._room.wait()
                continue
            try:
                msgs = await self._psub.fetch(batch=min(FETCH_MAX, room), timeout=1.0)
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no connection, no leader: try again shortly
                self.log.debug("telemetry_fetch_failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    self._take(msg, durable=True)
                except Exception as exc:  # never the end of the consumer: ack it, count it
                    self.metrics.dropped.inc()
                    self.log.warning("bad_record_dropped", error=type(exc).__name__)
                    self._ack(msg)

    async def _on_record(self, msg: Msg) -> None:
        self._take(msg, durable=False)

    def _take(self, msg: Msg, *, durable: bool) -> None:
        """A message's records into the buffer; acknowledged at once when none of them is
        to be stored (malformed), otherwise once they are written."""
        try:
            recs = records.batch(codec.decode_map(msg.data))
        except Exception:
            recs = ["undecodable"]
        # One warning a message, however many of its records are bad: a batch of junk is
        # not a way to flood the log.
        bad, first, kept = 0, "", 0
        for rec in recs:
            try:
                err = self._record(rec, durable=durable)
            except Exception as exc:  # whatever a record holds, it costs only itself
                err = type(exc).__name__
            if err is not None:
                bad, first = bad + 1, first or err
            elif durable:
                kept += 1
        if bad:
            self.metrics.dropped.inc(bad)
            self.log.warning(
                "bad_record_dropped", subject=msg.subject, count=bad, of=len(recs), error=first
            )
        if durable:
            if kept:
                self._acks.append(msg)
            else:
                self._ack(msg)

    def _ack(self, msg: Msg) -> None:
        task = asyncio.get_running_loop().create_task(msg.ack())
        self._acking.add(task)
        task.add_done_callback(self._acked)

    def _acked(self, task: asyncio.Task[None]) -> None:
        self._acking.discard(task)
        if not task.cancelled():
            task.exception()  # a lost ack: the message comes again, and is stored once

    def _record(self, rec: Any, *, durable: bool = False) -> str | None:
        """Take one record; why not, if it is not one."""
        if not isinstance(rec, dict):
            return "not a map" if rec != "undecodable" else "not msgpack"
        rid = records.record_id(rec)
        if rid is None or rid not in self._seen:
            try:
                self.metrics.observe(rec)
            except (AttributeError, TypeError, ValueError, RecursionError) as exc:
                # a field of the wrong type (a label nested too deep to print included)
                return str(exc)[:200]
            if rid is not None:
                self._seen[rid] = None
                if len(self._seen) > _SEEN_KEPT:
                    del self._seen[next(iter(self._seen))]
        if not durable and len(self.buffer) >= self.cfg.max_buffer:
            self.metrics.dropped.inc()
            return None
        self.buffer.append(rec)
        self._buffered.set()
        if len(self.buffer) >= self.cfg.max_buffer:
            self._full.set()
        return None

    async def _on_heartbeat(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            self.metrics.heartbeat(codec.decode_map(msg.data))

    async def _on_queue_report(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            self.metrics.queue_report(codec.decode_map(msg.data))

    async def _on_budget(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            self.metrics.budget_event(codec.decode_map(msg.data))

    async def flush(self) -> int:
        """Write the buffer, then acknowledge its messages: a record is acknowledged only
        once it is committed. A failed write acknowledges nothing (the stream delivers the
        messages again after ``ack_wait_s``)."""
        batch, self.buffer = self.buffer, []
        acks, self._acks = self._acks, []
        self._full.clear()
        self._room.set()
        if batch:
            try:
                self.written += await asyncio.to_thread(self.store.write, batch)
            except BaseException:
                for msg in acks:  # sooner than the ack wait
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=1.0)
                raise
        for msg in acks:
            self._ack(msg)
        return len(batch)

    async def _flush_loop(self) -> None:
        while True:
            await self._buffered.wait()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.cfg.flush_interval_s)
            self._buffered.clear()
            try:
                await self.flush()
            except Exception as exc:
                self.log.warning("telemetry_write_failed", error=str(exc))

    async def _probe_loop(self) -> None:
        urls = list(self.cfg.nats_monitor_urls)
        session = None
        if urls:  # only then: a telemetry that reads no monitor starts without aiohttp
            import aiohttp

            session = aiohttp.ClientSession()
        try:
            while True:
                try:
                    await self.probe()
                except Exception as exc:
                    self.log.warning("telemetry_probe_failed", error=str(exc))
                if session is not None:  # the servers' own state, beside the bus's view
                    wait = min(2.0, max(0.5, self.cfg.probe_interval_s / 2))
                    self.metrics.health.nats_servers = await natsmon.scrape(session, urls, wait)
                await asyncio.sleep(self.cfg.probe_interval_s)
        finally:
            if session is not None:
                await session.close()

    async def probe(self) -> None:
        """One look at the bus: the server's round trip, the services answering discovery
        (those seen before and silent now count 0), the key store's stream."""
        health = self.metrics.health
        if not self.nc.is_connected:
            health.rtt_s = None
            return
        wait = min(1.0, self.cfg.probe_interval_s / 2) or 0.5  # answers come within ms
        health.rtt_s = await self.nc.rtt(timeout=max(1, round(wait)))
        seen: dict[str, set[str]] = {}
        for data in await self._ask(PING, wait):
            with contextlib.suppress(ValueError, AttributeError):
                info = json.loads(data)
                name = str(info.get("name", ""))
                if name.startswith(_SERVICE_PREFIX):
                    seen.setdefault(name.removeprefix(_SERVICE_PREFIX), set()).add(
                        str(info.get("id", ""))
                    )
        if self.id not in seen.get(self.name, set()):
            # Not even this service answered its own ping: the probes cannot see (a bus config
            # from before the telemetry role could probe). Zeros would be false alarms.
            health.services, health.keystore_up = {}, None
            if not self._blind_logged:
                self._blind_logged = True
                self.log.warning(
                    "telemetry_probe_blind",
                    hint="the NATS config lacks the telemetry role's probe permissions "
                    "(docs/telemetry.md): regenerate it (tokenbus nats-config / deploy init)",
                )
            return
        health.services = dict.fromkeys(health.services, 0) | {
            name: len(ids) for name, ids in seen.items()
        }
        up: float | None = 0.0  # no answer in time, no JetStream, no leader: unreachable
        for data in await self._ask(KEYS_INFO, wait, first=True):
            with contextlib.suppress(ValueError, AttributeError):
                info = json.loads(data)
                err = info.get("error")
                if err is None:
                    up = float("config" in info)
                elif err.get("err_code") == _STREAM_NOT_FOUND:
                    up = None  # no key store on this bus (no auth stage yet): nothing to watch
        health.keystore_up = up
        files: tuple[float, float] | None = None  # no file store (yet), or no answer
        for data in await self._ask(FILES_INFO, wait, first=True):
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                info = json.loads(data)
                if info.get("error") is None:
                    limit = float(info["config"].get("max_bytes") or 0)
                    files = (float(info["state"].get("bytes") or 0), max(limit, 0.0))
        health.file_store = files
        health.probes += 1

    async def _ask(self, subject: str, wait: float, *, first: bool = False) -> list[bytes]:
        """Publish to ``subject`` and collect the answers for ``wait`` seconds (or until the
        first, with ``first``), on an inbox under :data:`INBOX_ROOT`."""
        inbox = f"{self._inbox}.{next(self._seq)}"
        got: list[bytes] = []
        done = asyncio.Event()

        async def cb(msg: Msg) -> None:
            got.append(msg.data)
            if first:
                done.set()

        sub = await self.nc.subscribe(inbox, cb=cb)
        try:
            await self.nc.publish(subject, b"", reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), wait)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return got

    async def on_stop(self) -> None:
        if self._durable_later is not None:
            self._durable_later.cancel()
        if self._core is not None:
            with contextlib.suppress(Exception):
                await self._core.unsubscribe()
        if self._fetcher is not None:
            await cancel_and_wait(self._fetcher)  # (its cancel can be lost in a fetch)
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._flusher.cancel()
        if self._prober is not None:
            self._prober.cancel()
        with contextlib.suppress(Exception):
            await self.flush()
        if self._acking:
            await asyncio.wait(set(self._acking), timeout=2.0)
        if self.http is not None:
            server, thread = self.http
            server.shutdown()
            thread.join(2)
        self.store.close()
