"""Per-request records: every stage's timestamps turned into the latency breakdown.

The DESIGN.md definitions: t0 the client sends, t1 the gateway receives, t2 the engine
starts, t3 the engine has the first token, t4 the gateway gets it, t5 the client gets it,
t6 the client gets the last. Gateway latency = (t2 - t0) + (t5 - t3); engine latency =
t3 - t2.

A worker publishes a record for every request it served (``source: worker``: what the
engine saw, for NATS and HTTP callers alike); the HTTP bridge publishes the complete one
for its requests (``source: http``: t1, t5, t6 and the status too). Both go to
``tb.v1.telemetry.request``, fire and forget: a telemetry service that is down or slow never
slows or fails a request. The telemetry service merges them by request id.

A process sends its records together (:class:`Recorder`): the records of up to
``BATCH_WINDOW_S`` in one message, ``{"records": [...]}``, a lone record as itself. Under load
that is one message every 50 ms per process instead of one per request, for the publisher,
nats-server and the telemetry service alike; a record reaches the service at most 50 ms
later, and is sent at once when the process stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nats.aio.client import Client as NATS

from bus_schemas import codec, subjects

# Marks a request collects on its way, in path order (Tb-Timings; see bus_schemas.marks).
PATH = ("t0", "ingress", "auth", "ratelimit", "filter", "route", "engine_start")
STAGES = ("ingress", "auth", "ratelimit", "filter", "route")


def subject() -> str:
    return f"{subjects.PREFIX}.telemetry.request"


def _ms(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1e6, 3)


def stage_ms(timings: dict[str, int]) -> dict[str, float]:
    """Time spent in each stage: from the previous mark on the path to the stage's own."""
    out: dict[str, float] = {}
    prev: int | None = None
    for name in PATH:
        ts = timings.get(name)
        if ts is None:
            continue
        if prev is not None and name in STAGES:
            out[name] = round(max(0, ts - prev) / 1e6, 3)
        prev = ts
    return out


def build(
    *,
    request_id: str,
    source: str,
    model: str,
    timings: dict[str, int],
    outcome: str,
    replica: str | None = None,
    principal: str | None = None,
    kind: str | None = None,
    status: int | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    migrations: int = 0,
    trace_id: str | None = None,
    usage_source: str | None = None,
    streamed: bool = True,
    t1: int | None = None,
    t4: int | None = None,
    t5: int | None = None,
    t6: int | None = None,
) -> dict[str, Any]:
    """One request's record (times in ms, timestamps in epoch ns)."""
    t0 = timings.get("t0") or t1
    t2, t3 = timings.get("engine_start"), timings.get("first_token")
    end = t6 or timings.get("engine_end")
    first = t5 or t3
    gateway = None
    if t0 is not None and t2 is not None and first is not None and t3 is not None:
        gateway = round(((t2 - t0) + (first - t3)) / 1e6, 3)
    tbt = None
    # A whole (non-streamed) answer reaches the client at once: t5 is its arrival, and there
    # is no time between tokens to speak of.
    if streamed and first is not None and end is not None and completion_tokens > 1:
        tbt = round((end - first) / 1e6 / (completion_tokens - 1), 3)
    stages = stage_ms(timings)
    return {
        "request_id": request_id,
        "source": source,
        "ts_ns": t0 or t1 or 0,
        "model": model,
        "replica": replica,
        "principal": principal,
        "kind": kind,
        "outcome": outcome,
        "status": status,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "migrations": migrations,
        "trace_id": trace_id,
        # Where prompt_tokens came from when the engine did not count them (an upstream
        # without usage on streams: "tokenized" or "estimate"; "upstream": it said).
        "usage_source": usage_source,
        "ttft_ms": _ms(t0, first),
        "tbt_ms": tbt,
        "e2e_ms": _ms(t0, end),
        "gateway_ms": gateway,
        "engine_ms": _ms(t2, t3),
        "prefill_ms": _ms(t2, t3),
        "decode_ms": _ms(t3, timings.get("engine_end")),
        "relay_ms": _ms(t3, first) if t5 and streamed else None,
        "streamed": streamed,
        "stages": stages,
        "t": {k: v for k, v in {**timings, "t1": t1, "t4": t4, "t5": t5, "t6": t6}.items() if v},
    }


BATCH_WINDOW_S = 0.05  # the longest a record waits for others to go with
BATCH_MAX = 64  # records in one message at most (a few hundred bytes each)


def batch(data: dict[str, Any]) -> list[Any]:
    """The records of one message: the list of a batch, or the message itself."""
    recs = data.get("records") if "request_id" not in data else None
    return recs if isinstance(recs, list) else [data]


class Recorder:
    """One connection's records, sent together: fire and forget, never raises, never
    waits for the telemetry service."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._batch: list[dict[str, Any]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.messages = 0

    def add(self, record: dict[str, Any]) -> None:
        self._batch.append(record)
        if len(self._batch) >= BATCH_MAX:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(BATCH_WINDOW_S, self._send)

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        recs, self._batch = self._batch, []
        if not recs:
            return
        try:
            data = codec.encode(recs[0] if len(recs) == 1 else {"records": recs})
        except Exception:  # a record that cannot be encoded: fire and forget, never raise
            return
        self.messages += 1
        task = asyncio.get_running_loop().create_task(self._publish(data))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(self, data: bytes) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(subject(), data)

    async def flush(self) -> None:
        """Send what waits now and hand it to the connection (a stopping process)."""
        self._send()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=2.0)
