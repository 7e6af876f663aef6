"""Telemetry: per-request records (worker and bridge, merged), the SQLite store, the metrics
endpoint and ``tokenbus report``; on a real bus with real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import structlog
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from bus_schemas import codec
from bus_schemas import errors as E
from telemetry import records
from telemetry.service import Telemetry
from telemetry.store import RecordStore
from tests.support.inprocess import settings, stack
from tests.support.natsserver import NatsServer
from tests.support.ports import free_port, taken_port
from tests.support.procs import Procs, start_stack
from tests.support.repo import run_cli
from tests.support.waits import wait_for
from tokenbus import Client
from tokenbus.evaluation.report import report

MSG = [{"role": "user", "content": "hi"}]
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PATH = ("t0", "ingress", "route", "engine_start", "first_token", "engine_end")


@pytest.mark.unit
def test_record_breaks_the_latency_down() -> None:
    ms = 1_000_000
    t = {"t0": 0, "ingress": 1 * ms, "auth": 3 * ms, "route": 4 * ms, "engine_start": 5 * ms,
         "first_token": 25 * ms, "engine_end": 95 * ms}  # fmt: skip
    r = records.build(
        request_id="r", source="http", model="m", timings=t, outcome="length",
        completion_tokens=8, t1=0, t4=26 * ms, t5=27 * ms, t6=97 * ms,
    )  # fmt: skip
    assert r["stages"] == {"ingress": 1.0, "auth": 2.0, "route": 1.0}
    assert r["engine_ms"] == 20.0 and r["ttft_ms"] == 27.0 and r["e2e_ms"] == 97.0
    assert r["gateway_ms"] == 5.0 + 2.0  # (t2 - t0) + (t5 - t3)
    assert r["tbt_ms"] == 10.0  # (t6 - t5) / 7
    assert r["relay_ms"] == 2.0


@pytest.mark.unit
def test_store_merges_by_request_and_keeps_at_most_max_rows(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "t.db", max_rows=100)
    store.write([{"request_id": "a", "source": "worker", "model": "m", "ts_ns": 1, "engine_ms": 5}])
    store.write([{"request_id": "a", "source": "http", "model": "m", "ts_ns": 1, "status": 200}])
    (row,) = list(store.rows())
    assert row["source"] == "http" and row["engine_ms"] == 5 and row["status"] == 200
    store.write({"request_id": f"r{i}", "ts_ns": 10 + i, "model": "m"} for i in range(250))
    assert store.count() == 100
    ids = [r["request_id"] for r in store.rows()]
    assert ids[0] == "r150" and ids[-1] == "r249"  # the oldest went first
    store.close()
    # It survives a restart: the file is the store.
    again = RecordStore(tmp_path / "t.db", max_rows=100)
    assert again.count() == 100
    again.close()


@contextlib.asynccontextmanager
async def telemetry(url: str, tmp_path: Path, **tel: Any) -> Any:
    cfg = {"db_path": str(tmp_path / "telemetry.db"), "metrics_port": 0,
           "flush_interval_s": 0.1, **tel}  # fmt: skip
    async with Telemetry(settings(url, telemetry=cfg)) as svc:
        yield svc


@pytest.mark.bus
async def test_records_for_success_error_and_cancel_over_nats(
    nats_server: NatsServer, model: str, tmp_path: Path, client: Client
) -> None:
    async with (
        telemetry(nats_server.url, tmp_path) as tel,
        stack(nats_server.url, model, workers=1),
    ):
        ok = await client.chat_completion(model, MSG, max_tokens=5)
        s = client.chat(model, MSG, max_tokens=10_000)
        await s.__anext__()
        await s.aclose()
        late = client.chat(model, MSG, max_tokens=10_000, timeout=0.3)
        with pytest.raises(E.Timeout):
            await late.collect()
        # Records are under the gateway's id (which a stream learns from its accept frame) and
        # carry the client's own as a label: a request that timed out before its accept
        # was read is found by the label.
        want = {ok.request_id, s.client_request_id, late.client_request_id}

        def by_either() -> dict[str, Any]:
            rows = list(tel.store.rows())
            return {r["request_id"]: r for r in rows} | {
                r["client_request_id"]: r for r in rows if r.get("client_request_id")
            }

        def stored() -> bool:
            return want <= set(by_either())

        names = {
            ok.request_id: "answered",
            s.client_request_id: "cancelled",
            late.client_request_id: "late",
        }
        try:
            await wait_for(stored, timeout=60)
        except AssertionError:
            have = set(by_either())
            raise AssertionError(f"no record stored of {[names[r] for r in want - have]}") from None
        rows = by_either()
    done = rows[ok.request_id]
    assert done["outcome"] == "length" and done["completion_tokens"] == 5
    assert done["source"] == "worker" and done["replica"] == f"{model}-w0"
    ts = [done["t"][k] for k in PATH]
    assert ts == sorted(ts), done["t"]  # monotonic along the path
    assert done["ttft_ms"] > 0 and done["e2e_ms"] >= done["ttft_ms"]
    assert set(done["stages"]) == {"ingress", "route"}
    assert rows[s.client_request_id]["outcome"] == "cancelled"
    assert rows[late.client_request_id]["outcome"] == "timeout"
    assert rows[s.client_request_id]["request_id"] == s.request_id != s.client_request_id


@pytest.mark.bus
async def test_telemetry_buffer_is_bounded_and_the_rest_waits_in_the_stream(
    nats_server: NatsServer, model: str, tmp_path: Path, client: Client
) -> None:
    # A full buffer is written at once (not at the next flush, a minute away here), and
    # meanwhile the service fetches nothing more: the records wait in the stream, none dropped.
    # What is left in the buffer once every record is in (fewer than a full buffer: how many
    # depends on how the records were batched into messages) waits for the next flush.
    async with (
        telemetry(nats_server.url, tmp_path, max_buffer=3, flush_interval_s=60) as tel,
        stack(nats_server.url, model, workers=1),
    ):
        assert tel.durable
        outs = await asyncio.gather(
            *(client.chat_completion(model, MSG, max_tokens=2) for _ in range(9))
        )
        assert all(o.usage.completion_tokens == 2 for o in outs)
        want = {o.request_id for o in outs}

        def taken() -> bool:
            placed = {r["request_id"] for r in tel.store.rows()}
            placed |= {r.get("request_id") for r in tel.buffer}
            # The count of written rows follows the write, which runs in a thread: rows can
            # be read before it is counted (a run on a loaded machine failed so).
            return len(tel.buffer) < 3 and want <= placed and tel.written >= 9 - len(tel.buffer)

        # Full buffers went without the interval: written within the wait, the flush a
        # minute away.
        await wait_for(taken, timeout=10, what="every record stored or in a buffer not full")
        await tel.flush()  # the next flush
        assert want <= {r["request_id"] for r in tel.store.rows()}
        assert tel.metrics.dropped._value.get() == 0


@pytest.mark.bus
async def test_records_travel_together_and_every_one_is_read(
    nats_server: NatsServer, nc: NATS, tmp_path: Path
) -> None:
    # A process's records of one batch window go as one message; the service reads each
    # one, and a batch with junk in it loses the junk only.
    seen = await nc.subscribe(records.subject())
    await nc.flush()

    def rec(rid: str) -> dict[str, Any]:
        return records.build(
            request_id=rid, source="worker", model="m", timings={"t0": 1}, outcome="length"
        )

    async with telemetry(nats_server.url, tmp_path) as tel:
        recorder = records.Recorder(nc)
        for i in range(5):
            recorder.add(rec(f"b{i}"))
        await wait_for(lambda: recorder.messages == 1, timeout=5)
        msg = await seen.next_msg(timeout=5)
        assert [r["request_id"] for r in records.batch(codec.decode_map(msg.data))] == [
            f"b{i}" for i in range(5)
        ]
        # A stopping process sends what waits at once, without the window.
        recorder.add(rec("last"))
        await recorder.flush()
        await nc.flush()
        msg = await seen.next_msg(timeout=0.5)
        assert codec.decode_map(msg.data)["request_id"] == "last"  # alone: sent as itself
        bad = {**rec("bad"), "prompt_tokens": -(2**63)}
        junk = {"records": [1, "x", None, [rec("nested")], bad, rec("good"), *[7] * 5000]}
        with structlog.testing.capture_logs() as logs:
            await nc.publish(records.subject(), codec.encode(junk))

            def stored() -> set[str]:
                return {r["request_id"] for r in tel.store.rows()}

            await wait_for(lambda: {"b0", "b4", "last", "good"} <= stored(), timeout=10)
        assert "nested" not in stored()
        assert not tel.stopped.is_set()
        # 5 005 bad records, one warning that counts them.
        warned = [e for e in logs if e["event"] == "bad_record_dropped"]
        assert len(warned) == 1, warned
        w = warned[0]
        assert (w["count"], w["of"], w["error"]) == (5005, 5006, "not a map")
    # Unread messages (the junk) would hold the connection's drain for its 30 s timeout.
    await seen.unsubscribe()


@pytest.mark.stack
async def test_http_records_metrics_and_report(procs: Procs, model: str, tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    mport = free_port()
    env = {
        "TOKENBUS_TELEMETRY__DB_PATH": str(db),
        "TOKENBUS_TELEMETRY__METRICS_PORT": str(mport),
        "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "0.1",
    }
    tel = procs.start("telemetry", "serve", "telemetry", env=env)
    stack = await start_stack(procs, model)
    # The telemetry service hears the records (its subscriptions are in effect).
    await wait_for(lambda: "service_started" in tel.output(), timeout=30, what="no telemetry")
    async with stack.openai() as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=model, messages=MSG, max_tokens=4, extra_headers={"traceparent": TRACE}
        )  # type: ignore[call-overload]
        # The gateway's share of the time to first token, like LiteLLM's overhead header.
        assert float(raw.headers["x-tokenbus-gateway-ms"]) >= 0
        assert float(raw.headers["x-tokenbus-engine-ms"]) > 0
        stream = await api.chat.completions.create(
            model=model, messages=MSG, max_tokens=6, stream=True
        )  # type: ignore[call-overload]
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await api.chat.completions.create(model="no-such-model", messages=MSG)  # type: ignore[call-overload]

    def requests_counted() -> dict[tuple[str, str], float]:
        try:
            text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        # This test's model (and the unknown one of the refusal): records that other tests
        # left in the session's stream are counted too.
        return {
            (s.labels["source"], s.labels["outcome"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "tokenbus_requests"
            for s in f.samples
            if s.name == "tokenbus_requests_total"
            and s.labels["model"] in (model, "(unknown)", "no-such-model")
        }

    def merged_rows() -> int:
        if not db.exists():
            return 0
        store = RecordStore(db)
        try:
            return sum(1 for r in store.rows() if r["model"] == model and r["replica"])
        finally:
            store.close()

    # Until every record was counted and stored: the HTTP side's and the worker's.
    want = {("http", "ok"): 2, ("worker", "length"): 2, ("http", "model_not_found"): 1}
    await wait_for(
        lambda: (
            all(requests_counted().get(k, 0) >= n for k, n in want.items()) and merged_rows() >= 2
        ),
        timeout=20,
        interval=0.1,
        what="the records were not all counted and stored",
    )
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"http://127.0.0.1:{mport}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "tokenbus_ttft_seconds" in families and "tokenbus_gateway_latency_seconds" in families
    reqs = {
        (s.labels["source"], s.labels["outcome"]): s.value
        for s in families["tokenbus_requests"].samples
        if s.name == "tokenbus_requests_total" and s.labels["model"] == model
    }
    assert reqs[("http", "ok")] == 2 and reqs[("worker", "length")] == 2
    assert requests_counted()[("http", "model_not_found")] >= 1
    inflight = families["tokenbus_replica_in_flight"].samples
    assert any(s.labels["model"] == model for s in inflight)
    # The merged rows: one per request, the HTTP side's times, the worker's replica.
    store = RecordStore(db)
    rows = [r for r in store.rows() if r["model"] == model]
    store.close()
    assert len(rows) == 2 and all(r["source"] == "http" and r["status"] == 200 for r in rows)
    # W3C trace context from the HTTP caller reached the worker and the record.
    assert sorted(str(r["trace_id"]) for r in rows) == ["4bf92f3577b34da6a3ce929d0e0e4736", "None"]
    worker_log = stack.workers[0].output()
    assert "4bf92f3577b34da6a3ce929d0e0e4736" in worker_log
    for r in rows:
        t = r["t"]
        ts = [t["t1"], t["engine_start"], t["first_token"], t["t4"], t["t5"], t["t6"]]
        assert ts == sorted(ts), t
        assert r["replica"] and r["gateway_ms"] > 0 and r["engine_ms"] > 0
    # The report: a table and four plots.
    out = tmp_path / "report"
    res = run_cli("report", "--db", str(db), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| model | requests |" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["models"][model]["requests"] == 2
    # The first token's time by hop: reading the request, the bus hop to the engine, the
    # engine, the way back; what the request spent, hop by hop, is all accounted for.
    stages = summary["models"][model]["mean_ms_by_stage"]
    assert stages["receive"] > 0 and stages["dispatch"] > 0 and stages["engine"] > 0
    assert stages["relay"] > 0
    for png in ("latency_breakdown", "latency_over_time", "throughput", "replica_load"):
        assert (out / f"{png}.png").stat().st_size > 1000
    missing = run_cli("report", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 1 and "no telemetry store" in missing.stdout


@pytest.mark.unit
def test_forged_heartbeats_and_reports_cannot_keep_a_ghost_on_the_dashboard() -> None:
    """The replica table behind the console and the metrics takes a heartbeat's interval as
    the router does: infinite, not a number or not positive is refused, nothing stored;
    past ``MAX_INTERVAL_S`` it is held to it, so a forged beat's replica (and a router's
    report of held requests) still expires. Before, ``inf`` or ``1e12`` kept it forever."""
    from bus_schemas.messages import MAX_INTERVAL_S
    from telemetry.metrics import ReplicaLoad

    load = ReplicaLoad()
    beat = {"replica": "ghost", "model": "m", "in_flight": 1, "seq": 1}
    inf, nan = float("inf"), float("nan")
    for bad in ({"interval_s": inf}, {"interval_s": nan}, {"interval_s": -1.0},
                {"interval_s": True}, {"interval_s": 1.0, "in_flight": inf}):  # fmt: skip
        with pytest.raises((ValueError, OverflowError)):
            load.heartbeat({**beat, **bad})
        assert load.replicas == {}, bad
    load.heartbeat({**beat, "interval_s": 1e12})
    assert [rid for rid, _ in load.live()] == ["ghost"]
    assert load.replicas["ghost"].interval_s == MAX_INTERVAL_S
    load.replicas["ghost"].seen -= MAX_INTERVAL_S * load.missed + 1
    assert load.live() == []  # silent past three of the longest intervals: gone

    report = {"instance": "router-x", "waiting": {"m": {"default": 3}}}
    for bad_interval in (inf, nan, 0):
        load.queue_report({**report, "interval_s": bad_interval})
        assert load.holding() == {}, bad_interval
    load.queue_report({**report, "interval_s": 1e12})
    assert load.holding() == {("m", "default"): 3}
    held, iv, seen = load.held["router-x"]
    load.held["router-x"] = (held, iv, seen - MAX_INTERVAL_S * load.missed - 1)
    assert load.holding() == {}


@pytest.mark.unit
def test_report_on_an_empty_store(tmp_path: Path) -> None:
    RecordStore(tmp_path / "e.db").close()
    summary = report(tmp_path / "e.db", tmp_path / "out")
    assert summary["requests"] == 0 and (tmp_path / "out" / "summary.md").exists()


@pytest.mark.bus
async def test_a_migrated_request_is_recorded_with_its_migration(
    nats_server: NatsServer, model: str, tmp_path: Path, client: Client
) -> None:
    async with (
        telemetry(nats_server.url, tmp_path) as tel,
        stack(nats_server.url, model, workers=2) as svcs,
    ):
        s = client.chat(model, MSG, max_tokens=400)
        await s.__anext__()
        dead = next(w for w in svcs["workers"] if w.replica == s.replica)
        # A kill -9 as the bus sees it: no more frames, no more heartbeats.
        dead._hb_task.cancel()
        dead.outbox.send = lambda reply, frame: None  # type: ignore[method-assign]
        async for _ in s:
            pass
        # Moved at least once (a loaded machine may hold the survivor's beats back long
        # enough for its caller to move it again): the record says how often.
        assert s.migrations >= 1
        for task in list(dead._active.values()):
            task.cancel()

        def stored() -> bool:
            return any(
                r["request_id"] == s.request_id and r["migrations"] == s.migrations
                for r in tel.store.rows()
            )

        await wait_for(stored, timeout=10)
        row = next(r for r in tel.store.rows() if r["request_id"] == s.request_id)
    assert row["outcome"] == "length" and row["replica"] != dead.replica


@pytest.mark.unit
def test_traceparent_is_validated_and_its_trace_id_read() -> None:
    from bus_schemas import headers as H
    from bus_schemas import marks

    assert marks.traceparent(" " + TRACE.upper() + " ") == TRACE
    assert marks.trace_id({H.TRACEPARENT: TRACE}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    for bad in ("", "00-xyz-00f067aa0ba902b7-01", "a-b-c-d", None):
        assert marks.traceparent(bad) is None
    assert marks.trace_id({H.TRACEPARENT: "a-b-c-d"}) is None and marks.trace_id(None) is None


@pytest.mark.stack
async def test_a_taken_metrics_port_turns_the_endpoint_off_not_the_service(
    procs: Procs, model: str, tmp_path: Path
) -> None:
    # Two stacks on one host: the second telemetry service finds 9464 (here: any port)
    # taken. It says so once and goes on storing records, instead of crashing in a loop.
    db = tmp_path / "telemetry.db"
    with taken_port() as taken:
        env = {
            "TOKENBUS_TELEMETRY__DB_PATH": str(db),
            "TOKENBUS_TELEMETRY__METRICS_PORT": str(taken),
            "TOKENBUS_TELEMETRY__FLUSH_INTERVAL_S": "0.1",
        }
        tel = procs.start("telemetry", "serve", "telemetry", env=env)
        stack = await start_stack(procs, model)
        # The telemetry service hears the records (its subscriptions are in effect).
        await wait_for(lambda: "service_started" in tel.output(), timeout=30, what="no telemetry")
        async with stack.openai() as api:
            await api.chat.completions.create(model=model, messages=MSG, max_tokens=3)  # type: ignore[call-overload]
        for _ in range(50):
            if db.exists() and any(r["model"] == model for r in RecordStore(db).rows()):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"no record stored: {tel.output()[-2000:]}")
        assert tel.alive()
        warned = [ln for ln in tel.output().splitlines() if "metrics_port_taken" in ln]
        assert len(warned) == 1 and str(taken) in warned[0], tel.output()[-2000:]
