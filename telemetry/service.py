"""The telemetry service: per-request records into Prometheus metrics and the SQLite store.

``tokenbus serve telemetry``. Records arrive on ``tb.v1.telemetry.request`` in the queue
group ``telemetry`` (run several: each record reaches one of them), heartbeats feed the
per-replica load gauges. Records are buffered (bounded: beyond ``max_buffer`` new ones are
counted as dropped, never blocking anything) and written in batches off the event loop.

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
from prometheus_client import start_http_server

from bus_schemas import codec, subjects
from services.discovery import API_PREFIX
from services.runtime import Service
from telemetry import records
from telemetry.metrics import Metrics
from telemetry.store import RecordStore

__all__ = ["INBOX_ROOT", "KEYS_INFO", "PING", "Metrics", "Telemetry"]

# The JetStream stream behind the API-key bucket (auth.store.BUCKET, "tokenbus_keys"; an actor
# may not import another, tests/test_layers.py): its STREAM.INFO is the key store's probe, a
# read of the stream's state that sees no key.
KEYS_INFO = "$JS.API.STREAM.INFO.KV_tokenbus_keys"
PING = f"{API_PREFIX}.PING"
# Where the probes' answers come back (services/natsconf.py lets the telemetry role read it).
INBOX_ROOT = subjects.inbox_prefix("telemetry")
_STREAM_NOT_FOUND = 10059  # JetStream's error code for it
_SERVICE_PREFIX = "tokenbus-"  # discovery names: "tokenbus-<service>" (services.runtime)


class Telemetry(Service):
    """Records to metrics and to disk."""

    name = "telemetry"
    forwards = False  # answers and reports; never hands a request on

    async def setup(self) -> None:
        cfg = self.settings.telemetry
        self.cfg = cfg
        self.metrics = Metrics()
        self.store = RecordStore(cfg.db_path, cfg.max_rows)
        self.buffer: list[dict[str, Any]] = []
        self.written = 0
        self._subs = [
            await self.nc.subscribe(
                records.subject(),
                queue="telemetry",
                cb=self._on_record,
                pending_msgs_limit=max(100_000, cfg.max_buffer),
            ),
            await self.nc.subscribe(subjects.heartbeat_wildcard(), cb=self._on_heartbeat),
            await self.nc.subscribe(
                subjects.telemetry(subjects.TELEMETRY_QUEUE), cb=self._on_queue_report
            ),
            await self.nc.subscribe(
                subjects.telemetry(subjects.TELEMETRY_BUDGET), cb=self._on_budget
            ),
        ]
        loop = asyncio.get_running_loop()
        self._buffered = asyncio.Event()  # set once a record waits: idle, the flusher sleeps
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
        self.log.info("telemetry_ready", db=str(self.store.path), metrics_port=cfg.metrics_port)

    async def _on_record(self, msg: Msg) -> None:
        try:
            recs = records.batch(codec.decode_map(msg.data))
        except Exception:
            return
        # One warning a message, however many of its records are bad: a batch of junk is
        # not a way to flood the log.
        bad, first = 0, ""
        for rec in recs:
            err = self._record(rec)
            if err is not None:
                bad, first = bad + 1, first or err
        if bad:
            self.log.warning(
                "bad_record_dropped", subject=msg.subject, count=bad, of=len(recs), error=first
            )

    def _record(self, rec: Any) -> str | None:
        """Take one record; why not, if it is not one."""
        if not isinstance(rec, dict):
            return "not a map"
        try:
            self.metrics.observe(rec)
        except (AttributeError, TypeError, ValueError, RecursionError) as exc:
            # a field of the wrong type (a label nested too deep to print included)
            return str(exc)[:200]
        if len(self.buffer) >= self.cfg.max_buffer:
            self.metrics.dropped.inc()
            return None
        self.buffer.append(rec)
        self._buffered.set()
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
        batch, self.buffer = self.buffer, []
        if batch:
            self.written += await asyncio.to_thread(self.store.write, batch)
        return len(batch)

    async def _flush_loop(self) -> None:
        while True:
            await self._buffered.wait()
            await asyncio.sleep(self.cfg.flush_interval_s)
            self._buffered.clear()
            try:
                await self.flush()
            except Exception as exc:
                self.log.warning("telemetry_write_failed", error=str(exc))

    async def _probe_loop(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception as exc:
                self.log.warning("telemetry_probe_failed", error=str(exc))
            await asyncio.sleep(self.cfg.probe_interval_s)

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
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._flusher.cancel()
        if self._prober is not None:
            self._prober.cancel()
        with contextlib.suppress(Exception):
            await self.flush()
        if self.http is not None:
            server, thread = self.http
            server.shutdown()
            thread.join(2)
        self.store.close()
