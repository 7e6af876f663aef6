"""OpenTelemetry tracing across every hop, end to end: the real processes of a stack export
their spans over OTLP/HTTP to a receiver in this test (decoded with opentelemetry-proto),
and the trees they form are checked: one trace per request, continuing the caller's
traceparent, one span per hop with the previous hop as its parent, verdicts on refusals,
both replicas (and the link between them) on a migrated request, trace ids in the logs.
With tracing off nothing of OpenTelemetry is even imported."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.common.v1 import common_pb2

from bus_schemas import errors as E
from tests.conftest import ROOT, NatsServer, Procs, ProcStack, key_store, new_model, start_stack
from tokenbus import Client

MSG = [{"role": "user", "content": "tell me a long story"}]
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
SLOW = ("--sim-prefill-ms", "5", "--sim-decode-ms", "20")
BRIDGE = "POST /v1/chat/completions"
# OTLP span kinds and status codes (opentelemetry.proto.trace.v1).
INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5
ERROR = 2


# -- the OTLP receiver ----------------------------------------------------------------------
@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str, dict[str, Any]]]
    status: int

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [attrs for n, attrs in self.events if n == name]


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf, gzip or not) on a free
    port, in a thread; it keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(otlp.ExportTraceServiceRequest.FromString(body))
                out = otlp.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req: otlp.ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        for rs in req.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            int(s.kind),
                            _attrs(s.attributes),
                            [(e.name, _attrs(e.attributes)) for e in s.events],
                            [
                                (ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes))
                                for ln in s.links
                            ],
                            int(s.status.code),
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(got)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    async def wait(self, trace_id: str, names: dict[str, int], timeout: float = 15) -> list[Span]:
        """The trace's spans once it holds ``names`` (name -> how many), and a moment more
        for stragglers."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            have = {n: sum(1 for s in spans if s.name == n) for n in names}
            if all(have[n] >= k for n, k in names.items()):
                await asyncio.sleep(0.3)
                return self.trace(trace_id)
            if time.monotonic() > deadline:
                got = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"trace {trace_id}: wanted {names}, got {got}")
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def new_traceparent() -> tuple[str, str, str]:
    """(trace id, span id, traceparent) of a caller's own span."""
    trace, span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace, span, f"00-{trace}-{span}-01"


def tree(spans: list[Span]) -> str:
    """The spans as an indented tree (service, name, outcome), for failure messages."""
    kids: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        kids.setdefault(s.parent if s.parent in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in kids.get(parent, []):
            lines.append(
                f"{'  ' * depth}{s.service} {s.name} {s.attributes.get('tokenbus.outcome')}"
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


# -- the traced stack -----------------------------------------------------------------------
@dataclass
class Traced:
    stack: ProcStack
    rx: Receiver
    url: str
    key: str
    key_id: str
    strict_key: str


@pytest.fixture(scope="module")
async def traced(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Traced]:
    rx = Receiver()
    async with key_store(nats_server.url, watch=False) as keys:
        key, rec = await keys.create("traced", rpm=100_000, tpm=10**9, max_concurrent=1000)
        strict, _ = await keys.create("traced-strict", filter_policy="strict")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "TOKENBUS_INGRESS__PIPELINE": '["auth", "ratelimit", "filter", "route"]',
        "TOKENBUS_WORKER__HEARTBEAT_INTERVAL_S": "0.25",
    }
    try:
        with Procs(nats_server.url, tmp_path_factory.mktemp("tracing")) as procs:
            stack = await start_stack(
                procs,
                new_model(),
                *("ingress", "auth", "ratelimit", "filter", "router"),
                workers=2,
                worker_args=SLOW,
                env=env,
                # A drained worker hands its streams over after half a second (migration).
                env_for=lambda role, _: (
                    {"TOKENBUS_DRAIN_TIMEOUT_S": "0.5"} if role == "worker" else {}
                ),
                settle=0.5,
            )
            yield Traced(stack, rx, nats_server.url, key, rec.id, strict)
    finally:
        rx.stop()


def _no_key_in(spans: list[Span], *keys: str) -> None:
    text = repr(spans)
    for key in keys:
        assert key not in text


# -- a streamed request ---------------------------------------------------------------------
async def test_a_streamed_http_request_is_one_trace_with_a_span_per_hop(traced: Traced) -> None:
    trace, caller, tp = new_traceparent()
    model = traced.stack.model
    async with traced.stack.openai(traced.key) as api:
        stream = await api.chat.completions.create(
            model=model,
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            extra_headers={"traceparent": tp},
        )
        async for _ in stream:
            pass
    hops = {BRIDGE: 1, "auth": 1, "ratelimit": 1, "filter": 1, "route": 1, "worker": 1}
    spans = await traced.rx.wait(trace, hops)
    assert len(spans) == len(hops), tree(spans)
    bridge = one(spans, BRIDGE)
    # The bridge continues the caller's span; the stages it runs in-process and its router
    # are its children; the replica is the router's.
    assert (bridge.parent, bridge.kind, bridge.service) == (caller, SERVER, "tokenbus-bridge")
    for stage in ("auth", "ratelimit", "filter", "route"):
        assert one(spans, stage).parent == bridge.span_id, tree(spans)
    route, worker = one(spans, "route"), one(spans, "worker")
    assert (worker.parent, worker.service, worker.kind) == (
        route.span_id,
        "tokenbus-worker",
        CONSUMER,
    )
    a = bridge.attributes
    assert a["http.response.status_code"] == 200 and a["gen_ai.request.model"] == model
    assert a["tokenbus.key_id"] == traced.key_id and a["tokenbus.outcome"] == "ok"
    assert (a["gen_ai.usage.output_tokens"], a["tokenbus.replica"]) == (
        6,
        worker.attributes["tokenbus.replica"],
    )
    assert route.attributes["tokenbus.replica"] == worker.attributes["tokenbus.replica"]
    w = worker.attributes
    assert (w["tokenbus.outcome"], w["gen_ai.usage.output_tokens"]) == ("length", 6)
    assert w["gen_ai.usage.input_tokens"] > 0 and w["tokenbus.backend"] == "sim"
    assert w["gen_ai.request.model"] == model and w["tokenbus.key_id"] == traced.key_id
    assert bridge.events_named("first_token") and worker.events_named("first_token")
    for stage in ("auth", "ratelimit", "filter"):
        (verdict,) = one(spans, stage).events_named("verdict")
        assert verdict["tokenbus.verdict"] == "allow", (stage, verdict)
    _no_key_in(spans, traced.key)


async def test_the_nats_client_continues_its_callers_traceparent_through_every_stage(
    traced: Traced,
) -> None:
    trace, caller, tp = new_traceparent()
    async with await Client.connect(traced.url) as c:
        out = await c.chat_completion(
            traced.stack.model, MSG, max_tokens=4, api_key=traced.key, traceparent=tp
        )
    assert out.usage.completion_tokens == 4
    chain = ["ingress", "auth", "ratelimit", "filter", "router", "worker"]
    spans = await traced.rx.wait(trace, dict.fromkeys(chain, 1))
    assert len(spans) == len(chain), tree(spans)
    parent = caller
    for name in chain:  # each hop the child of the one before, the first of the caller's
        span = one(spans, name)
        assert (span.parent, span.service, span.kind) == (parent, f"tokenbus-{name}", CONSUMER), (
            tree(spans)
        )
        assert span.attributes["messaging.system"] == "nats"
        parent = span.span_id
    assert one(spans, "ingress").attributes["gen_ai.request.model"] == traced.stack.model
    assert one(spans, "filter").attributes["tokenbus.key_id"] == traced.key_id
    assert one(spans, "router").attributes["tokenbus.replica"] == out.replica
    _no_key_in(spans, traced.key)


# -- refusals -------------------------------------------------------------------------------
async def test_a_request_refused_by_auth_ends_its_trace_with_the_verdict(traced: Traced) -> None:
    bad = "tb-000000000000_" + "A" * 43
    trace, caller, tp = new_traceparent()
    async with traced.stack.http("/v1") as http:
        r = await http.post(
            "/chat/completions",
            json={"model": traced.stack.model, "messages": MSG},
            headers={"traceparent": tp, "authorization": f"Bearer {bad}"},
        )
    assert r.status_code == 401
    spans = await traced.rx.wait(trace, {BRIDGE: 1, "auth": 1})
    assert sorted(s.name for s in spans) == sorted([BRIDGE, "auth"]), tree(spans)
    bridge, auth = one(spans, BRIDGE), one(spans, "auth")
    assert (bridge.parent, auth.parent) == (caller, bridge.span_id)
    assert bridge.attributes["http.response.status_code"] == 401
    assert bridge.attributes["tokenbus.outcome"] == "invalid_api_key"
    assert auth.status == ERROR and auth.attributes["tokenbus.outcome"] == "invalid_api_key"
    (verdict,) = auth.events_named("verdict")
    assert (verdict["tokenbus.verdict"], verdict["error.type"]) == ("deny", "invalid_api_key")

    # Over NATS: the auth service's own span ends the trace.
    trace, _, tp = new_traceparent()
    async with await Client.connect(traced.url) as c:
        with pytest.raises(E.Unauthorized):
            await c.chat_completion(traced.stack.model, MSG, api_key=bad, traceparent=tp)
    spans = await traced.rx.wait(trace, {"ingress": 1, "auth": 1})
    assert sorted(s.name for s in spans) == ["auth", "ingress"], tree(spans)
    auth = one(spans, "auth")
    assert auth.status == ERROR and auth.events_named("verdict")[0]["tokenbus.verdict"] == "deny"
    _no_key_in(spans, bad)


async def test_a_request_refused_by_the_filter_ends_its_trace_with_the_verdict(
    traced: Traced,
) -> None:
    secret = [{"role": "user", "content": f"my key is {AWS}"}]
    trace, _, tp = new_traceparent()
    async with traced.stack.http("/v1") as http:
        r = await http.post(
            "/chat/completions",
            json={"model": traced.stack.model, "messages": secret},
            headers={"traceparent": tp, "authorization": f"Bearer {traced.strict_key}"},
        )
    assert r.status_code == 400
    spans = await traced.rx.wait(trace, {BRIDGE: 1, "filter": 1})
    assert "route" not in {s.name for s in spans} and "worker" not in {s.name for s in spans}
    flt = one(spans, "filter")
    assert flt.parent == one(spans, BRIDGE).span_id and flt.status == ERROR
    (verdict,) = flt.events_named("verdict")
    assert verdict["tokenbus.verdict"] == "block"
    assert verdict["tokenbus.detector"] == "secret.aws_access_key"
    assert one(spans, BRIDGE).attributes["tokenbus.outcome"] == "content_blocked"

    trace, _, tp = new_traceparent()
    async with await Client.connect(traced.url) as c:
        with pytest.raises(E.ContentBlocked):
            await c.chat_completion(
                traced.stack.model, secret, api_key=traced.strict_key, traceparent=tp
            )
    spans = await traced.rx.wait(trace, {"ingress": 1, "auth": 1, "ratelimit": 1, "filter": 1})
    assert "router" not in {s.name for s in spans}, tree(spans)
    flt = one(spans, "filter")
    assert flt.status == ERROR and flt.parent == one(spans, "ratelimit").span_id
    assert flt.events_named("verdict")[0]["tokenbus.detector"] == "secret.aws_access_key"
    _no_key_in(spans, traced.strict_key, AWS)


# -- logs -----------------------------------------------------------------------------------
def _log_lines(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                out.append(obj)
    return out


async def test_log_lines_carry_the_trace_and_span_ids(traced: Traced) -> None:
    trace, _, tp = new_traceparent()
    async with traced.stack.openai(traced.key) as api:
        await api.chat.completions.create(
            model=traced.stack.model,
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"traceparent": tp},
        )
    spans = await traced.rx.wait(trace, {BRIDGE: 1, "worker": 1})
    bridge, worker = one(spans, BRIDGE), one(spans, "worker")
    await asyncio.sleep(0.2)
    bridge_lines = [
        line
        for line in _log_lines(traced.stack.bridge.output())
        if line.get("event") == "request" and line.get("trace_id") == trace
    ]
    assert [line.get("span_id") for line in bridge_lines] == [bridge.span_id]
    worker_lines = [
        line
        for p in traced.stack.workers
        for line in _log_lines(p.output())
        if line.get("event") == "request" and line.get("trace_id") == trace
    ]
    assert [line.get("span_id") for line in worker_lines] == [worker.span_id]


# -- migration (last: it drains a worker of the module's stack) ------------------------------
async def test_a_migrated_request_shows_both_replicas_in_one_trace(traced: Traced) -> None:
    import httpx

    trace, _, tp = new_traceparent()
    body = {"model": traced.stack.model, "messages": MSG, "max_tokens": 120, "stream": True}
    headers = {"traceparent": tp, "authorization": f"Bearer {traced.key}"}
    text = ""
    async with (
        httpx.AsyncClient(base_url=traced.stack.base, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        first = r.headers["x-tokenbus-replica"]
        victim = traced.stack.workers[int(first.rsplit("-", 1)[1])]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                if len(text.split()) == 10:
                    victim.signal(signal.SIGTERM)  # drains, then hands the stream over
    assert len(text.split()) >= 100
    assert victim.proc.wait(15) == 0
    spans = await traced.rx.wait(trace, {BRIDGE: 1, "route": 2, "worker": 2})
    bridge = one(spans, BRIDGE)
    workers = sorted((s for s in spans if s.name == "worker"), key=lambda s: s.links != [])
    old, new = workers
    assert old.attributes["tokenbus.replica"] == first, tree(spans)
    assert new.attributes["tokenbus.replica"] != first
    assert old.status == ERROR and new.attributes["tokenbus.outcome"] == "length"
    # The next replica's span links the one it took over from, and says it resumed.
    assert [(t, s) for t, s, _ in new.links] == [(trace, old.span_id)]
    (resume,) = new.events_named("resume")
    assert resume["tokenbus.migrations"] == 1 and resume["tokenbus.resume_tokens"] > 0
    # The caller's span (the bridge's) tells the migration, from where to where, and links.
    (migration,) = bridge.events_named("migration")
    assert (migration["tokenbus.from_replica"], migration["tokenbus.to_replica"]) == (
        first,
        new.attributes["tokenbus.replica"],
    )
    assert (trace, old.span_id) in [(t, s) for t, s, _ in bridge.links]
    assert bridge.attributes["tokenbus.migrations"] == 1
    # Both attempts hang off the bridge's span, each through its own routing span.
    routes = {s.span_id for s in spans if s.name == "route"}
    assert {old.parent, new.parent} == routes
    assert all(s.parent == bridge.span_id for s in spans if s.name == "route")


# -- tracing off ----------------------------------------------------------------------------
OFF_CHECK = """
import asyncio, sys
from services import tracing, runtime, caller, logging as tlog
import gateway.bridge, gateway.ingress, engine_worker.worker, router.dispatch, tokenbus.client
assert tracing.setup("worker") is False and not tracing.on()
span = tracing.start("x", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
hdrs = {}
tracing.inject(span, hdrs)
with tracing.scope(span):
    assert tracing.current() is None and tracing.current_ids() is None
tracing.end(span, "boom")
assert span is None and hdrs == {} and tracing.traces_endpoint() is None
tlog.setup("info")
tlog.get("t").info("hello")
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("off ok")
"""


def test_tracing_off_imports_nothing_of_opentelemetry_and_every_helper_is_a_no_op() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run(
        [sys.executable, "-c", OFF_CHECK], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and "off ok" in r.stdout, r.stderr
    # Configured but disabled, or its exporter none: off as well.
    from services import tracing

    assert not tracing.configured(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert not tracing.configured({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == (
        "http://c:4318/v1/traces"
    )
