"""OpenTelemetry tracing: one span per hop a request takes, joined into one trace by the W3C
``traceparent`` every bus message carries (:data:`bus_schemas.headers.TRACEPARENT`).

Configured only by OpenTelemetry's standard variables, read when a process starts
(:func:`setup`, called by the service runtime): tracing is on when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``), and
``OTEL_SDK_DISABLED`` is not ``true``. Then spans go over OTLP/HTTP (protobuf) through a
batching processor; ``OTEL_SERVICE_NAME`` (default ``tokenbus-<role>``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG`` (default
``parentbased_always_on``), ``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_*`` (headers, timeout,
compression, certificates) mean what they mean everywhere else.

Off (the default), every function here returns at its first line on a module flag, and
OpenTelemetry is never imported: a process that does not trace pays a few attribute reads
per request. Call sites need no guard beyond passing the ``None`` they got back.

How a hop continues the trace: it starts its span from the incoming ``traceparent``
(:func:`start`), and writes its own span's into the headers it sends on (:func:`inject`), so
the next hop's span is its child. Attribute names follow OpenTelemetry's semantic
conventions where they have one (``gen_ai.*``, ``messaging.*``, ``http.*``, ``error.type``)
and are ``tokenbus.*`` otherwise. No API key ever goes into a span: only the key id.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from bus_schemas import headers as H
from bus_schemas import marks

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext

# Span kinds (the names of opentelemetry.trace.SpanKind's members).
SERVER = "SERVER"
CLIENT = "CLIENT"
PRODUCER = "PRODUCER"
CONSUMER = "CONSUMER"
INTERNAL = "INTERNAL"

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

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_on = False
_provider: Any = None
_tracer: Any = None
_api: Any = None  # opentelemetry.trace, once tracing is on
_context: Any = None  # opentelemetry.context
_status: Any = None  # opentelemetry.trace.Status
_error_code: Any = None  # opentelemetry.trace.StatusCode.ERROR
_kinds: dict[str, Any] = {}
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
    global _on, _provider, _tracer, _api, _context, _status, _error_code
    if _provider is not None:
        return _on
    if not configured():
        return False
    from opentelemetry import context as context_api
    from opentelemetry import trace as trace_api
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs: dict[str, Any] = {
        "service.instance.id": instance or uuid.uuid4().hex[:12],
        "tokenbus.role": role,
    }
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        attrs["service.name"] = f"tokenbus-{role}"
    # The sampler comes from OTEL_TRACES_SAMPLER/_ARG (parentbased_always_on by default).
    # This provider is not made the global one: a library in the process (vLLM's engine
    # sets up its own) keeps its own, and the context (what is current) is shared anyway.
    provider = TracerProvider(resource=Resource.create(attrs))
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _api, _context, _provider = trace_api, context_api, provider
    _tracer = provider.get_tracer("tokenbus")
    _kinds.update({k.name: k for k in trace_api.SpanKind})
    _status, _error_code = trace_api.Status, trace_api.StatusCode.ERROR
    _on = True
    return True


def _exporters() -> list[Any]:
    out: list[Any] = []
    for name in _exporter_names(os.environ):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            out.append(_otlp_exporter())
        else:
            _warn("tracing_exporter_unknown", exporter=name, using="otlp")
            out.append(_otlp_exporter())
    return out


def _otlp_exporter() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol.strip().lower() != "http/protobuf":
        _warn("tracing_protocol_unsupported", protocol=protocol, using="http/protobuf")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: from OTEL_* too


def _warn(event: str, **kw: Any) -> None:
    from services import logging as tlog  # logging imports this module: late, not circular

    tlog.get("tracing").warning(event, **kw)


def shutdown() -> None:
    """Export what is buffered and stop (a service calls it once it has drained)."""
    global _on
    provider = _provider
    if provider is None or not _on:
        return
    _on = False
    with contextlib.suppress(Exception):
        provider.shutdown()


# -- spans ----------------------------------------------------------------------------------
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
    parent = _remote((carrier or {}).get(H.TRACEPARENT))
    ctx = None if parent is None else _api.set_span_in_context(_api.NonRecordingSpan(parent))
    span: Span = _tracer.start_span(
        name, context=ctx, kind=_kinds[kind], attributes=_clean(attributes)
    )
    return span


def _remote(value: str | None) -> SpanContext | None:
    """The span context of a W3C traceparent, None unless it is a valid one."""
    tp = marks.traceparent(value)
    if tp is None:
        return None
    version, trace_hex, span_hex, flags = tp.split("-")
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if version == "ff" or not trace_id or not span_id:
        return None
    ctx: SpanContext = _api.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=_api.TraceFlags(int(flags, 16) & 1)
    )
    return ctx


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``attributes`` without the unset ones (OpenTelemetry refuses None values)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


def traceparent(span: Span) -> str:
    """``span`` as a W3C traceparent: what the next hop continues from."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


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
    token: object = _context.attach(_api.set_span_in_context(span))
    return token


def deactivate(token: object | None) -> None:
    if token is not None and _context is not None:
        with contextlib.suppress(Exception):
            _context.detach(token)


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
    span: Span = _api.get_current_span()
    return span if span.is_recording() else None


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as hex, for log lines; None when none."""
    if not _on:
        return None
    c = _api.get_current_span().get_span_context()
    if not c.is_valid:
        return None
    return f"{c.trace_id:032x}", f"{c.span_id:016x}"


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
    span.set_status(_status(_error_code, code))
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
