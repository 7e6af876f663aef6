"""A replica's span of a request (tracing on): what the replica is, why it refused a
dispatch, and how the request ended."""

from __future__ import annotations

from typing import Any

from bus_schemas import errors as E
from bus_schemas import headers as H
from engine_worker.generation import Generation
from services import tracing

# Outcomes that are a finish reason: the request ended as the engine or the filter decided.
_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def trace_refused(err: E.TokenbusError) -> None:
    """The replica refused the dispatch (busy, draining, expired, malformed): its span says
    why; only a refusal another replica cannot help with is an error."""
    span = tracing.current()
    tracing.outcome(span, err.code)
    if err.code not in (E.ReplicaBusy.code, E.ReplicaDraining.code):
        tracing.fail(span, err.code)


def trace_begin(gen: Generation, replica: str, backend: str) -> None:
    """The request's span (the runtime's, current in this task): what this replica is,
    the trace headers the engine continues, and for a migrated request the resume event
    and a link to the replica span of the attempt before."""
    span = gen.span = tracing.current()
    if span is None:
        return
    hdrs = gen.headers
    tracing.set_attributes(
        span,
        {
            tracing.REPLICA: replica,
            tracing.BACKEND: backend,
            tracing.OPERATION: tracing.operation(gen.req.kind),
            "gen_ai.request.max_tokens": gen.req.max_tokens,
        },
    )
    gen.req.trace_headers = tracing.headers(span)
    migration = hdrs.get(H.MIGRATION, "")
    if migration.isdigit() and int(migration) > 0:
        tracing.event(
            span,
            tracing.RESUME_EVENT,
            {
                tracing.MIGRATIONS: int(migration),
                "tokenbus.resume_tokens": gen.req.resume_tokens,
            },
        )
        tracing.link(span, hdrs.get(H.TRACE_LINK), {"tokenbus.link": "migrated_from"})


def trace_end(gen: Generation) -> None:
    """Tokens, finish reason and outcome on the request's span (the runtime ends it)."""
    span = gen.span
    attrs: dict[str, Any] = {
        tracing.OUTPUT_TOKENS: gen.completion,
        tracing.OUTCOME: gen.outcome,
    }
    if gen.prompt_tokens >= 0:
        attrs[tracing.INPUT_TOKENS] = gen.prompt_tokens
    if gen.outcome in _FINISH_REASONS:
        attrs[tracing.FINISH_REASONS] = [gen.outcome]
    tracing.set_attributes(span, attrs)
    if gen.outcome not in _FINISH_REASONS and gen.outcome not in ("ok", "cancelled"):
        tracing.fail(span, gen.outcome)
