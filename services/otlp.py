"""OTLP/HTTP trace export, written for the cost of one span: each span is encoded to its
protobuf bytes when it ends (in the thread that ends it, a few microseconds), and a
background thread posts them in batches as an ``ExportTraceServiceRequest``.

Only the wire format of ``opentelemetry/proto/trace/v1/trace.proto`` and
``collector/trace/v1/trace_service.proto`` is used here; tests decode what this writes
with ``opentelemetry-proto``. Configured by the standard variables: ``OTEL_BSP_SCHEDULE_DELAY``
(ms, 5000), ``OTEL_BSP_MAX_QUEUE_SIZE`` (2048), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (512),
``OTEL_BSP_EXPORT_TIMEOUT`` (ms, 30000), and the ``OTEL_EXPORTER_OTLP_[TRACES_]`` endpoint,
headers, timeout, compression (``gzip``) and certificate.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import os
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# -- protobuf wire format -------------------------------------------------------------------
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack
_U64 = (1 << 64) - 1
_VARINT_1 = [bytes([i]) for i in range(128)]


def varint(n: int) -> bytes:
    """``n`` (0 ≤ n < 2**64) as a protobuf varint."""
    if n < 128:
        return _VARINT_1[n]
    out = bytearray()
    while n > 127:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + varint(len(payload)) + payload


def _text(s: str) -> bytes:
    return s.encode("utf-8", "replace")


def any_value(v: Any) -> bytes:
    """An ``AnyValue`` message: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(v, str):
        return field(b"\x0a", _text(v))
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        if -(1 << 63) <= v < (1 << 63):
            return b"\x18" + varint(v & _U64)
        return field(b"\x0a", str(v).encode())
    if isinstance(v, float):
        return b"\x21" + _pack_d(v)
    if isinstance(v, (list, tuple)):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(x)) for x in v))
    return field(b"\x0a", _text(str(v)))


_KEYS: dict[str, bytes] = {}


def key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message (key 1, value 2); the key's encoding is kept (keys repeat)."""
    k = _KEYS.get(key)
    if k is None:
        if len(_KEYS) < 4096:
            k = _KEYS[key] = field(b"\x0a", _text(key))
        else:
            k = field(b"\x0a", _text(key))
    return k + field(b"\x12", any_value(value))


def attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a ``KeyValue`` in the repeated field ``tag``."""
    if not attrs:
        return b""
    return b"".join(field(tag, key_value(k, v)) for k, v in attrs.items())


# Span fields (trace.proto): trace_id 1, span_id 2, parent_span_id 4, name 5, kind 6,
# start 7 and end 8 (fixed64), attributes 9, events 11, links 13, status 15, flags 16
# (fixed32). Event: time 1 (fixed64), name 2, attributes 3. Link: trace_id 1, span_id 2,
# attributes 4, flags 6 (fixed32). Status: message 2, code 3.
_FLAGS_TAG = b"\x85\x01"  # field 16, wire type 5
HAS_IS_REMOTE = 0x100
IS_REMOTE = 0x200


def encode_span(
    trace_id: int,
    span_id: int,
    parent_id: int,
    parent_remote: bool,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attrs: Mapping[str, Any] | None,
    events: Sequence[tuple[str, int, Mapping[str, Any] | None]] | None,
    links: Sequence[tuple[int, int, int, Mapping[str, Any] | None]] | None,
    status: tuple[int, str] | None,
    trace_flags: int,
) -> bytes:
    """One ``Span`` message."""
    parts = [
        b"\x0a\x10",
        trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        span_id.to_bytes(8, "big"),
    ]
    flags = trace_flags | HAS_IS_REMOTE
    if parent_id:
        parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        if parent_remote:
            flags |= IS_REMOTE
    parts += (
        field(b"\x2a", _text(name)),
        b"\x30",
        varint(kind),
        b"\x39",
        _pack_q(start_ns),
        b"\x41",
        _pack_q(end_ns),
    )
    if attrs:
        parts.append(attributes(b"\x4a", attrs))
    for ev_name, ev_ns, ev_attrs in events or ():
        body = b"\x09" + _pack_q(ev_ns) + field(b"\x12", _text(ev_name))
        parts.append(field(b"\x5a", body + attributes(b"\x1a", ev_attrs)))
    for l_trace, l_span, l_flags, l_attrs in links or ():
        body = b"\x0a\x10" + l_trace.to_bytes(16, "big") + b"\x12\x08" + l_span.to_bytes(8, "big")
        body += (
            attributes(b"\x22", l_attrs) + b"\x35" + _pack_i(l_flags | HAS_IS_REMOTE | IS_REMOTE)
        )
        parts.append(field(b"\x6a", body))
    if status is not None:
        code, message = status
        body = (field(b"\x12", _text(message)) if message else b"") + b"\x18" + varint(code)
        parts.append(field(b"\x7a", body))
    parts += (_FLAGS_TAG, _pack_i(flags))
    return b"".join(parts)


def resource_scope(resource: Mapping[str, Any], scope: str, version: str) -> tuple[bytes, bytes]:
    """The encoded ``Resource`` field of a ``ResourceSpans`` and ``InstrumentationScope``
    field of a ``ScopeSpans``: the same for every batch of a process."""
    res = field(b"\x0a", attributes(b"\x0a", resource))
    sc = field(b"\x0a", field(b"\x0a", _text(scope)) + field(b"\x12", _text(version)))
    return res, sc


def export_request(resource: bytes, scope: bytes, spans: Sequence[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` holding ``spans`` (each an encoded ``Span``)."""
    scope_spans = scope + b"".join(field(b"\x12", s) for s in spans)
    return field(b"\x0a", resource + field(b"\x12", scope_spans))


# -- configuration --------------------------------------------------------------------------
def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{name}", default
    )


def _number(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value >= 0 else default


def parse_headers(raw: str) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS``: ``k=v`` pairs, comma separated, percent-encoded."""
    out: dict[str, str] = {}
    for pair in raw.split(","):
        k, sep, v = pair.partition("=")
        if sep and k.strip():
            out[urllib.parse.unquote(k.strip())] = urllib.parse.unquote(v.strip())
    return out


def traces_url() -> str:
    """Where spans go: the traces endpoint as given, or ``<endpoint>/v1/traces``."""
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
    return f"{base.rstrip('/')}/v1/traces"


class HTTPSink:
    """Posts encoded export requests to an OTLP/HTTP receiver (one kept-alive connection;
    retried with backoff on a connection error, 429, 502, 503 and 504)."""

    RETRY_STATUS = frozenset({429, 502, 503, 504})

    def __init__(self) -> None:
        url = urllib.parse.urlsplit(traces_url())
        self.https = url.scheme == "https"
        self.host = url.hostname or "localhost"
        self.port = url.port or (443 if self.https else 80)
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.timeout = _number("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", 0) or _number(
            "OTEL_EXPORTER_OTLP_TIMEOUT", 10_000
        )
        self.timeout /= 1000  # the spec's unit is milliseconds
        self.gzip = _env("COMPRESSION").strip().lower() == "gzip"
        self.headers = {
            **parse_headers(_env("HEADERS")),
            "Content-Type": "application/x-protobuf",
            "User-Agent": "tokenbus-otlp",
        }
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"
        self.context: ssl.SSLContext | None = None
        if self.https:
            self.context = ssl.create_default_context(cafile=_env("CERTIFICATE") or None)
            cert, key = _env("CLIENT_CERTIFICATE"), _env("CLIENT_KEY")
            if cert:
                self.context.load_cert_chain(cert, key or None)
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.https:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout, context=self.context
                )
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def send(self, body: bytes, deadline: float) -> str | None:
        """Post ``body``; None when the receiver took it, else why not."""
        if self.gzip:
            body = gzip.compress(body, compresslevel=6)
        delay = 0.5
        why = "not sent"
        while True:
            try:
                conn = self._connection()
                conn.request("POST", self.path, body, self.headers)
                resp = conn.getresponse()
                resp.read()
                if 200 <= resp.status < 300:
                    return None
                why = f"HTTP {resp.status}"
                if resp.status not in self.RETRY_STATUS:
                    return why
            except (OSError, http.client.HTTPException) as exc:
                why = f"{type(exc).__name__}: {exc}"
                self.close()
            if time.monotonic() + delay > deadline:
                return why
            time.sleep(delay)
            delay *= 2

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


class BatchExporter:
    """Encoded spans in, batches out: a queue bounded at ``OTEL_BSP_MAX_QUEUE_SIZE`` (a span
    beyond it is dropped and counted), posted every ``OTEL_BSP_SCHEDULE_DELAY`` or as soon
    as a batch is full, by one daemon thread."""

    def __init__(
        self,
        sinks: Sequence[Any],
        resource: bytes,
        scope: bytes,
        warn: Callable[..., None],
    ) -> None:
        self.sinks = list(sinks)
        self.resource, self.scope = resource, scope
        self.warn = warn
        self.delay_s = _number("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = int(_number("OTEL_BSP_MAX_QUEUE_SIZE", 2048)) or 2048
        self.batch = min(int(_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)) or 512, self.max_queue)
        self.export_timeout_s = _number("OTEL_BSP_EXPORT_TIMEOUT", 30_000) / 1000
        self.queue: list[bytes] = []
        self.dropped = 0
        self._warned_drop = False
        self._failing = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tokenbus-otlp", daemon=True)
        self._thread.start()

    def add(self, span: bytes) -> None:
        """Queue one encoded span (called where spans end; never blocks on I/O)."""
        with self._lock:
            q = self.queue
            if len(q) >= self.max_queue:
                self.dropped += 1
                return
            q.append(span)
        if len(q) == self.batch:
            self._wake.set()

    def _take(self) -> list[bytes]:
        with self._lock:
            spans, self.queue = self.queue, []
        return spans

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._flush()
        # What was queued while the last flush posted (a span ended just before shutdown).
        self._flush()

    def _flush(self) -> None:
        spans = self._take()
        for i in range(0, len(spans), self.batch):
            self._post(spans[i : i + self.batch])
        if self.dropped and not self._warned_drop:
            self._warned_drop = True
            self.warn("tracing_queue_full", dropped=self.dropped, max_queue=self.max_queue)

    def _post(self, spans: list[bytes]) -> None:
        body = export_request(self.resource, self.scope, spans)
        deadline = time.monotonic() + self.export_timeout_s
        for sink in self.sinks:
            why = sink.send(body, deadline)
            if why is not None and not self._failing:
                self.warn("tracing_export_failed", error=why, spans=len(spans))
            self._failing = why is not None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Post what is queued, then stop the thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        for sink in self.sinks:
            sink.close()
