"""A caller's stream in tracing (only when on): the span it reports to, its attempts'
replica spans and the migrations between them (:class:`StreamTrace`)."""

from __future__ import annotations

from typing import Any

from bus_schemas import headers as H
from services import tracing
from services.chunks import Usage


class StreamTrace:
    """The span a stream reports to (the bridge's server span, or one of its own), the
    replica span of the current attempt (from its accept frame) and of the one before
    (linked by the next replica), a migration not yet accepted."""

    __slots__ = ("_attempt_tp", "_migrating", "_own", "link", "span")

    def __init__(self) -> None:
        self.span: Any = None
        self._own = False
        self._attempt_tp: str | None = None
        self.link: str | None = None  # the replica span the next attempt links
        self._migrating: tuple[str | None, str, int] | None = None

    def start(
        self, kind: str, model: str, request_id: str, subject: str, extra: dict[str, str]
    ) -> dict[str, str] | None:
        """Find the span the stream reports to: the current one when the headers already
        name it (the bridge's), else a client span of its own, the child of the traceparent
        the caller gave (or of the current span): then the headers the request carries, with
        that span's traceparent."""
        given = extra.get(H.TRACEPARENT)
        span = tracing.current()
        if span is not None and given and given == tracing.traceparent(span):
            self.span = span
            return None
        op = tracing.operation(kind)
        self.span = tracing.start(
            f"{op} {model}",
            extra,
            kind=tracing.CLIENT,
            attributes={
                tracing.OPERATION: op,
                tracing.MODEL: model,
                tracing.REQUEST_ID: request_id,
                tracing.MESSAGING_SYSTEM: "nats",
                tracing.DESTINATION: subject,
            },
        )
        self._own = True
        return {**extra, H.TRACEPARENT: tracing.traceparent(self.span)}

    def first_token(self) -> None:
        if self.span is not None:
            self.span.add_event(tracing.FIRST_TOKEN)

    def accept(self, replica: str | None, tp: str | None) -> None:
        """An attempt was accepted: a pending migration's event, now with where it went."""
        self._attempt_tp = tp
        if self._migrating is not None and self.span is not None:
            src, reason, n = self._migrating
            tracing.event(
                self.span,
                tracing.MIGRATION_EVENT,
                {
                    "tokenbus.from_replica": src,
                    "tokenbus.to_replica": replica,
                    tracing.ERROR_TYPE: reason,
                    tracing.MIGRATIONS: n,
                },
            )
        self._migrating = None

    def moved(self, replica: str | None, reason: str, migrations: int, *, count: bool) -> None:
        """The attempt on ``replica`` is given up (``count``: a migration, not a resend):
        the next replica's span links the one that served it (when it traces)."""
        served = self._attempt_tp
        self.link = served or self.link
        self._attempt_tp = None
        if self.span is not None and count:
            self._migrating = (replica, reason, migrations)
            tracing.link(self.span, served, {"tokenbus.link": "migrated_from"})

    def end(
        self,
        err: BaseException | str | None,
        *,
        replica: str | None,
        migrations: int,
        finish_reason: str | None,
        cancelled: bool,
        usage: Usage | None,
    ) -> None:
        """End the stream's own span (the bridge ends its server span itself)."""
        span = self.span
        if self._migrating is not None:
            self.accept(None, None)
        if not self._own or span is None:
            return
        self._own = False
        attrs: dict[str, Any] = {
            tracing.REPLICA: replica,
            tracing.MIGRATIONS: migrations or None,
        }
        if finish_reason:
            attrs[tracing.FINISH_REASONS] = [finish_reason]
            attrs[tracing.OUTCOME] = finish_reason
        elif cancelled and err is None:
            attrs[tracing.OUTCOME] = "cancelled"
        elif err is None:
            err = "failed"  # refused before it was sent (too large, the bus down)
        if usage is not None:
            attrs[tracing.INPUT_TOKENS] = usage.prompt_tokens
            attrs[tracing.OUTPUT_TOKENS] = usage.completion_tokens
        tracing.set_attributes(span, attrs)
        tracing.end(span, err)
