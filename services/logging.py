"""structlog configured once per process: JSON lines, contextvars merged, level filtered."""

from __future__ import annotations

import logging
import sys

import structlog

from services import tracing

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def setup(level: str = "info", *, json: bool = True) -> None:
    """Configure structlog for this process (safe to call more than once)."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    # JSON lines carry an exception's traceback as text; the console renderer draws its own.
    tracebacks: list[structlog.typing.Processor] = (
        [structlog.processors.format_exc_info] if json else []
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            _LEVELS.get(level.lower(), logging.INFO)
        ),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # asyncio's TLS transport warns on every NATS TLS connection's close that nats-py's
    # protocol asks to keep the socket half open, which TLS cannot: noise, not a fault.
    logging.getLogger("asyncio").addFilter(_NoEofWarning())


def add_trace_ids(
    logger: object, method: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """The trace and span ids of the current span, when this process traces (one flag read
    when it does not)."""
    if tracing.on():
        ids = tracing.current_ids()
        if ids is not None:
            if not event.get("trace_id"):
                event["trace_id"] = ids[0]
            event.setdefault("span_id", ids[1])
    return event


class _NoEofWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received" not in record.getMessage()


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    log: structlog.typing.FilteringBoundLogger = structlog.get_logger(service=name)
    return log
