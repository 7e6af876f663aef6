"""Build the tokenbus Grafana dashboard (deploy/grafana/tokenbus.json) with Grafana's own typed
builders (grafana-foundation-sdk, a dev dependency).

    python deploy/grafana/build_dashboard.py          # rewrites tokenbus.json beside this file

The JSON is what Grafana loads (compose's `observability` profile provisions it); this file is
how it is changed. tests/test_observability.py checks that the two agree, that the JSON loads
back into the SDK's model, and that every query names a metric tokenbus exports. Metrics:
docs/telemetry.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

OUT = Path(__file__).with_name("tokenbus.json")
UID = "tokenbus-overview"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The selections every query honours (variables below).
M = 'model=~"$model"'
SRC = 'source="$source"'
RATE = "[$__rate_interval]"
Queries = list[cogbuilder.Builder[cogvariants.Dataquery]]


def q(
    expr: str, legend: str = "", *, exemplar: bool = False, ref: str = "A"
) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    return query.exemplar(exemplar)


def quantiles(metric: str, by: str, sel: str, *, exemplar: bool = True) -> Queries:
    """p50, p95, p99 of a histogram, by ``by``."""
    return [
        q(
            f"histogram_quantile({p}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}{RATE})))",
            f"p{round(p * 100)} " + " ".join(f"{{{{{label}}}}}" for label in by.split(", ")),
            exemplar=exemplar and i == 0,
            ref=ref,
        )
        for i, (p, ref) in enumerate(((0.5, "A"), (0.95, "B"), (0.99, "C")))
    ]


Panel = timeseries.Panel | stat.Panel | table.Panel


def ts(
    title: str,
    unit: str,
    queries: Queries,
    *,
    desc: str = "",
    span: int = 8,
    stack: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .span(span)
        .height(8)
        .targets(queries)
        .legend(
            cb.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .fill_opacity(10)
    )
    if stack:
        panel = panel.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(
            60
        )
    return panel


def single(
    title: str,
    unit: str,
    expr: str,
    *,
    desc: str = "",
    span: int = 4,
    steps: list[tuple[float | None, str]] | None = None,
) -> stat.Panel:
    thresholds = (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in (steps or [(None, "green")])])
    )
    return (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .span(span)
        .height(4)
        .with_target(q(expr))
        .thresholds(thresholds)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


class Section:
    """A row of the dashboard and the panels under it (expanded: Grafana wants the panels of
    an open row beside it, not inside it)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.panels: list[Panel] = []

    def with_panel(self, panel: Panel) -> Section:
        self.panels.append(panel)
        return self


def rate(metric: str, sel: str = "", by: str = "") -> str:
    """``sum [by (by)] (rate(metric{sel}[$__rate_interval]))``."""
    grouping = f" by ({by}) " if by else ""
    selector = f"{{{sel}}}" if sel else ""
    return f"sum{grouping}(rate({metric}{selector}{RATE}))"


def mean(metric: str, by: str, sel: str = "") -> str:
    """The mean of a histogram over the interval, by ``by``."""
    return f"{rate(metric + '_sum', sel, by)} / {rate(metric + '_count', sel, by)}"


def p95_by_replica(metric: str, sel: str) -> prometheus.Dataquery:
    expr = f"histogram_quantile(0.95, {rate(metric + '_bucket', sel, 'model, replica, le')})"
    return q(expr, "{{replica}}", exemplar=True)


REQS = "tokenbus_requests_total"
ALL = f"{SRC}, {M}"
SERVER_ERRORS = f'{ALL}, status="server_error"'
WORKER = f'source="worker", {M}'
GREEN_AT_1 = [(None, "red"), (1.0, "green")]


def traffic() -> Section:
    return (
        Section("Traffic")
        .with_panel(single("Requests/s", "reqps", rate(REQS, ALL)))
        .with_panel(
            single(
                "In flight",
                "short",
                f"sum(tokenbus_replica_in_flight{{{M}}})",
                desc="Requests accepted by replicas and not finished.",
            )
        )
        .with_panel(single("Output tokens/s", "short", rate("tokenbus_generation_tokens_total", M)))
        .with_panel(
            single(
                "Server errors",
                "percentunit",
                f"{rate(REQS, SERVER_ERRORS)} / {rate(REQS, ALL)}",
                desc="Share of requests that failed on tokenbus' side (5xx).",
                steps=[(None, "green"), (0.01, "orange"), (0.05, "red")],
            )
        )
        .with_panel(
            single("Replicas", "short", f"sum(tokenbus_model_replicas{{{M}}})", steps=GREEN_AT_1)
        )
        .with_panel(
            single(
                "Models without replicas",
                "short",
                "count(tokenbus_model_replicas == 0) or vector(0)",
                steps=[(None, "green"), (1.0, "red")],
            )
        )
        .with_panel(
            ts("Requests/s by model", "reqps", [q(rate(REQS, ALL, "model"), "{{model}}")], span=12)
        )
        .with_panel(
            ts(
                "Tokens/s by model",
                "short",
                [
                    q(rate("tokenbus_prompt_tokens_total", M, "model"), "in {{model}}"),
                    q(
                        rate("tokenbus_generation_tokens_total", M, "model"),
                        "out {{model}}",
                        ref="B",
                    ),
                ],
                span=12,
            )
        )
    )


def latency() -> Section:
    return (
        Section("Latency")
        .with_panel(
            ts(
                "Time to first token by model",
                "s",
                quantiles("tokenbus_time_to_first_token_seconds", "model", ALL),
                desc="The p50 line's exemplars open the request's trace.",
                span=12,
            )
        )
        .with_panel(
            ts(
                "Time to first token p95 by replica",
                "s",
                [p95_by_replica("tokenbus_time_to_first_token_seconds", WORKER)],
                desc="As the engines saw it (worker records: every request, NATS and HTTP).",
                span=12,
            )
        )
        .with_panel(
            ts(
                "Time between tokens by model",
                "s",
                quantiles("tokenbus_inter_token_latency_seconds", "model", ALL),
                desc="Each request's mean gap between output tokens.",
                span=12,
            )
        )
        .with_panel(
            ts(
                "Time between tokens p95 by replica",
                "s",
                [p95_by_replica("tokenbus_inter_token_latency_seconds", WORKER)],
                span=12,
            )
        )
        .with_panel(
            ts(
                "End to end by model",
                "s",
                quantiles("tokenbus_e2e_request_latency_seconds", "model", ALL),
            )
        )
        .with_panel(
            ts(
                "Queue time by model",
                "s",
                quantiles("tokenbus_request_queue_time_seconds", "model", M),
                desc="Client send to engine start: the stages, the router holding the request "
                "for a free replica, the hops.",
            )
        )
        .with_panel(
            ts(
                "Fine-grained time to first token",
                "s",
                quantiles("tokenbus_ttft_seconds", "model", ALL),
                desc="tokenbus' own buckets, finer below 10 ms than vLLM's.",
            )
        )
    )


def breakdown() -> Section:
    return (
        Section("Where the time goes")
        .with_panel(
            ts(
                "Mean time per stage",
                "s",
                [q(mean("tokenbus_stage_seconds", "stage"), "{{stage}}")],
                desc="ingress, auth, ratelimit, filter, route: each from the previous mark on "
                "the request's path to its own.",
                stack=True,
            )
        )
        .with_panel(
            ts(
                "Gateway and engine share of the first token",
                "s",
                [
                    q(mean("tokenbus_gateway_latency_seconds", "model", ALL), "gateway {{model}}"),
                    q(
                        mean("tokenbus_engine_latency_seconds", "model", M),
                        "engine {{model}}",
                        ref="B",
                    ),
                ],
                desc="Gateway: (t2 - t0) + (t5 - t3); engine: t3 - t2 (docs/telemetry.md).",
            )
        )
        .with_panel(
            ts(
                "Engine time to first token p95 by replica",
                "s",
                [p95_by_replica("tokenbus_engine_latency_seconds", M)],
            )
        )
    )


def errors() -> Section:
    return (
        Section("Errors")
        .with_panel(
            ts(
                "Failed requests/s by outcome",
                "reqps",
                [q(rate(REQS, f'{ALL}, status!="success"', "outcome"), "{{outcome}}")],
                desc="Error codes (and cancellations) as the callers got them.",
                stack=True,
            )
        )
        .with_panel(
            ts(
                "Server error ratio by model",
                "percentunit",
                [
                    q(
                        f"{rate(REQS, SERVER_ERRORS, 'model')} / {rate(REQS, ALL, 'model')}",
                        "{{model}}",
                    )
                ],
            )
        )
        .with_panel(
            ts(
                "Finished by reason, migrations",
                "reqps",
                [
                    q(
                        rate("tokenbus_request_success_total", M, "finished_reason"),
                        "{{finished_reason}}",
                    ),
                    q(rate("tokenbus_migrations_total", M), "migrated", ref="B"),
                ],
            )
        )
    )


def usage() -> Section:
    tokens = (
        q(
            f"sum by (key_id, model, direction) (increase(tokenbus_key_tokens_total{{{M}}}"
            "[$__range]))"
        )
        .instant()
        .format(pm.PromQueryFormat.TABLE)
    )
    return (
        Section("Usage per API key")
        .with_panel(
            ts(
                "Tokens/s by key",
                "short",
                [q(rate("tokenbus_key_tokens_total", M, "key_id"), "{{key_id}}")],
                stack=True,
            )
        )
        .with_panel(
            ts(
                "Requests/s by key",
                "reqps",
                [q(rate("tokenbus_key_requests_total", ALL, "key_id"), "{{key_id}}")],
                stack=True,
            )
        )
        .with_panel(
            table.Panel()
            .title("Tokens per key and model in the time range")
            .description("For chargeback: key ids, never keys.")
            .datasource(DS)
            .span(8)
            .height(8)
            .with_target(tokens)
        )
    )


def replicas() -> Section:
    def per_replica(title: str, unit: str, expr: str, **kw: str | int) -> timeseries.Panel:
        return ts(title, unit, [q(expr, "{{replica}}")], **kw)  # type: ignore[arg-type]

    load = f"tokenbus_replica_in_flight{{{M}}} / tokenbus_replica_max_concurrency{{{M}}}"
    return (
        Section("Replicas")
        .with_panel(
            ts("Replicas per model", "short", [q(f"tokenbus_model_replicas{{{M}}}", "{{model}}")])
        )
        .with_panel(per_replica("Load (in flight / capacity)", "percentunit", load))
        .with_panel(
            per_replica(
                "KV-cache use",
                "percentunit",
                f"tokenbus_replica_kv_cache_usage{{{M}}}",
                desc="Where the engine reports it (vLLM, sim).",
            )
        )
        .with_panel(
            per_replica("Running sequences", "short", f"tokenbus_replica_running{{{M}}}", span=12)
        )
        .with_panel(
            per_replica("Waiting sequences", "short", f"tokenbus_replica_waiting{{{M}}}", span=12)
        )
    )


def flow() -> Section:
    """Flow control (engine_worker/flow.py): queues per class, waits, shares, budgets."""
    wait = (
        f"{rate('tokenbus_flow_wait_seconds_total', M, 'class')}"
        f" / {rate('tokenbus_flow_served_total', M, 'class')}"
    )
    return (
        Section("Flow control: classes, fair shares, budgets")
        .with_panel(
            ts(
                "Queue depth per model and class",
                "short",
                [
                    q(
                        f"sum by (model, class) (tokenbus_model_queue_depth{{{M}}})",
                        "{{model}} {{class}}",
                    )
                ],
                desc="Waiting for an engine slot, in a router's queue or its waiting room "
                "(scale from zero): what an autoscaler scales on.",
                stack=True,
            )
        )
        .with_panel(
            ts(
                "Mean wait for a slot by class",
                "s",
                [q(wait, "{{class}}")],
                desc="Seconds from arrival at the replica to a slot in its engine.",
            )
        )
        .with_panel(
            ts(
                "Shed and displaced per second by class",
                "reqps",
                [
                    q(rate("tokenbus_flow_shed_total", M, "class"), "shed {{class}}"),
                    q(
                        rate("tokenbus_flow_displaced_total", M, "class"),
                        "displaced {{class}}",
                        ref="B",
                    ),
                ],
                desc="Shed: refused after waiting (class limit, deadline) or to make room "
                "for a higher class. Displaced: put back before its first byte.",
            )
        )
        .with_panel(
            ts(
                "Share of tokens by flow (key or owner)",
                "short",
                [q(rate("tokenbus_flow_key_tokens_total", M, "flow"), "{{flow}}")],
                desc="Tokens served per second to each flow at the replicas: the fair shares.",
                stack=True,
                span=12,
            )
        )
        .with_panel(
            ts(
                "Budgets past their soft threshold",
                "currencyUSD",
                [q("max by (scope, period) (tokenbus_budget_spent_usd)", "{{scope}} {{period}}")],
                desc="Spend when a key's or owner's soft budget threshold was crossed.",
                span=12,
            )
        )
    )


def kv_routing() -> Section:
    """KV-cache routing (router/kv_index.py): the index, its events, and decisions."""
    return (
        Section("KV-cache routing: index, events, decisions")
        .with_panel(
            ts(
                "Prompt blocks cached at the chosen replica",
                "percentunit",
                [
                    q(
                        f"{rate('tokenbus_kv_route_cached_blocks_total')}"
                        f" / {rate('tokenbus_kv_route_prompt_blocks_total')}",
                        "cached share",
                    ),
                    q(
                        f"{rate('tokenbus_kv_route_hit_decisions_total')}"
                        f" / {rate('tokenbus_kv_route_decisions_total')}",
                        "decisions with a hit",
                        ref="B",
                    ),
                    q(
                        f"{rate('tokenbus_kv_route_behind_decisions_total')}"
                        f" / {rate('tokenbus_kv_route_decisions_total')}",
                        "decided while the fleet was behind",
                        ref="C",
                    ),
                ],
                desc="kv_aware: of the prompt blocks routed, the share the chosen replica "
                "held in its KV cache; and the share of decisions that found any. "
                "predicted_latency: the share of decisions made while every replica had a "
                "prefill backlog (scored by the fleet's prefill work, docs/routing.md).",
            )
        )
        .with_panel(
            ts(
                "Reported / predicted cached tokens (closed loop)",
                "percentunit",
                [
                    q(
                        "sum by (replica) (rate(tokenbus_kv_reported_tokens_total"
                        f"{{{M}}}{RATE})) / sum by (replica) "
                        f"(rate(tokenbus_kv_predicted_tokens_total{{{M}}}{RATE}))",
                        "{{replica}}",
                    ),
                    q(
                        "sum by (router) (rate(tokenbus_kv_reported_tokens_total"
                        f"{{{M}}}{RATE})) / sum by (router) "
                        f"(rate(tokenbus_kv_predicted_tokens_total{{{M}}}{RATE}))",
                        "router {{router}}",
                        ref="B",
                    ),
                    q("sum(tokenbus_kv_disagreeing_replicas)", "disagreeing replicas", ref="C"),
                    q("sum(tokenbus_kv_incompatible_replicas)", "incompatible replicas", ref="D"),
                ],
                desc="The prompt tokens engines reported reading from their KV cache over "
                "those the routers predicted from their KV events (1 = the index is right; "
                "alert TokenbusKVPredictionOff), per replica and per router; and the replicas "
                "routers route by load for disagreeing, or refuse for hashing otherwise "
                "(docs/routing.md).",
            )
        )
        .with_panel(
            ts(
                "Learned engine speed per replica (predicted_latency's inputs)",
                "ms",
                [
                    q(
                        f"max by (replica) (tokenbus_replica_ttft_base_ms{{{M}}})",
                        "base {{replica}}",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_prefill_ms_per_token{{{M}}}) * 1000",
                        "prefill per 1k tokens {{replica}}",
                        ref="B",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_queue_ms_per_waiting{{{M}}})",
                        "per waiting {{replica}}",
                        ref="C",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_backlog_ms_per_token{{{M}}}) * 1000",
                        "backlog per 1k tokens {{replica}}",
                        ref="F",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_prefill_backlog_tokens{{{M}}})"
                        f" * on (replica) max by (replica) "
                        f"(tokenbus_replica_backlog_ms_per_token{{{M}}})",
                        "backlog now {{replica}}",
                        ref="G",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_tpot_base_ms{{{M}}})",
                        "tpot {{replica}}",
                        ref="D",
                    ),
                    q(
                        f"max by (replica) (tokenbus_replica_tpot_ms_per_running{{{M}}})",
                        "tpot per running {{replica}}",
                        ref="E",
                    ),
                ],
                desc="What each replica learned of its engine from its own requests: time to "
                "first token of an empty prompt, prefill per 1000 prompt tokens computed, wait "
                "per 1000 prompt tokens of others still to compute and per sequence queued "
                "ahead; the wait its prefill backlog means now; time per output token alone "
                "and per running sequence (docs/routing.md, predicted_latency).",
            )
        )
        .with_panel(
            ts(
                "Index size per replica",
                "short",
                [q("sum by (replica) (tokenbus_kv_index_entries)", "{{replica}}")],
                desc="Blocks each replica's cache holds, as the routers know them from its "
                "KV events (summed over routers and bridges that follow them).",
                stack=True,
            )
        )
        .with_panel(
            ts(
                "KV events, gaps and repairs per second",
                "ops",
                [
                    q(rate("tokenbus_kv_index_events_total"), "events"),
                    q(rate("tokenbus_kv_index_gaps_total"), "gaps", ref="B"),
                    q(rate("tokenbus_kv_index_repairs_total"), "snapshots loaded", ref="C"),
                ],
                desc="Events applied; gaps in a replica's event numbers (a snapshot repairs "
                "each); snapshots loaded (warm starts and repairs).",
            )
        )
        .with_panel(
            ts(
                "KV event lag and index memory",
                "s",
                [
                    q("max by (replica) (tokenbus_kv_event_lag_seconds)", "lag {{replica}}"),
                    q("sum(tokenbus_kv_index_bytes) / 1e9", "index GB", ref="B"),
                ],
                desc="How old each replica's last event batch was on arrival; the index's "
                "memory estimate (in GB on the same axis).",
            )
        )
    )


def batches() -> Section:
    """The Batch API (jobs/batch_runner.py, docs/batches.md): lines and batches."""
    return (
        Section("Batches: lines run from spare capacity")
        .with_panel(
            ts(
                "Batch lines per second",
                "ops",
                [
                    q(f"sum by (outcome) ({rate('tokenbus_batch_lines_total')})", "{{outcome}}"),
                ],
                desc="Lines the bridges' runners settled (ok, error) or sent back to retry.",
                stack=True,
            )
        )
        .with_panel(
            ts(
                "Batch lines pending",
                "short",
                [q("max(tokenbus_batch_lines_pending)", "queued or running")],
                desc="Lines in the work queue or running, the deployment's.",
            )
        )
        .with_panel(
            ts(
                "Batches by status",
                "short",
                [q("max by (status) (tokenbus_batches)", "{{status}}")],
                desc="The deployment's batches (each bridge reports the same count).",
            )
        )
        .with_panel(
            ts(
                "Oldest open batch",
                "s",
                [q("max(tokenbus_batch_oldest_open_age_seconds)", "age")],
                desc="How long the oldest batch not yet finished has been open.",
            )
        )
    )


def bus() -> Section:
    return (
        Section("NATS and services")
        .with_panel(
            single("Telemetry on NATS", "short", "min(tokenbus_nats_connected)", steps=GREEN_AT_1)
        )
        .with_panel(
            single(
                "Key store",
                "short",
                "min(tokenbus_keystore_up)",
                desc="The API-key bucket's stream answers.",
                steps=GREEN_AT_1,
            )
        )
        .with_panel(
            single(
                "NATS round trip",
                "s",
                "max(tokenbus_nats_rtt_seconds)",
                steps=[(None, "green"), (0.01, "orange"), (0.1, "red")],
            )
        )
        .with_panel(
            single(
                "Telemetry records dropped",
                "short",
                f"sum(increase(tokenbus_telemetry_dropped_total{RATE}))",
                steps=[(None, "green"), (1.0, "red")],
            )
        )
        .with_panel(
            single(
                "Targets up", "short", 'sum(up{job=~"telemetry|bridge"})', steps=GREEN_AT_1, span=8
            )
        )
        .with_panel(
            ts(
                "Service instances on the bus",
                "short",
                [q("tokenbus_service_instances", "{{service}}")],
                desc="Instances answering $SRV.PING; one that loses NATS stops answering.",
            )
        )
        .with_panel(
            ts(
                "NATS messages/s, reconnects",
                "short",
                [
                    q(rate("tokenbus_nats_messages_total", by="direction"), "{{direction}}"),
                    q(
                        f"sum(increase(tokenbus_nats_reconnects_total{RATE}))",
                        "reconnects",
                        ref="B",
                    ),
                ],
            )
        )
        .with_panel(
            ts(
                "Bridge HTTP",
                "reqps",
                [
                    q(rate("tokenbus_bridge_requests_total", by="status"), "{{status}}"),
                    q(
                        rate("tokenbus_bridge_http_refused_total", by="code"),
                        "refused {{code}}",
                        ref="B",
                    ),
                ],
                desc="The bridges' own /metrics (per process).",
            )
        )
    )


def build() -> dm.Dashboard:
    """The dashboard, built."""
    ds_var = db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    model = (
        db.QueryVariable("model")
        .label("Model")
        .datasource(DS)
        .query("label_values(tokenbus_requests_total, model)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )
    source = (
        db.CustomVariable("source")
        .label("Source")
        .values("http,worker")
        .current(dm.VariableOption(selected=True, text="http", value="http"))
        .description("http: what HTTP callers saw; worker: every request, as engines saw it.")
    )
    board = (
        db.Dashboard("tokenbus")
        .uid(UID)
        .description("LLM serving on NATS: traffic, latency, errors, usage, replicas, bus.")
        .tags(["tokenbus", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .readonly()
        .with_variable(ds_var)
        .with_variable(model)
        .with_variable(source)
    )
    sections = (
        traffic(),
        latency(),
        breakdown(),
        errors(),
        usage(),
        replicas(),
        flow(),
        kv_routing(),
        batches(),
        bus(),
    )
    for section in sections:
        board = board.with_row(db.Row(section.title).collapsed(False))
        for panel in section.panels:
            board = board.with_panel(panel)
    built = board.build()
    for i, item in enumerate(built.panels or [], 1):  # stable ids, in reading order
        item.id_val = i
    return built


def render() -> str:
    """The dashboard as the JSON committed beside this file."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build()) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
    json.loads(OUT.read_text())  # parses
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
