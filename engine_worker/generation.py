"""One generate request while a worker serves it: what the phases of serving it share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from bus_schemas.messages import envelope_chars
from engine_worker.backends.base import GenerationRequest
from engine_worker.flow import Ticket
from filter.policy import FilterPolicy


@dataclass(slots=True)
class Generation:
    """One generate request while it is served: what its phases share."""

    reply: str
    headers: dict[str, str]
    env: dict[str, Any]
    req: GenerationRequest
    task: asyncio.Task[Any]  # the request's own task: the one a caller's cancel hits
    t_start: int = 0
    first_ns: int = 0
    completion: int = 0
    prompt_tokens: int = -1  # unknown until the final delta; -1 keeps the admission estimate
    cached: int = 0  # prompt tokens the engine read from its cache (its usage details)
    outcome: str = "ok"
    span: Any = None  # this replica's span of the request (tracing on)
    ticket: Ticket | None = None  # its place in the flow control (engine_worker/flow.py)
    usage_source: str | None = None  # where prompt_tokens came from, if not the engine
    reported: bool = False  # its usage report and record left ahead of its final frame
    duplicate: bool = False  # a copy its caller cancelled unread (see Intake.on_cancel)
    # The output filter's policy the filter stage put in the envelope, checked once.
    policy: FilterPolicy | None = None
    # The router's predicted cached prompt tokens and its id (Tb-Kv-Predicted), if any.
    predicted: tuple[int, str] | None = None
    cached_reported: bool = False  # the engine said how many prompt tokens it read cached
    waiting_at_start: int = 0  # sequences waiting in the engine when it entered
    # Its prompt tokens counted in the replica's prefill backlog (0: not, or no longer),
    # and the backlog ahead of it when it entered (engine_worker/backlog.py).
    prefill_tokens: int = 0
    backlog_ahead: int = 0
    backlog_key: int = 0  # its place in the backlog's order of entry
    chars: int = -1  # characters of text its envelope carries, once counted (prompt_chars)

    def prompt_chars(self) -> int:
        """The characters of text its envelope carries (``envelope_chars``), counted once:
        the flow control's estimate and the prefill backlog's bound both read it."""
        if self.chars < 0:
            self.chars = envelope_chars(self.env)
        return self.chars

    @property
    def rid(self) -> str:
        """The request id."""
        return self.req.request_id
