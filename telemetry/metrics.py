"""The telemetry service's Prometheus metrics: per-request records into histograms and
counters, heartbeats into per-replica load, probes of the bus into health gauges.

Names and buckets follow the field where the meaning overlaps: vLLM's
(``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``)
and Dynamo's frontend (``dynamo_frontend_time_to_first_token_seconds`` and friends), with the
``tokenbus_`` prefix, so dashboards and alerts written for them carry over. Those latency
histograms carry the request's trace id as an exemplar (OpenMetrics), so a slow bucket leads
to its trace. Labels: model, replica, source, stage, outcome, status, key id (the non-secret
id of an API key, for chargeback) — never a key and never a request id. Every metric is listed
in docs/telemetry.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from bus_schemas import errors as E
from bus_schemas.messages import announced_interval
from telemetry import natsmon

# The buckets of the existing tokenbus_* latency histograms (finer below 10 ms than vLLM's).
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so quantiles compare bucket for bucket.
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's 1-2-5 series for token counts (it stops at the model's context length, which the
# telemetry service does not know: here at a million).
TOKENS = (*(float(m * 10**e) for e in range(6) for m in (1, 2, 5)), 1e6)

# What a request's outcome says about it (label ``status``, as Dynamo's requests_total has):
SUCCESS = "success"
CANCELLED = "cancelled"
CLIENT_ERROR = "client_error"
SERVER_ERROR = "server_error"
# The model label of a failed request for a model no replica ever announced.
UNKNOWN_MODEL = "(unknown)"


def status_class(rec: dict[str, Any]) -> str:
    """``success``, ``cancelled``, ``client_error`` (4xx: the caller's to fix) or
    ``server_error`` (5xx: ours; what the error-rate alert counts) for one record.

    The outcome decides first (a stream that failed after its 200 header is still an error),
    then the HTTP status; an outcome that is no error code is a finish reason: a success."""
    outcome = str(rec.get("outcome") or "")
    if outcome == E.Cancelled.code:
        return CANCELLED
    err = E.ERRORS_BY_CODE.get(outcome.split(".", 1)[0])
    status = err.status if err is not None else rec.get("status")
    if not isinstance(status, int) or status < 400:
        return SUCCESS
    if status == E.Cancelled.status:
        return CANCELLED
    return CLIENT_ERROR if status < 500 else SERVER_ERROR


@dataclass
class _Replica:
    model: str
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    prefill_backlog: int = 0
    max_concurrency: int = 0
    kv_usage: float = 0.0
    draining: bool = False
    interval_s: float = 1.0
    seen: float = 0.0
    flow: dict[str, Any] = field(default_factory=dict)  # per class (engine_worker/flow.py)
    flows: dict[str, Any] = field(default_factory=dict)  # per flow
    perf: dict[str, Any] = field(default_factory=dict)  # its engine's learned speed


@dataclass(eq=False)  # a registry keeps its collectors in a dict: hashed by identity
class ReplicaLoad:
    """Replicas known from heartbeats; one that misses ``missed`` beats of the interval it
    announced is forgotten (its series disappear), as the router forgets it."""

    missed: int = 3
    replicas: dict[str, _Replica] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)  # every model ever seen: 0 replicas is news
    names: set[str] = field(default_factory=set)  # those and their aliases (LoRA adapters)
    # Router or bridge instance -> (what it holds per (model, class), interval, when heard).
    held: dict[str, tuple[dict[tuple[str, str], int], float, float]] = field(default_factory=dict)

    def queue_report(self, rep: dict[str, Any]) -> None:
        """A router's or bridge's report of the requests it holds (its queue and waiting
        room), per model and class; forgotten after three missed reports, like a replica."""
        inst = str(rep.get("instance") or "")
        waiting = rep.get("waiting")
        if not inst or not isinstance(waiting, dict):
            return
        held: dict[tuple[str, str], int] = {}
        for model, per in waiting.items():
            if isinstance(per, dict):
                for cls, n in per.items():
                    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                        held[(str(model), str(cls))] = n
        try:  # held to the longest a member may announce: a forged report still expires
            interval = announced_interval(rep.get("interval_s", 1.0))
        except ValueError:
            return
        now = time.monotonic()
        if held:
            self.held[inst] = (held, interval, now)
            self.models.update(m for m, _ in held)
        else:
            self.held.pop(inst, None)
        for stale in [k for k, (_, iv, seen) in self.held.items() if now - seen > iv * self.missed]:
            del self.held[stale]

    def holding(self) -> dict[tuple[str, str], int]:
        """Requests held by routers and bridges, per (model, class), summed (scrape thread:
        it copies)."""
        now = time.monotonic()
        out: dict[tuple[str, str], int] = {}
        for held, iv, seen in list(self.held.values()):
            if now - seen <= iv * self.missed:
                for key, n in held.items():
                    out[key] = out.get(key, 0) + n
        return out

    def heartbeat(self, hb: dict[str, Any]) -> None:
        rid, model = str(hb.get("replica") or ""), str(hb.get("model") or "")
        if not rid or not model:
            return
        # Every number read before the replica is touched: a beat with one that is no
        # number (or infinite: int() raises) changes nothing. Its interval is held to the
        # longest a member may announce, so a forged beat's replica still expires.
        counts = [
            int(hb.get(k) or 0)
            for k in ("in_flight", "running", "waiting", "prefill_backlog", "max_concurrency")
        ]
        kv_usage = float(hb.get("kv_usage") or 0.0)
        interval_s = announced_interval(hb.get("interval_s") or 1.0)
        r = self.replicas.get(rid)
        if r is None or r.model != model:
            r = self.replicas[rid] = _Replica(model)
        r.in_flight, r.running, r.waiting, backlog, r.max_concurrency = counts
        r.prefill_backlog = max(0, backlog)
        r.kv_usage = kv_usage
        r.draining = bool(hb.get("draining"))
        r.interval_s = interval_s
        flow, flows = hb.get("flow"), hb.get("flows")
        r.flow = flow if isinstance(flow, dict) else {}
        r.flows = flows if isinstance(flows, dict) else {}
        perf = hb.get("perf")
        r.perf = perf if isinstance(perf, dict) else {}
        r.seen = now = time.monotonic()
        for stale in [k for k, x in self.replicas.items() if self._stale(x, now)]:
            del self.replicas[stale]
        self.models.add(model)
        self.names.add(model)
        self.names.update(str(a) for a in hb.get("aliases") or ())

    def _stale(self, r: _Replica, now: float) -> bool:
        return now - r.seen > r.interval_s * self.missed

    def live(self) -> list[tuple[str, _Replica]]:
        """The replicas still heartbeating. Called from the scrape thread: it copies (one C
        call, whole under the GIL) and leaves changes to :meth:`heartbeat`, the loop's."""
        now = time.monotonic()
        return [(rid, r) for rid, r in list(self.replicas.items()) if not self._stale(r, now)]

    def collect(self) -> Iterator[Metric]:
        lab = ["model", "replica"]
        fams = {
            "in_flight": GaugeMetricFamily(
                "tokenbus_replica_in_flight",
                "Requests on a replica (accepted, not finished)",
                labels=lab,
            ),
            "running": GaugeMetricFamily(
                "tokenbus_replica_running", "Sequences running in the replica's engine", labels=lab
            ),
            "waiting": GaugeMetricFamily(
                "tokenbus_replica_waiting", "Sequences queued in the replica's engine", labels=lab
            ),
            "prefill_backlog": GaugeMetricFamily(
                "tokenbus_replica_prefill_backlog_tokens",
                "Prompt tokens the replica's engine has still to compute before a new request's "
                "first token (engine_worker/backlog.py)",
                labels=lab,
            ),
            "max_concurrency": GaugeMetricFamily(
                "tokenbus_replica_max_concurrency",
                "Most requests the replica takes at once",
                labels=lab,
            ),
            "kv_usage": GaugeMetricFamily(
                "tokenbus_replica_kv_cache_usage",
                "KV-cache use, 0 to 1 (vllm:kv_cache_usage_perc), where the engine reports it",
                labels=lab,
            ),
            "draining": GaugeMetricFamily(
                "tokenbus_replica_draining", "1 while the replica takes no new requests", labels=lab
            ),
        }
        per_model = dict.fromkeys(set(self.models), 0)
        for rid, r in self.live():
            for attr, fam in fams.items():
                fam.add_metric([r.model, rid], float(getattr(r, attr)))
            if not r.draining:
                per_model[r.model] = per_model.get(r.model, 0) + 1
        yield from fams.values()
        yield from _perf_metrics(self.live())
        yield from _flow_metrics(self.live(), self.holding())
        models = GaugeMetricFamily(
            "tokenbus_model_replicas",
            "Live replicas of a model that take requests (0: a model seen before has none)",
            labels=["model"],
        )
        for model, n in sorted(per_model.items()):
            models.add_metric([model], n)
        yield models


_FLOW_GAUGES = {
    "queued": ("tokenbus_flow_queued", "Requests waiting for an engine slot, per class"),
    "queued_tokens": ("tokenbus_flow_queued_tokens", "Prompt tokens of the waiting requests"),
    "running": ("tokenbus_flow_running", "Requests in the engine, per class"),
}
_FLOW_COUNTERS = {
    "served": ("tokenbus_flow_served", "Requests given an engine slot, per class"),
    "shed": ("tokenbus_flow_shed", "Requests refused after waiting (limit, deadline, shed)"),
    "displaced": ("tokenbus_flow_displaced", "Requests displaced before their first byte"),
    "wait_s_sum": ("tokenbus_flow_wait_seconds", "Seconds waited for an engine slot, summed"),
}


# The latency models replicas learn of their engines (engine_worker/perf.py): what the
# predicted_latency policy predicts from (docs/routing.md).
_PERF = {
    "ttft_base_ms": "Learned engine time to first token of an empty prompt, ms",
    "prefill_ms_per_token": "Learned prefill time per prompt token computed (not cached), ms",
    "backlog_ms_per_token": "Learned wait per prompt token of other requests still to compute, ms",
    "queue_ms_per_waiting": "Learned wait per sequence queued in the engine ahead, ms",
    "tpot_base_ms": "Learned time per output token alone in the batch, ms",
    "tpot_ms_per_running": "Learned extra time per output token per running sequence, ms",
}


def _perf_metrics(live: list[tuple[str, _Replica]]) -> Iterator[Metric]:
    for key, doc in _PERF.items():
        fam = GaugeMetricFamily(f"tokenbus_replica_{key}", doc, labels=["model", "replica"])
        for rid, r in live:
            v = _num(r.perf.get(key))
            if v is not None:
                fam.add_metric([r.model, rid], v)
        yield fam


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _flow_metrics(
    live: list[tuple[str, _Replica]], held: dict[tuple[str, str], int]
) -> Iterator[Metric]:
    """Flow control per replica and class, per flow, and the queue depth per model and
    class (what an autoscaler scales on: docs/flow.md)."""
    lab = ["model", "replica", "class"]
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        k: GaugeMetricFamily(n, h, labels=lab) for k, (n, h) in _FLOW_GAUGES.items()
    }
    fams.update({k: CounterMetricFamily(n, h, labels=lab) for k, (n, h) in _FLOW_COUNTERS.items()})
    depth = GaugeMetricFamily(
        "tokenbus_model_queue_depth",
        "Requests of a model waiting, per class: for an engine slot on any replica, in a "
        "router's queue, or in its waiting room for a replica to start (scale from zero)",
        labels=["model", "class"],
    )
    router = GaugeMetricFamily(
        "tokenbus_router_waiting",
        "Requests routers and bridges hold (every replica full, or none started yet)",
        labels=["model", "class"],
    )
    flow_lab = ["model", "replica", "flow"]
    per_flow: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "queued": GaugeMetricFamily(
            "tokenbus_flow_key_queued", "Requests of a flow waiting", labels=flow_lab
        ),
        "running": GaugeMetricFamily(
            "tokenbus_flow_key_running", "Requests of a flow in the engine", labels=flow_lab
        ),
        "tokens": CounterMetricFamily(
            "tokenbus_flow_key_tokens",
            "Tokens a flow (key or owner) was served: its share",
            labels=flow_lab,
        ),
    }
    totals: dict[tuple[str, str], float] = {}
    for rid, r in live:
        for cls, st in r.flow.items():
            if not isinstance(st, dict):
                continue
            for key, fam in fams.items():
                v = _num(st.get(key))
                if v is not None:
                    fam.add_metric([r.model, rid, str(cls)], v)
            q = _num(st.get("queued")) or 0.0
            totals[(r.model, str(cls))] = totals.get((r.model, str(cls)), 0.0) + q
        for name, st in r.flows.items():
            if isinstance(st, dict):
                for key, fam in per_flow.items():
                    v = _num(st.get(key))
                    if v is not None:
                        fam.add_metric([r.model, rid, str(name)], v)
    for (model, cls), count in sorted(held.items()):
        router.add_metric([model, cls], float(count))
        totals[(model, cls)] = totals.get((model, cls), 0.0) + count
    for (model, cls), total in sorted(totals.items()):
        depth.add_metric([model, cls], total)
    yield router
    yield from fams.values()
    yield from per_flow.values()
    yield depth


@dataclass(eq=False)
class BusHealth:
    """What the telemetry service sees of the bus: its own connection, the services that
    answer discovery pings, and the key store; filled by its probe loop."""

    nc: Any = None  # the telemetry service's NATS connection
    rtt_s: float | None = None
    services: dict[str, int] = field(default_factory=dict)  # every service ever seen
    keystore_up: float | None = None
    # The file store's stream (OBJ_tokenbus_files): (bytes, its max_bytes; 0: unbounded).
    file_store: tuple[float, float] | None = None
    probes: int = 0
    nats_servers: list[natsmon.ServerState] = field(default_factory=list)

    def collect(self) -> Iterator[Metric]:
        nc = self.nc
        connected = GaugeMetricFamily(
            "tokenbus_nats_connected", "1 while the telemetry service is connected to NATS"
        )
        connected.add_metric([], 1.0 if nc is not None and nc.is_connected else 0.0)
        yield connected
        stats = dict(getattr(nc, "stats", None) or {})
        reconnects = CounterMetricFamily(
            "tokenbus_nats_reconnects", "Times the telemetry service's NATS connection came back"
        )
        reconnects.add_metric([], float(stats.get("reconnects", 0)))
        yield reconnects
        msgs = CounterMetricFamily(
            "tokenbus_nats_messages",
            "Messages the telemetry service received from / sent to NATS",
            labels=["direction"],
        )
        msgs.add_metric(["in"], float(stats.get("in_msgs", 0)))
        msgs.add_metric(["out"], float(stats.get("out_msgs", 0)))
        yield msgs
        rtt = GaugeMetricFamily(
            "tokenbus_nats_rtt_seconds", "Round trip to the NATS server, at the last probe"
        )
        if self.rtt_s is not None:
            rtt.add_metric([], self.rtt_s)
        yield rtt
        services = GaugeMetricFamily(
            "tokenbus_service_instances",
            "Instances of a tokenbus service answering $SRV.PING (0: one seen before is gone)",
            labels=["service"],
        )
        for name, n in sorted(self.services.items()):
            services.add_metric([name], n)
        yield services
        keys = GaugeMetricFamily(
            "tokenbus_keystore_up", "1 while the API-key store (KV bucket tokenbus_keys) answers"
        )
        if self.keystore_up is not None:
            keys.add_metric([], self.keystore_up)
        yield keys
        fs_bytes = GaugeMetricFamily(
            "tokenbus_file_store_bytes", "Bytes in the file store (object store tokenbus_files)"
        )
        fs_max = GaugeMetricFamily(
            "tokenbus_file_store_max_bytes",
            "The file store's size bound (files.max_bytes as the bucket was made; none: unbounded)",
        )
        if self.file_store is not None:
            fs_bytes.add_metric([], self.file_store[0])
            if self.file_store[1] > 0:
                fs_max.add_metric([], self.file_store[1])
        yield fs_bytes
        yield fs_max
        probes = CounterMetricFamily("tokenbus_probes", "Probe rounds of the bus run so far")
        probes.add_metric([], float(self.probes))
        yield probes
        yield from natsmon.collect(self.nats_servers)


class Metrics:
    """The aggregate metrics, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=r)

        src, rep = ["model", "source"], ["model", "replica", "source"]
        # The first tokenbus histograms (kept: dashboards and the report use them).
        self.ttft = hist("tokenbus_ttft_seconds", "Time to first token (t5 - t0)", src, LATENCY)
        self.tbt = hist("tokenbus_tbt_seconds", "Mean time between tokens", src, LATENCY)
        self.e2e = hist("tokenbus_e2e_seconds", "End-to-end latency (t6 - t0)", src, LATENCY)
        self.gateway = hist(
            "tokenbus_gateway_latency_seconds",
            "Gateway share of the latency: (t2 - t0) + (t5 - t3)",
            src,
            LATENCY,
        )
        self.engine = hist(
            "tokenbus_engine_latency_seconds",
            "Engine time to first token (t3 - t2)",
            ["model", "replica"],
            LATENCY,
        )
        self.stage = hist(
            "tokenbus_stage_seconds", "Time in each pipeline stage", ["stage"], LATENCY
        )
        # The field's names and buckets (vLLM, Dynamo), per replica, with trace exemplars.
        self.time_to_first_token = hist(
            "tokenbus_time_to_first_token_seconds",
            "Time to first token (vllm:time_to_first_token_seconds)",
            rep,
            TTFT,
        )
        self.inter_token_latency = hist(
            "tokenbus_inter_token_latency_seconds",
            "Mean time between output tokens, one observation per request "
            "(vllm:request_time_per_output_token_seconds)",
            rep,
            ITL,
        )
        self.e2e_request_latency = hist(
            "tokenbus_e2e_request_latency_seconds",
            "End-to-end request latency (vllm:e2e_request_latency_seconds)",
            rep,
            REQUEST_LATENCY,
        )
        self.queue_time = hist(
            "tokenbus_request_queue_time_seconds",
            "From the client's send to the engine's start (t2 - t0): the stages, the router "
            "holding it for a free replica, the hops (vllm:request_queue_time_seconds)",
            ["model", "replica"],
            REQUEST_LATENCY,
        )
        self.prompt_tokens_hist = hist(
            "tokenbus_request_prompt_tokens",
            "Prompt tokens per request (vllm:request_prompt_tokens)",
            ["model"],
            TOKENS,
        )
        self.generation_tokens_hist = hist(
            "tokenbus_request_generation_tokens",
            "Generated tokens per request (vllm:request_generation_tokens)",
            ["model"],
            TOKENS,
        )
        self.requests = counter(
            "tokenbus_requests_total",
            "Requests by outcome (a finish reason or an error code) and status class",
            ["model", "source", "outcome", "status"],
        )
        self.success = counter(
            "tokenbus_request_success_total",
            "Requests an engine finished, by finish reason (vllm:request_success_total)",
            ["model", "replica", "finished_reason"],
        )
        self.tokens = counter("tokenbus_tokens_total", "Tokens in and out", ["model", "direction"])
        self.prompt_tokens = counter(
            "tokenbus_prompt_tokens_total",
            "Prompt tokens processed (vllm:prompt_tokens_total)",
            ["model", "replica"],
        )
        self.generation_tokens = counter(
            "tokenbus_generation_tokens_total",
            "Tokens generated (vllm:generation_tokens_total)",
            ["model", "replica"],
        )
        self.key_requests = counter(
            "tokenbus_key_requests_total",
            "Requests per API key (its id) and model, for chargeback",
            ["key_id", "model", "source", "status"],
        )
        self.key_tokens = counter(
            "tokenbus_key_tokens_total",
            "Tokens per API key (its id) and model, for chargeback",
            ["key_id", "model", "direction"],
        )
        self.migrations = counter(
            "tokenbus_migrations_total", "Streams moved to another replica", ["model"]
        )
        # The closed loop on KV-cache hits (docs/routing.md): of the requests a router
        # predicted hits for and whose engine reported its cached tokens, both sums.
        loop = ["model", "replica", "router"]
        self.kv_predicted = counter(
            "tokenbus_kv_predicted_tokens_total",
            "Prompt tokens routers predicted the replica would read from its KV cache",
            loop,
        )
        self.kv_reported = counter(
            "tokenbus_kv_reported_tokens_total",
            "Of the same requests, prompt tokens the engine reported it read from its cache",
            loop,
        )
        self.records = Counter(
            "tokenbus_telemetry_records_total",
            "Records received, by source",
            ["source"],
            registry=r,
        )
        self.dropped = Counter(
            "tokenbus_telemetry_dropped_total",
            "Records not stored: malformed, or the buffer full (core NATS only)",
            registry=r,
        )
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.soft_exceeded = Gauge(
            "tokenbus_budget_soft_exceeded",
            "1 once a key's or owner's spend passed its soft budget threshold in a period",
            ["scope", "period"],
            registry=r,
        )
        self.budget_spent = Gauge(
            "tokenbus_budget_spent_usd",
            "A budget's spend in dollars when its soft threshold was crossed",
            ["scope", "period"],
            registry=r,
        )
        self.load = ReplicaLoad()
        self.health = BusHealth()
        r.register(self.load)
        r.register(self.health)

    def _of(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: the labels call (a lock, validation) was a
        third of the cost of a record."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe(self, rec: dict[str, Any]) -> None:
        """Count one record (the worker's and the bridge's of the same request both come)."""
        of = self._of
        model, source = str(rec.get("model") or ""), str(rec.get("source") or "")
        replica, outcome = str(rec.get("replica") or ""), str(rec.get("outcome") or "")
        trace = rec.get("trace_id")
        ex = {"trace_id": trace} if isinstance(trace, str) and trace else None
        status = status_class(rec)
        if status != SUCCESS and source != "worker" and model not in self.load.names:
            # A refused request's model is whatever the caller wrote: as a label, every typo
            # (or a hostile caller) would make new series without end.
            model = UNKNOWN_MODEL
        of(self.records, source).inc()
        of(self.requests, model, source, outcome, status).inc()
        key_id = str(rec.get("principal") or "")
        if key_id:
            of(self.key_requests, key_id, model, source, status).inc()
        for old, new, key in (
            (self.ttft, self.time_to_first_token, "ttft_ms"),
            (self.tbt, self.inter_token_latency, "tbt_ms"),
            (self.e2e, self.e2e_request_latency, "e2e_ms"),
            (self.gateway, None, "gateway_ms"),
        ):
            v = rec.get(key)
            if not isinstance(v, int | float):
                continue
            of(old, model, source).observe(v / 1000.0)
            if new is not None:  # the trace exemplars go on the field's histograms
                of(new, model, replica, source).observe(v / 1000.0, ex)
        if source != "worker":
            return
        # What only the engine's record has, counted once per request: every request that
        # reached an engine has a worker record.
        eng = rec.get("engine_ms")
        if isinstance(eng, int | float):
            of(self.engine, model, replica).observe(eng / 1000.0)
        t = rec.get("t") or {}
        t0, t2 = t.get("t0"), t.get("engine_start")
        if isinstance(t0, int) and isinstance(t2, int):
            of(self.queue_time, model, replica).observe(max(0, t2 - t0) / 1e9, ex)
        for stage, ms in (rec.get("stages") or {}).items():
            of(self.stage, str(stage)).observe(float(ms) / 1000.0)
        tin, tout = int(rec.get("prompt_tokens") or 0), int(rec.get("completion_tokens") or 0)
        of(self.tokens, model, "in").inc(tin)
        of(self.tokens, model, "out").inc(tout)
        of(self.prompt_tokens, model, replica).inc(tin)
        of(self.generation_tokens, model, replica).inc(tout)
        if key_id:
            of(self.key_tokens, key_id, model, "in").inc(tin)
            of(self.key_tokens, key_id, model, "out").inc(tout)
        if status == SUCCESS:
            of(self.success, model, replica, outcome).inc()
            of(self.prompt_tokens_hist, model).observe(tin)
            of(self.generation_tokens_hist, model).observe(tout)
        if rec.get("migrations"):
            of(self.migrations, model).inc()
        predicted, cached = rec.get("kv_predicted_tokens"), rec.get("cached_tokens")
        if isinstance(predicted, int) and isinstance(cached, int):
            router = str(rec.get("kv_router") or "")[:64]
            of(self.kv_predicted, model, replica, router).inc(max(0, predicted))
            of(self.kv_reported, model, replica, router).inc(max(0, cached))

    def heartbeat(self, hb: dict[str, Any]) -> None:
        self.load.heartbeat(hb)

    def queue_report(self, rep: dict[str, Any]) -> None:
        self.load.queue_report(rep)

    def budget_event(self, ev: dict[str, Any]) -> None:
        """A spend budget's soft threshold crossed (auth.budgets), by scope and period."""
        scope, period = ev.get("scope"), ev.get("period")
        spent = ev.get("spent_usd")
        if not isinstance(scope, str) or not isinstance(period, str):
            return
        if not isinstance(spent, int | float) or isinstance(spent, bool):
            return
        self.soft_exceeded.labels(scope[:200], period[:16]).set(1)
        self.budget_spent.labels(scope[:200], period[:16]).set(float(spent))
