"""What a worker's collaborators use of their worker and of each other: each a small
``Protocol``, so that the intake, the runner, the accounting, the heartbeats, the health and
the adapters depend on what they use, not on :class:`engine_worker.worker.Worker`, which
wires them (imports flow one way: the worker imports its collaborators, never the reverse).

:class:`~engine_worker.worker.Worker` is the :class:`Replica` they are given; the port of each
collaborator (:class:`IntakePort` and the others) is what the others use of it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from structlog.typing import FilteringBoundLogger

from bus_schemas import errors as E
from engine_worker.backends.base import Backend
from engine_worker.backlog import PrefillBacklog
from engine_worker.flow import FlowControl
from engine_worker.generation import Generation
from engine_worker.kvloop import KVLoop
from engine_worker.outbox import Outbox
from engine_worker.perf import EnginePerf
from filter.output_gate import OutputGate
from services.config import Settings, WorkerSettings
from services.runtime import GaveUp


class IntakePort(Protocol):
    """What the runner uses of the intake (:class:`engine_worker.intake.Intake`)."""

    # Streams their callers cancelled: reply -> a copy the caller never read.
    caller_cancelled: dict[str, bool]

    def forget(self, msg: Msg) -> None:
        """The dispatch ``msg`` was handled: its early ack, if any, is no longer pending."""
        ...

    async def admit(self, msg: Msg) -> Generation | None:
        """The request to serve, or None once its refusal went back in the ack."""
        ...

    async def ack(self, msg: Msg, err: E.TokenbusError | None) -> None:
        """Answer the router's dispatch: taken, or refused with ``err``."""
        ...


class AccountingPort(Protocol):
    """What the runner uses of the accounting (:class:`engine_worker.accounting.Accounting`)."""

    def learn(self, gen: Generation, end_ns: int) -> None:
        """Teach the latency models what this request took."""
        ...

    def log_flags(self, gen: Generation, gate: OutputGate) -> None:
        """Log the detectors the policy flags that the whole output triggered, if any."""
        ...

    def report_ahead(self, gen: Generation) -> None:
        """Queue the ended request's usage report and telemetry record ahead of its final
        frame."""
        ...

    async def settle(self, gen: Generation) -> None:
        """After the request ended and left its slot: its report, log line, span and record."""
        ...


class HealthPort(Protocol):
    """What the others use of the engine's health (:class:`engine_worker.health.EngineHealth`)."""

    # Why the engine cannot serve (it died, or stopped making output), or None.
    failure: str | None
    progress_at: float  # the engine's last output, any request's (time.monotonic())

    async def check(self) -> None:
        """Act on a problem found now, once."""
        ...


class HeartbeatsPort(Protocol):
    """What the runner uses of the heartbeats (:class:`engine_worker.heartbeat.Heartbeats`)."""

    busy: asyncio.Event  # set when an idle replica takes a request: beat now
    # Streams whose callers cannot see heartbeats (Tb-Keepalive): reply -> None.
    keepalive: dict[str, None]


class AdaptersPort(Protocol):
    """What the intake and the runner use of the adapters (:class:`engine_worker.lora.Adapters`)."""

    def refuses(self, model: str) -> bool:
        """Whether a request for ``model`` names an adapter unloading or unloaded here."""
        ...

    def track(self, reply: str, model: str) -> None:
        """Note that the request answering to ``reply`` runs on ``model``, if an adapter."""
        ...

    def release(self, reply: str) -> None:
        """The request answering to ``reply`` ended: an unload waiting on it may go on."""
        ...


class Replica(Protocol):
    """What the collaborators use of the worker that wires them: one replica of one model on
    the bus (:class:`engine_worker.worker.Worker`)."""

    replica: str
    model: str
    boot: str  # this process's id, in heartbeats and keepalive frames
    cfg: WorkerSettings
    settings: Settings
    backend: Backend
    endpoints: list[str]
    nc: NATS
    log: FilteringBoundLogger
    outbox: Outbox
    flow: FlowControl | None
    perf: EnginePerf
    backlog: PrefillBacklog
    kv_loop: KVLoop
    draining: bool
    # The requests in flight: the caller's reply subject -> the request's task.
    _active: dict[str, asyncio.Task[Any]]
    reconnects: int  # times the NATS connection came back after a break
    failure: GaveUp | None  # set once the service gave up (Service.give_up)

    # Its collaborators, as the others use them (read-only: the worker wires them).
    @property
    def intake(self) -> IntakePort: ...

    @property
    def accounting(self) -> AccountingPort: ...

    @property
    def health(self) -> HealthPort: ...

    @property
    def heartbeats(self) -> HeartbeatsPort: ...

    @property
    def adapters(self) -> AdaptersPort: ...

    def heartbeat_body(self) -> dict[str, Any]:
        """The heartbeat (bus_schemas.messages.Heartbeat) this replica sends now."""
        ...

    async def heartbeat(self) -> None:
        """Beat now (a change the routers must hear at once)."""
        ...

    def own_reply(self, msg: Msg) -> str | None:
        """The reply subject of a request from the bus's roles, where it is the sender's own
        inbox (services.replies)."""
        ...

    def give_up(self, reason: str, exit_code: int = 2) -> None:
        """Stop serving for good: the process exits with ``exit_code``."""
        ...
