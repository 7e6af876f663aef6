"""Observability as an operator gets it: the field's metrics (vLLM's and Dynamo's names and
buckets) with trace exemplars, read back by a real Prometheus that scrapes a running stack with
the shipped config; the alert rules (promtool); the Grafana dashboard (its generator, the
foundation SDK's model, queries naming metrics that exist); the telemetry role's probes on the
locked bus; every metric documented."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from auth.store import BUCKET, KeyStore
from services.natsconf import ROLES, role_login
from telemetry import records
from telemetry.metrics import ITL, REQUEST_LATENCY, TTFT, UNKNOWN_MODEL, Metrics, status_class
from telemetry.service import INBOX_ROOT, KEYS_INFO, PING, Telemetry
from tests.lockedbus import LockedBus
from tests.support.busdata import key_store
from tests.support.inprocess import settings
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.pids import stop_process
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import ROOT
from tests.support.waits import wait_for

PROM_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DOCS = ROOT / "docs" / "telemetry.md"
MSG = [{"role": "user", "content": "hi"}]
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "no prometheus binary on PATH (Debian: apt-get install prometheus)"
NO_PROMTOOL = "no promtool on PATH (Debian's prometheus package ships it)"


# -- helpers -----------------------------------------------------------------------------------


def exported(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can hold, families without samples included."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (tokenbus' and Prometheus' ``up``)."""
    return set(re.findall(r"\b(tokenbus_[a-z0-9_]+|up)\b(?=\s*[{\[)=<>!/*+-]|\s*$)", expr))


def dashboard_exprs() -> list[str]:
    doc = json.loads((GRAFANA_DIR / "tokenbus.json").read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", GRAFANA_DIR / "build_dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def record(**kw: Any) -> dict[str, Any]:
    ms, t0 = 1_000_000, 1_700_000_000_000_000_000
    t = {"t0": t0, "engine_start": t0 + 5 * ms, "first_token": t0 + 30 * ms,
         "engine_end": t0 + 95 * ms}  # fmt: skip
    args: dict[str, Any] = {
        "request_id": "r", "source": "worker", "model": "m", "timings": t, "outcome": "stop",
        "replica": "m-0", "principal": "k1", "prompt_tokens": 12, "completion_tokens": 6,
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", **kw,
    }  # fmt: skip
    return records.build(**args)


# -- metrics, offline ----------------------------------------------------------------------------


@pytest.mark.unit
def test_buckets_are_vllms() -> None:
    assert TTFT[:4] == (0.001, 0.005, 0.01, 0.02) and TTFT[-1] == 2560.0 and len(TTFT) == 22
    assert ITL[0] == 0.01 and ITL[-1] == 80.0 and len(ITL) == 19
    assert (
        REQUEST_LATENCY[0] == 0.3 and REQUEST_LATENCY[-1] == 7680.0 and len(REQUEST_LATENCY) == 21
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("outcome", "status", "want"),
    [
        ("stop", None, "success"),
        ("length", None, "success"),
        ("ok", 200, "success"),
        ("content_filter", None, "success"),
        ("cancelled", None, "cancelled"),
        ("cancelled", 499, "cancelled"),
        ("rate_limit_exceeded", 429, "client_error"),
        ("model_not_found", 404, "client_error"),
        ("content_blocked.secret", 400, "client_error"),
        ("no_replica", 503, "server_error"),
        ("engine_error", 200, "server_error"),  # failed after the stream's 200 header
        ("timeout", None, "server_error"),
        ("some_new_code", 502, "server_error"),
    ],
)
def test_outcomes_are_classed(outcome: str, status: int | None, want: str) -> None:
    assert status_class({"outcome": outcome, "status": status}) == want


@pytest.mark.unit
def test_records_feed_the_fields_metrics_and_usage_per_key() -> None:
    m = Metrics()
    m.heartbeat({"replica": "m-0", "model": "m", "in_flight": 3, "max_concurrency": 8,
                 "kv_usage": 0.25, "interval_s": 60, "aliases": ["m-lora"]})  # fmt: skip
    m.observe(record())
    m.observe(record(source="http", outcome="ok", status=200))
    m.observe(record(source="http", model="typo", outcome="model_not_found", status=404))
    m.observe(record(source="http", model="m-lora", outcome="no_replica", status=503))
    val = m.registry.get_sample_value
    lab = {"model": "m", "replica": "m-0", "source": "worker"}
    assert val("tokenbus_time_to_first_token_seconds_count", lab) == 1
    assert val("tokenbus_time_to_first_token_seconds_bucket", {**lab, "le": "0.04"}) == 1
    assert val("tokenbus_inter_token_latency_seconds_count", lab) == 1
    assert val("tokenbus_e2e_request_latency_seconds_count", lab) == 1
    assert val("tokenbus_request_queue_time_seconds_sum", {"model": "m", "replica": "m-0"}) == 0.005
    assert val("tokenbus_request_success_total",
               {"model": "m", "replica": "m-0", "finished_reason": "stop"}) == 1  # fmt: skip
    assert val("tokenbus_prompt_tokens_total", {"model": "m", "replica": "m-0"}) == 12
    assert val("tokenbus_generation_tokens_total", {"model": "m", "replica": "m-0"}) == 6
    assert val("tokenbus_request_generation_tokens_bucket", {"model": "m", "le": "10.0"}) == 1
    # Chargeback: the key's id, its model, tokens counted once (from the engine's record).
    assert val("tokenbus_key_tokens_total", {"key_id": "k1", "model": "m", "direction": "out"}) == 6
    key = {"key_id": "k1", "model": "m", "source": "http", "status": "success"}
    assert val("tokenbus_key_requests_total", key) == 1
    # A caller's typo is no label; an alias a replica announced is.
    reqs = {(s.labels["model"], s.labels["outcome"], s.labels["status"])
            for f in m.registry.collect() if f.name == "tokenbus_requests"
            for s in f.samples if s.name.endswith("_total")}  # fmt: skip
    assert (UNKNOWN_MODEL, "model_not_found", "client_error") in reqs
    assert ("m-lora", "no_replica", "server_error") in reqs
    assert not any(model == "typo" for model, _, _ in reqs)
    # The exemplar carries the trace id (OpenMetrics only).
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    text = openmetrics(m.registry).decode()
    assert '# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"}' in text
    assert 'tokenbus_replica_kv_cache_usage{model="m",replica="m-0"} 0.25' in text


@pytest.mark.unit
async def test_replicas_that_stop_heartbeating_disappear_and_their_model_shows_zero() -> None:
    m = Metrics()
    m.heartbeat({"replica": "m-0", "model": "m", "interval_s": 0.05, "draining": False})
    m.heartbeat({"replica": "n-0", "model": "n", "interval_s": 60, "draining": True})
    val = m.registry.get_sample_value
    assert val("tokenbus_model_replicas", {"model": "m"}) == 1
    assert val("tokenbus_model_replicas", {"model": "n"}) == 0  # draining takes nothing
    await wait_for(
        lambda: val("tokenbus_model_replicas", {"model": "m"}) == 0,
        what="the silent replica was kept",
    )
    assert val("tokenbus_model_replicas", {"model": "m"}) == 0
    assert val("tokenbus_replica_in_flight", {"model": "m", "replica": "m-0"}) is None


@pytest.mark.unit
def test_every_metric_is_documented() -> None:
    docs = DOCS.read_text()
    bridge = {"tokenbus_bridge_requests_total", "tokenbus_bridge_request_seconds",
              "tokenbus_bridge_http_refused_total"}  # fmt: skip
    fams = list(text_string_to_metric_families(generate_latest(Metrics().registry).decode()))
    names = {f.name + ("_total" if f.type == "counter" else "") for f in fams}
    names = {n for n in names if not n.endswith("_created")} | bridge
    missing = sorted(n for n in names if f"`{n}`" not in docs)
    assert not missing, f"not in docs/telemetry.md: {missing}"


# -- alerts and the dashboard, offline -------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_alert_rules_and_the_prometheus_config_pass_promtool() -> None:
    assert PROMTOOL is not None
    for args in (
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts_test.yml"],  # each alert fires on its trouble, not otherwise
    ):
        r = subprocess.run(
            [PROMTOOL, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    names = {r["alert"] for r in alert_rules()}
    assert {
        "TokenbusHighErrorRate",
        "TokenbusTimeToFirstTokenHigh",
        "TokenbusModelWithoutReplicas",
        "TokenbusServiceGone",
        "TokenbusKeyStoreUnreachable",
    } <= names


@pytest.mark.unit
def test_the_dashboard_is_its_generators_output_and_loads_in_the_sdks_model() -> None:
    pytest.importorskip(
        "grafana_foundation_sdk", reason="grafana-foundation-sdk (a dev dependency) is missing"
    )
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import dashboard, prometheus

    text = (GRAFANA_DIR / "tokenbus.json").read_text()
    assert load_generator().render() == text, "run: python deploy/grafana/build_dashboard.py"
    register_default_plugins()
    raw = json.loads(text)
    board = dashboard.Dashboard.from_json(raw)
    assert json.loads(JSONEncoder().encode(board)) == raw  # nothing the model does not know
    panels = [p for p in board.panels or [] if isinstance(p, dashboard.Panel)]
    titles = {p.title for p in board.panels or [] if isinstance(p, dashboard.RowPanel)}
    assert {"Traffic", "Latency", "Where the time goes", "Errors", "Usage per API key",
            "Replicas", "NATS and services"} <= titles  # fmt: skip
    for p in panels:
        assert p.title and p.targets, p.title
        for t in p.targets:
            assert isinstance(t, prometheus.Dataquery), (p.title, t)
    exprs = " ".join(dashboard_exprs())
    for must in ("tokenbus_time_to_first_token_seconds_bucket", "tokenbus_key_tokens_total",
                 "tokenbus_replica_kv_cache_usage", "tokenbus_service_instances",
                 "tokenbus_stage_seconds_sum", "by (model, replica, le)"):  # fmt: skip
        assert must in exprs, must
    assert any(t.get("exemplar") for p in raw["panels"] for t in p.get("targets", []))


# -- a real Prometheus on a running stack ----------------------------------------------------------


class Prometheus:
    """Debian's prometheus on the shipped config, pointed at local targets, scraping every
    second, with exemplar storage; its data in ``folder``."""

    def __init__(self, folder: Path, targets: dict[str, int]) -> None:
        assert PROMETHEUS is not None
        cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        cfg["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
        cfg["rule_files"] = [str(PROM_DIR / f) for f in cfg["rule_files"]]
        jobs = cfg["scrape_configs"]
        assert {j["job_name"] for j in jobs} == set(targets)
        for job in jobs:  # the compose network's DNS names, here local ports
            job.pop("dns_sd_configs")
            job["static_configs"] = [{"targets": [f"127.0.0.1:{targets[job['job_name']]}"]}]
        folder.mkdir(parents=True)
        (folder / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.api = f"http://127.0.0.1:{self.port}/api/v1"

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()

    async def get(self, path: str, **params: Any) -> Any:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.get(f"{self.api}/{path}", params=params)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, expr: str) -> dict[str, float]:
        """An instant query: each series' value, keyed by its labels as a sorted string."""
        data = await self.get("query", query=expr)
        return {
            ",".join(f"{k}={v}" for k, v in sorted(r["metric"].items())): float(r["value"][1])
            for r in data["result"]
        }

    async def until(self, expr: str, ok: Any, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            with_error: Exception | None = None
            try:
                got = await self.query(expr)
                if ok(got):
                    return got
            except (httpx.HTTPError, AssertionError) as exc:
                with_error = exc
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: {got if with_error is None else with_error}")
            await asyncio.sleep(0.5)


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Iterator[Path]:
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    yield tmp_path / "prometheus"


@pytest.mark.stack
async def test_prometheus_scrapes_the_stack_and_reads_ttft_and_its_exemplar_back(
    procs: Procs, model: str, tmp_path: Path, nats_server: NatsServer, prometheus_dir: Path
) -> None:
    async with key_store(nats_server.url, watch=False):
        pass  # the key bucket exists: the key-store probe has something to find
    mport = free_port()
    tel = procs.start("telemetry", "serve", "telemetry", env={
        "TOKENBUS_TELEMETRY__DB_PATH": str(tmp_path / "telemetry.db"),
        "TOKENBUS_TELEMETRY__METRICS_PORT": str(mport),
        "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "0.1",
        "TOKENBUS_TELEMETRY__PROBE_INTERVAL_S": "0.5",
    })  # fmt: skip
    stack = await start_stack(procs, model)
    # The telemetry service hears the records (its subscriptions are in effect).
    await wait_for(lambda: "service_started" in tel.output(), timeout=30, what="no telemetry")
    assert stack.port is not None
    prom = Prometheus(prometheus_dir, {"telemetry": mport, "bridge": stack.port})
    try:
        traces = [uuid.uuid4().hex for _ in range(4)]
        async with stack.openai() as api:
            for trace in traces:
                stream = await api.chat.completions.create(
                    model=model, messages=MSG, max_tokens=4, stream=True,
                    extra_headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
                )  # type: ignore[call-overload]  # fmt: skip
                async for _ in stream:
                    pass
        # The TTFT histogram, as Prometheus stored it.
        sel = f'model="{model}", source="http"'
        count = f"sum(tokenbus_time_to_first_token_seconds_count{{{sel}}})"
        await prom.until(count, lambda got: sum(got.values()) == len(traces))
        p95 = await prom.query(
            f"histogram_quantile(0.95, sum by (le) (tokenbus_time_to_first_token_seconds_bucket"
            f"{{{sel}}}))"
        )
        (v,) = p95.values()
        assert 0 < v < 10 and not math.isnan(v)
        # An exemplar leads from a bucket to its request's trace.
        now = time.time()
        data = await prom.get(
            "query_exemplars",
            query=f"tokenbus_time_to_first_token_seconds_bucket{{{sel}}}",
            start=now - 300,
            end=now + 60,
        )
        seen = {e["labels"].get("trace_id") for s in data for e in s["exemplars"]}
        assert seen & set(traces), data
        # The stack's health, probed by the telemetry service.
        one = {"": 1.0}
        await prom.until(f'sum(tokenbus_model_replicas{{model="{model}"}})', one.__eq__)
        await prom.until("sum(tokenbus_keystore_up)", one.__eq__)
        await prom.until("sum(tokenbus_nats_connected)", one.__eq__)
        instances = await prom.until(
            "sum by (service) (tokenbus_service_instances)",
            lambda g: {"service=worker", "service=bridge"} <= set(g),
        )
        assert instances["service=telemetry"] == 1
        await prom.until("sum by (job) (up)", {"job=bridge": 1.0, "job=telemetry": 1.0}.__eq__)

        # The alert rules are loaded and evaluate.
        async def rules() -> dict[str, Any]:
            groups = (await prom.get("rules"))["groups"]
            return {r["name"]: r for g in groups for r in g["rules"]}

        loaded = await rules()
        assert set(loaded) == {r["alert"] for r in alert_rules()}
        for _ in range(20):  # evaluated once a second: "unknown" until the first time
            if all(r["health"] == "ok" for r in loaded.values()):
                break
            await asyncio.sleep(0.5)
            loaded = await rules()
        assert all(r["health"] == "ok" for r in loaded.values()), loaded
        assert not await prom.query('ALERTS{alertstate="firing"}')
        # Every dashboard query and alert names a metric the stack exports.
        async with httpx.AsyncClient() as h:
            have = exported((await h.get(f"http://127.0.0.1:{mport}/metrics")).text)
            have |= exported((await h.get(f"{stack.base}/metrics")).text)
        for expr in dashboard_exprs() + [r["expr"] for r in alert_rules()]:
            names = metric_names(expr)
            assert names and names <= have | {"up"}, (expr, sorted(names - have))
    finally:
        prom.stop()


# -- the telemetry role on the locked bus ------------------------------------------------------


@pytest.mark.stack
async def test_the_telemetry_role_may_probe_the_locked_bus_and_read_no_other_inbox(
    tmp_path: Path,
) -> None:
    pub, sub = ROLES["telemetry"]
    assert {PING, KEYS_INFO} <= set(pub) and f"{INBOX_ROOT}.>" in sub
    assert KEYS_INFO.endswith(f"KV_{BUCKET}")
    bus = LockedBus(tmp_path / "bus").start()
    try:
        admin = await bus.admin()
        await KeyStore(admin).open(watch=False)
        await admin.drain()
        login = role_login(bus.users, "telemetry")
        cfg = settings(bus.url, nats_user=login["user"], nats_password=login["password"],
                       telemetry={"db_path": str(tmp_path / "t.db"), "metrics_port": 0,
                                  "probe_interval_s": 0})  # fmt: skip
        async with Telemetry(cfg) as tel:
            await tel.probe()
            health = tel.metrics.health
            assert health.services == {"telemetry": 1}
            assert health.keystore_up == 1.0 and health.rtt_s is not None
            # Its inbox root is its own: another process's inbox stays closed to it.
            errors: list[str] = []

            async def on_error(exc: Exception) -> None:
                errors.append(str(exc))

            import nats

            spy = await nats.connect(bus.url, error_cb=on_error, **login)
            await spy.subscribe("_INBOX.tb.bridge-1.>")
            await spy.flush()
            await wait_for(lambda: any("permissions violation" in e.lower() for e in errors))
            await spy.close()
    finally:
        bus.stop()


@pytest.mark.stack
async def test_probes_that_cannot_see_report_nothing_rather_than_false_alarms(
    tmp_path: Path,
) -> None:
    """A bus config from before the probes (the telemetry role may not ping): no zeros for
    services and key store, which would page someone for nothing."""
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'authorization { users = [{user: "t", password: "p", permissions: '
        '{publish: {deny: ["$SRV.PING", "$JS.API.>"]}}}] }\n'
    )
    proc = spawn_nats(port, "-c", str(conf))
    try:
        cfg = settings(f"nats://127.0.0.1:{port}", nats_user="t", nats_password="p",
                       telemetry={"db_path": str(tmp_path / "t.db"), "metrics_port": 0,
                                  "probe_interval_s": 0})  # fmt: skip
        async with Telemetry(cfg) as tel:
            tel.metrics.health.services = {"router": 2}  # seen before the config went back
            await tel.probe()
            health = tel.metrics.health
            assert health.services == {} and health.keystore_up is None and health.probes == 0
            assert health.rtt_s is not None
    finally:
        proc.terminate()
        proc.wait(10)
