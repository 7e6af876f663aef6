"""The telemetry service: per-request records into Prometheus metrics and the SQLite store.

``tokenbus serve telemetry``. Records arrive on ``tb.v1.telemetry.request`` in the queue
group ``telemetry`` (run several: each record reaches one of them), heartbeats feed the
per-replica load gauges. Records are buffered (bounded: beyond ``max_buffer`` new ones are
counted as dropped, never blocking anything) and written in batches off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from bus_schemas import codec, subjects
from services.runtime import Service
from telemetry import records
from telemetry.store import RecordStore

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The aggregate metrics (own registry; labels: model, replica, stage, source, outcome —
    never a key or a request id)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        lab = ["model", "source"]
        self.ttft = Histogram(
            "tokenbus_ttft_seconds", "Time to first token", lab, registry=r, buckets=_LATENCY
        )
        self.tbt = Histogram(
            "tokenbus_tbt_seconds", "Mean time between tokens", lab, registry=r, buckets=_LATENCY
        )
        self.e2e = Histogram(
            "tokenbus_e2e_seconds", "End-to-end latency", lab, registry=r, buckets=_LATENCY
        )
        self.gateway = Histogram(
            "tokenbus_gateway_latency_seconds",
            "Gateway share of the latency: (t2 - t0) + (t5 - t3)",
            lab,
            registry=r,
            buckets=_LATENCY,
        )
        self.engine = Histogram(
            "tokenbus_engine_latency_seconds",
            "Engine time to first token (t3 - t2)",
            ["model", "replica"],
            registry=r,
            buckets=_LATENCY,
        )
        self.stage = Histogram(
            "tokenbus_stage_seconds",
            "Time in each pipeline stage",
            ["stage"],
            registry=r,
            buckets=_LATENCY,
        )
        self.requests = Counter(
            "tokenbus_requests_total",
            "Requests by outcome",
            ["model", "source", "outcome"],
            registry=r,
        )
        self.tokens = Counter(
            "tokenbus_tokens_total", "Tokens in and out", ["model", "direction"], registry=r
        )
        self.migrations = Counter(
            "tokenbus_migrations_total", "Streams moved to another replica", ["model"], registry=r
        )
        self.in_flight = Gauge(
            "tokenbus_replica_in_flight", "Requests on a replica", ["model", "replica"], registry=r
        )
        self.running = Gauge(
            "tokenbus_replica_running", "Sequences running", ["model", "replica"], registry=r
        )
        self.waiting = Gauge(
            "tokenbus_replica_waiting", "Sequences waiting", ["model", "replica"], registry=r
        )
        self.dropped = Counter(
            "tokenbus_telemetry_dropped_total", "Records dropped (buffer full)", registry=r
        )

    def observe(self, rec: dict[str, Any]) -> None:
        model, source = str(rec.get("model") or ""), str(rec.get("source") or "")
        self.requests.labels(model, source, str(rec.get("outcome") or "")).inc()
        for hist, key in (
            (self.ttft, "ttft_ms"),
            (self.tbt, "tbt_ms"),
            (self.e2e, "e2e_ms"),
            (self.gateway, "gateway_ms"),
        ):
            v = rec.get(key)
            if isinstance(v, int | float):
                hist.labels(model, source).observe(v / 1000.0)
        if source == "worker":  # counted once per request: every request has a worker record
            eng = rec.get("engine_ms")
            if isinstance(eng, int | float):
                self.engine.labels(model, str(rec.get("replica") or "")).observe(eng / 1000.0)
            for stage, ms in (rec.get("stages") or {}).items():
                self.stage.labels(str(stage)).observe(float(ms) / 1000.0)
            self.tokens.labels(model, "in").inc(int(rec.get("prompt_tokens") or 0))
            self.tokens.labels(model, "out").inc(int(rec.get("completion_tokens") or 0))
            if rec.get("migrations"):
                self.migrations.labels(model).inc()

    def heartbeat(self, hb: dict[str, Any]) -> None:
        model, replica = str(hb.get("model", "")), str(hb.get("replica", ""))
        self.in_flight.labels(model, replica).set(int(hb.get("in_flight", 0)))
        self.running.labels(model, replica).set(int(hb.get("running", 0)))
        self.waiting.labels(model, replica).set(int(hb.get("waiting", 0)))


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
        ]
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        self.http: Any = None
        if cfg.metrics_port:
            self.http = start_http_server(
                cfg.metrics_port, addr=cfg.metrics_host, registry=self.metrics.registry
            )
        self.log.info("telemetry_ready", db=str(self.store.path), metrics_port=cfg.metrics_port)

    async def _on_record(self, msg: Msg) -> None:
        try:
            rec = codec.decode_map(msg.data)
        except Exception:
            return
        self.metrics.observe(rec)
        if len(self.buffer) >= self.cfg.max_buffer:
            self.metrics.dropped.inc()
            return
        self.buffer.append(rec)

    async def _on_heartbeat(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            self.metrics.heartbeat(codec.decode_map(msg.data))

    async def flush(self) -> int:
        batch, self.buffer = self.buffer, []
        if batch:
            self.written += await asyncio.to_thread(self.store.write, batch)
        return len(batch)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.flush_interval_s)
            try:
                await self.flush()
            except Exception as exc:
                self.log.warning("telemetry_write_failed", error=str(exc))

    async def on_stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._flusher.cancel()
        with contextlib.suppress(Exception):
            await self.flush()
        if self.http is not None:
            server, thread = self.http
            server.shutdown()
            thread.join(2)
        self.store.close()
