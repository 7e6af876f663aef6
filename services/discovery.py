"""The NATS micro-service discovery protocol (``$SRV.PING|INFO|STATS``).

Answers as ``nats micro ls/info/stats`` expect, with tokenbus' own per-endpoint counters.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

API_PREFIX = "$SRV"


@dataclass
class EndpointStats:
    """Counters of one endpoint."""

    name: str
    subject: str
    queue_group: str | None
    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""
    processing_time_ns: int = 0

    def record(self, elapsed_ns: int, error: str | None) -> None:
        self.num_requests += 1
        self.processing_time_ns += elapsed_ns
        if error:
            self.num_errors += 1
            self.last_error = error


@dataclass
class Discovery:
    """Answers discovery requests for one service instance."""

    name: str
    id: str
    version: str
    description: str
    metadata: dict[str, str] = field(default_factory=dict)
    endpoints: list[EndpointStats] = field(default_factory=list)
    started: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat().replace("+00:00", "Z")
    )
    _subs: list[Any] = field(default_factory=list)

    def _base(self, kind: str) -> dict[str, Any]:
        return {
            "type": f"io.nats.micro.v1.{kind}_response",
            "name": self.name,
            "id": self.id,
            "version": self.version,
            "metadata": self.metadata,
        }

    def ping(self) -> dict[str, Any]:
        return self._base("ping")

    def info(self) -> dict[str, Any]:
        d = self._base("info")
        d["description"] = self.description
        d["endpoints"] = [
            {"name": e.name, "subject": e.subject, "queue_group": e.queue_group, "metadata": None}
            for e in self.endpoints
        ]
        return d

    def stats(self) -> dict[str, Any]:
        d = self._base("stats")
        d["started"] = self.started
        d["endpoints"] = [
            {
                "name": e.name,
                "subject": e.subject,
                "queue_group": e.queue_group,
                "num_requests": e.num_requests,
                "num_errors": e.num_errors,
                "last_error": e.last_error,
                "processing_time": e.processing_time_ns,
                "average_processing_time": (
                    e.processing_time_ns // e.num_requests if e.num_requests else 0
                ),
                "data": None,
            }
            for e in self.endpoints
        ]
        return d

    async def start(self, nc: NATS) -> None:
        """Subscribe the discovery subjects (plain subscriptions: every instance answers)."""
        for verb, fn in (("PING", self.ping), ("INFO", self.info), ("STATS", self.stats)):
            for subj in (
                f"{API_PREFIX}.{verb}",
                f"{API_PREFIX}.{verb}.{self.name}",
                f"{API_PREFIX}.{verb}.{self.name}.{self.id}",
            ):
                self._subs.append(await nc.subscribe(subj, cb=self._responder(nc, fn)))

    async def stop(self) -> None:
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._subs.clear()

    @staticmethod
    def _responder(nc: NATS, fn: Any) -> Any:
        async def cb(msg: Msg) -> None:
            if msg.reply:
                await nc.publish(msg.reply, json.dumps(fn()).encode())

        return cb
