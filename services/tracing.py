"""OpenTelemetry tracing: one span per hop a request takes, joined into one trace by the W3C
``traceparent`` every bus message carries (:data:`bus_schemas.headers.TRACEPARENT`).

Configured only by OpenTelemetry's standard variables, read when a process starts
(:func:`setup`, called by the service runtime): tracing is on when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``), and
``OTEL_SDK_DISABLED`` is not ``true``. Then spans go over OTLP/HTTP (protobuf) in batches
(:mod:`services.otlp`); ``OTEL_SERVICE_NAME`` (default ``tokenbus-<role>``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG`` (default
``parentbased_always_on``), ``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_*`` (headers, timeout,
compression, certificates) mean what they mean everywhere else.

Off (the default), every function here returns at its first line on a module flag: a
process that does not trace pays a few attribute reads per request. Call sites need no
guard beyond passing the ``None`` they got back.

On, spans are this module's own small objects, not the OpenTelemetry SDK's: a span is
encoded to its OTLP bytes when it ends and a thread posts them in batches. The SDK's spans,
processor and exporter cost about 100 µs of CPU per span, four times what tracing may cost a
request of 64 tokens (docs/telemetry.md, "Cost"); the wire format, the variables and what a
collector receives are the same.

How a hop continues the trace: it starts its span from the incoming ``traceparent``
(:func:`start`), and writes its own span's into the headers it sends on (:func:`inject`), so
the next hop's span is its child. Attribute names follow OpenTelemetry's semantic
conventions where they have one (``gen_ai.*``, ``messaging.*``, ``http.*``, ``error.type``)
and are ``tokenbus.*`` otherwise. No API key ever goes into a span: only the key id.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import random
import sys
import time
import urllib.parse
import uuid
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import Any, NamedTuple

import structlog

from bus_schemas import headers as H
from bus_schemas import marks

# Span kinds (the names of OpenTelemetry's SpanKind members) and their OTLP numbers.
SERVER = "SERVER"
CLIENT = "CLIENT"
PRODUCER = "PRODUCER"
CONSUMER = "CONSUMER"
INTERNAL = "INTERNAL"
_KIND_NUMBERS = {INTERNAL: 1, SERVER: 2, CLIENT: 3, PRODUCER: 4, CONSUMER: 5}
# OTLP status codes.
STATUS_OK = 1
STATUS_ERROR = 2

# Attribute names.
MODEL = "gen_ai.request.model"
OPERATION = "gen_ai.operation.name"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
ERROR_TYPE = "error.type"
MESSAGING_SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
STAGE = "tokenbus.stage"
REQUEST_ID = "tokenbus.request_id"
REPLICA = "tokenbus.replica"
BACKEND = "tokenbus.backend"
KEY_ID = "tokenbus.key_id"
OUTCOME = "tokenbus.outcome"
VERDICT = "tokenbus.verdict"
DETECTORS = "tokenbus.detectors"
ATTEMPTS = "tokenbus.attempts"
MIGRATIONS = "tokenbus.migrations"

# gen_ai.operation.name of each request kind (OpenTelemetry's GenAI conventions).
_OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}


def operation(kind: str) -> str:
    """The ``gen_ai.operation.name`` of a request kind (``chat``, ``completions`` ...)."""
    return _OPERATIONS.get(kind, kind)


# Event names.
FIRST_TOKEN = "first_token"
VERDICT_EVENT = "verdict"
MIGRATION_EVENT = "migration"
RESUME_EVENT = "resume"
CANCEL_EVENT = "cancel"
REFUSED_EVENT = "replica_refused"
# Flow control (engine_worker/flow.py): the wait for an engine slot, and a displacement.
QUEUE_EVENT = "queue_wait"
DISPLACED_EVENT = "displaced"

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_on = False
_set_up = False
_exporter: Any = None  # services.otlp.BatchExporter, once tracing is on with otlp
_encode: Any = None  # services.otlp.encode_span
_console = False
_sampler: Any = None  # (parent context or None, trace id) -> sampled
_resource: dict[str, Any] = {}
_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "tokenbus_span", default=None
)
_NULL_SCOPE = contextlib.nullcontext()


# -- configuration --------------------------------------------------------------------------
def configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment turns tracing on (the standard OTEL_* variables)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporter_names(env)
    if exporters == ["none"]:
        return False
    return bool(env.get("OTEL_TRACES_EXPORTER", "").strip()) or any(
        env.get(k, "").strip() for k in _ENDPOINT_VARS
    )


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    raw = env.get("OTEL_TRACES_EXPORTER", "") or "otlp"
    return [n.strip().lower() for n in raw.split(",") if n.strip()] or ["otlp"]


def traces_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP URL spans go to (``.../v1/traces``) when the environment turns tracing
    on with an OTLP endpoint; None otherwise. The vllm backend hands it to vLLM's own
    tracing (``otlp_traces_endpoint``) so the engine's spans land beside ours."""
    env = os.environ if env is None else env
    if not configured(env) or "otlp" not in _exporter_names(env):
        return None
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return f"{base.rstrip('/')}/v1/traces" if base else None


def on() -> bool:
    """Whether this process traces (:func:`setup` found tracing configured)."""
    return _on


def setup(role: str, instance: str | None = None) -> bool:
    """Turn tracing on for this process when the environment asks for it (once; later calls
    return the first one's answer). ``role``: the service (``auth``, ``worker`` ...), which
    names the process ``tokenbus-<role>`` unless ``OTEL_SERVICE_NAME`` names it."""
    global _on, _set_up, _exporter, _console, _sampler, _encode
    if _set_up:
        return _on
    _set_up = True
    if not configured():
        return False
    _resource.clear()
    _resource.update(resource(role, instance))
    _sampler = sampler(os.environ)
    names = _exporter_names(os.environ)
    _console = "console" in names
    if any(n != "console" for n in names):
        from services import otlp

        for name in names:
            if name not in ("otlp", "console"):
                _warn("tracing_exporter_unknown", exporter=name, using="otlp")
        _check_protocol()
        res, scope = otlp.resource_scope(_resource, "tokenbus", _version())
        _exporter = otlp.BatchExporter([otlp.HTTPSink()], res, scope, _warn)
        _encode = otlp.encode_span
    _on = True
    return True


def resource(role: str, instance: str | None = None) -> dict[str, Any]:
    """The process's resource attributes: ``OTEL_RESOURCE_ATTRIBUTES`` (``k=v``, comma
    separated, percent-encoded), then ours; ``OTEL_SERVICE_NAME`` names the service, else
    the attributes do, else ``tokenbus-<role>``."""
    attrs: dict[str, Any] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "tokenbus",
        "telemetry.sdk.version": _version(),
    }
    for pair in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        k, sep, v = pair.partition("=")
        if sep and k.strip():
            attrs[urllib.parse.unquote(k.strip())] = urllib.parse.unquote(v.strip())
    attrs["service.instance.id"] = instance or uuid.uuid4().hex[:12]
    attrs["tokenbus.role"] = role
    named = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if named:
        attrs["service.name"] = named
    attrs.setdefault("service.name", f"tokenbus-{role}")
    return attrs


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tokenbus")
    except metadata.PackageNotFoundError:
        return "0"


def sampler(env: Mapping[str, str]) -> Any:
    """``OTEL_TRACES_SAMPLER``/``_ARG`` as a function of (parent span context or None,
    trace id) to whether the new span is sampled: ``always_on``, ``always_off``,
    ``traceidratio`` and the ``parentbased_`` form of each (the default is
    ``parentbased_always_on``: a parent's sampled flag is obeyed)."""
    name = (env.get("OTEL_TRACES_SAMPLER", "") or "parentbased_always_on").strip().lower()
    parent_based = name.startswith("parentbased_")
    root = name.removeprefix("parentbased_")
    if root not in ("always_on", "always_off", "traceidratio"):
        _warn("tracing_sampler_unknown", sampler=name, using="parentbased_always_on")
        parent_based, root = True, "always_on"
    ratio = 1.0
    if root == "traceidratio":
        try:
            ratio = min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "") or 1.0)))
        except ValueError:
            _warn("tracing_sampler_arg_invalid", arg=env.get("OTEL_TRACES_SAMPLER_ARG"))
    bound = round(ratio * (1 << 64))  # OpenTelemetry's rule: the trace id's low 64 bits

    def decide(parent: SpanContext | None, trace_id: int) -> bool:
        if parent_based and parent is not None:
            return bool(parent.trace_flags & 1)
        if root == "always_on":
            return True
        if root == "always_off":
            return False
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < bound

    return decide


def _check_protocol() -> None:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol.strip().lower() != "http/protobuf":
        _warn("tracing_protocol_unsupported", protocol=protocol, using="http/protobuf")


def _warn(event: str, **kw: Any) -> None:
    # structlog itself, as services.logging configures it: that module imports this one.
    structlog.get_logger(service="tracing").warning(event, **kw)


def shutdown() -> None:
    """Export what is buffered and stop (a service calls it once it has drained)."""
    global _on
    if not _on:
        return
    _on = False
    if _exporter is not None:
        with contextlib.suppress(Exception):
            _exporter.shutdown()


# -- spans ----------------------------------------------------------------------------------
class SpanContext(NamedTuple):
    """What identifies a span across processes (a W3C traceparent's fields)."""

    trace_id: int
    span_id: int
    trace_flags: int
    is_remote: bool = False

    @property
    def is_valid(self) -> bool:
        return bool(self.trace_id and self.span_id)


class Span:
    """One hop's span. Recording when sampled and not yet ended; a span that is not sampled
    still carries its context on (with the sampled flag clear) and records nothing."""

    __slots__ = (
        "attributes",
        "events",
        "kind",
        "links",
        "name",
        "parent_id",
        "parent_remote",
        "recording",
        "span_id",
        "start_ns",
        "status",
        "trace_flags",
        "trace_id",
    )

    def __init__(
        self,
        name: str,
        parent: SpanContext | None,
        kind: str,
        attributes: dict[str, Any] | None,
    ) -> None:
        self.name = name
        if parent is not None and parent.is_valid:
            self.trace_id = parent.trace_id
            self.parent_id = parent.span_id
            self.parent_remote = parent.is_remote
        else:
            self.trace_id = random.getrandbits(128) or 1
            self.parent_id = 0
            self.parent_remote = False
            parent = None
        self.span_id = random.getrandbits(64) or 1
        self.recording = bool(_sampler(parent, self.trace_id))
        self.trace_flags = 1 if self.recording else 0
        self.kind = kind
        self.attributes: dict[str, Any] = attributes or {}
        self.events: list[tuple[str, int, dict[str, Any] | None]] | None = None
        self.links: list[tuple[int, int, int, dict[str, Any] | None]] | None = None
        self.status: tuple[int, str] | None = None
        self.start_ns = time.time_ns()

    def get_span_context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, self.trace_flags)

    def is_recording(self) -> bool:
        return self.recording

    def set_attribute(self, key: str, value: Any) -> None:
        if self.recording and value is not None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            self.attributes.update(attributes)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        if self.recording:
            if self.events is None:
                self.events = []
            self.events.append((name, time.time_ns(), dict(attributes) if attributes else None))

    def add_link(self, ctx: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.recording:
            if self.links is None:
                self.links = []
            attrs = dict(attributes) if attributes else None
            self.links.append((ctx.trace_id, ctx.span_id, ctx.trace_flags, attrs))

    def set_status(self, code: int, message: str = "") -> None:
        if self.recording:
            self.status = (code, message)

    def end(self) -> None:
        """Record the span (once): encoded for the exporter, printed for the console."""
        if not self.recording:
            return
        self.recording = False
        end_ns = time.time_ns()
        if _exporter is not None:
            _exporter.add(
                _encode(
                    self.trace_id,
                    self.span_id,
                    self.parent_id,
                    self.parent_remote,
                    self.name,
                    _KIND_NUMBERS[self.kind],
                    self.start_ns,
                    end_ns,
                    self.attributes,
                    self.events,
                    self.links,
                    self.status,
                    self.trace_flags,
                )
            )
        if _console:
            self._print(end_ns)

    def _print(self, end_ns: int) -> None:
        events = [
            {"name": n, "time_unix_nano": t, "attributes": a} for n, t, a in self.events or ()
        ]
        links = [
            {"trace_id": f"{t:032x}", "span_id": f"{s:016x}", "attributes": a}
            for t, s, _, a in self.links or ()
        ]
        line = {
            "name": self.name,
            "trace_id": f"{self.trace_id:032x}",
            "span_id": f"{self.span_id:016x}",
            "parent_id": f"{self.parent_id:016x}" if self.parent_id else None,
            "kind": self.kind,
            "start_time_unix_nano": self.start_ns,
            "end_time_unix_nano": end_ns,
            "attributes": self.attributes,
            "events": events,
            "links": links,
            "status": {"code": self.status[0], "message": self.status[1]} if self.status else None,
            "resource": _resource,
        }
        print(json.dumps(line, default=str), file=sys.stderr, flush=True)


def start(
    name: str,
    carrier: Mapping[str, str] | None = None,
    *,
    kind: str = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Span | None:
    """A new span (not yet current), the child of the ``traceparent`` in ``carrier`` (bus or
    HTTP headers) when it holds a valid one, else of the current span, else a root; None
    when tracing is off."""
    if not _on:
        return None
    parent = _remote(carrier.get(H.TRACEPARENT)) if carrier else None
    if parent is None:
        here = _current.get()
        parent = here.get_span_context() if here is not None else None
    return Span(name, parent, kind, _clean(attributes))


def _remote(value: str | None) -> SpanContext | None:
    """The span context of a W3C traceparent, None unless it is a valid one."""
    tp = marks.traceparent(value)
    if tp is None:
        return None
    version, trace_hex, span_hex, flags = tp.split("-")
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if version == "ff" or not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, int(flags, 16) & 1, True)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``attributes`` without the unset ones (OpenTelemetry refuses None values)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


def traceparent(span: Span) -> str:
    """``span`` as a W3C traceparent: what the next hop continues from."""
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"


def inject(span: Span | None, carrier: MutableMapping[str, str]) -> None:
    """Make ``span`` the parent of whatever receives ``carrier`` (its traceparent)."""
    if span is not None:
        carrier[H.TRACEPARENT] = traceparent(span)


def headers(span: Span | None) -> dict[str, str] | None:
    """The trace headers that continue ``span`` elsewhere (an engine, an upstream)."""
    return None if span is None else {H.TRACEPARENT: traceparent(span)}


def activate(span: Span | None) -> object | None:
    """Make ``span`` the current one in this task (logs carry its ids; :func:`current`
    finds it); give the returned token to :func:`deactivate`."""
    if span is None or not _on:
        return None
    return _current.set(span)


def deactivate(token: object | None) -> None:
    if token is not None:
        with contextlib.suppress(ValueError, TypeError):  # set in another context
            _current.reset(token)  # type: ignore[arg-type]


class _Scope:
    """``with scope(span)``: ``span`` current inside, ended on leaving (an exception's code
    becomes its outcome)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: object | None = None

    def __enter__(self) -> Span:
        self._token = activate(self._span)
        return self._span

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            end(self._span, ev)
        finally:
            deactivate(self._token)


def scope(span: Span | None) -> contextlib.AbstractContextManager[Any]:
    """A context manager that makes ``span`` current and ends it; nothing when None."""
    return _NULL_SCOPE if span is None else _Scope(span)


def current() -> Span | None:
    """The current span when it records (tracing on, sampled), else None."""
    if not _on:
        return None
    span = _current.get()
    return span if span is not None and span.recording else None


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as hex, for log lines; None when none."""
    if not _on:
        return None
    span = _current.get()
    if span is None:
        return None
    return f"{span.trace_id:032x}", f"{span.span_id:016x}"


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    if span is not None:
        clean = _clean(attributes)
        if clean:
            span.set_attributes(clean)


def event(span: Span | None, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    if span is not None:
        span.add_event(name, _clean(attributes))


def verdict(stage: str, value: str, attributes: Mapping[str, Any] | None = None) -> None:
    """A safety stage's decision (``allow``, ``deny``, ``flag``, ``redact``, ``block``) as
    an event on the current span."""
    span = current()
    if span is not None:
        span.add_event(VERDICT_EVENT, _clean({STAGE: stage, VERDICT: value, **(attributes or {})}))


def link(span: Span | None, tp: str | None, attributes: Mapping[str, Any] | None = None) -> None:
    """Link ``span`` to the span of traceparent ``tp`` (an earlier attempt of the request)."""
    if span is None or not _on:
        return
    ctx = _remote(tp)
    if ctx is not None:
        span.add_link(ctx, _clean(attributes))


def _code(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    code = getattr(error, "code", None)  # a TokenbusError
    if isinstance(code, str):
        return code
    if type(error).__name__ == "CancelledError":
        return "cancelled"
    return "internal_error"


def fail(span: Span | None, error: BaseException | str) -> None:
    """Mark ``span`` failed: error status, and ``error.type`` and the outcome unless set
    (the first failure named is the cause: a replica's ``interrupted``, not the
    cancellation of its task that follows)."""
    if span is None or not span.is_recording():
        return
    attrs = getattr(span, "attributes", None) or {}
    if attrs.get(ERROR_TYPE):
        return
    code = _code(error)
    span.set_status(STATUS_ERROR, code)
    span.set_attribute(ERROR_TYPE, code)
    if not attrs.get(OUTCOME):
        span.set_attribute(OUTCOME, code)


def outcome(span: Span | None, value: str) -> None:
    """Set the span's outcome (a finish reason, ``ok``, an error code)."""
    if span is not None:
        span.set_attribute(OUTCOME, value)


def _outcome(span: Any) -> Any:
    attrs = getattr(span, "attributes", None)
    return attrs.get(OUTCOME) if attrs else None


def end(span: Span | None, error: BaseException | str | None = None) -> None:
    """End ``span``; ``error`` (an exception or an error code) marks it failed, else its
    outcome is ``ok`` unless already set."""
    if span is None:
        return
    if error is not None:
        fail(span, error)
    elif span.is_recording() and not _outcome(span):
        span.set_attribute(OUTCOME, "ok")
    span.end()
