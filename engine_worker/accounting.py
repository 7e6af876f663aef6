"""What a worker's request used, told: the usage report to the rate limiters, the telemetry
record, the request's log line, and what the latency models learn from it."""

from __future__ import annotations

import contextlib
from typing import Any

from bus_schemas import headers as H
from bus_schemas import marks, subjects
from engine_worker import spans
from engine_worker.generation import Generation
from engine_worker.replica import Replica
from filter.output_gate import OutputGate
from services import usage
from telemetry import records


class Accounting:
    """The reports and records of one replica's requests, and the recorder they go through."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker

    async def open(self) -> None:
        """Open the telemetry recorder (its spool on disk) on the worker's connection."""
        w = self.w
        self.records = await records.Recorder(
            w.nc, records.spool_for(w.settings.telemetry, "worker", w.replica)
        ).open()

    async def records_first(self) -> None:
        """The outbox's hook: records of requests that ended leave before their frames."""
        if self.records.waiting:
            await self.records.send_now()

    def learn(self, gen: Generation, end_ns: int) -> None:
        """Teach the latency models (engine_worker/perf.py) what this request took."""
        if not gen.first_ns or gen.prompt_tokens < 0 or gen.req.kind == subjects.KIND_EMBEDDINGS:
            return
        tpot = None
        if gen.completion > 1:
            tpot = (end_ns - gen.first_ns) / 1e6 / (gen.completion - 1)
        self.w.perf.observe(
            ttft_ms=(gen.first_ns - gen.t_start) / 1e6,
            computed_tokens=max(0, gen.prompt_tokens - gen.cached),
            waiting=gen.waiting_at_start,
            ahead_tokens=gen.backlog_ahead,
            tpot_ms=tpot,
            running=int(self.w.backend.stats().get("running", 1)) - 1,
        )
        # The backlog is worked off at the engine's speed as now learned (backlog.py).
        self.w.backlog.set_speed(self.w.perf.prefill_ms_per_token())

    def log_flags(self, gen: Generation, gate: OutputGate) -> None:
        """Log the detectors the policy flags that the whole output triggered, if any."""
        flags = gate.flags()
        if flags:
            self.w.log.info("output_flagged", request_id=gen.rid, detectors=flags)

    def report_ahead(self, gen: Generation) -> None:
        """Queue the ended request's usage report and telemetry record to leave ahead of its
        final frame (engine_worker/outbox.py): once its caller has the answer, the limiters'
        spend stream and the records' stream have been sent what it used, even if this
        process is killed the next moment."""
        gen.reported = True
        hdrs = gen.headers
        if H.RATELIMIT in hdrs:
            out = self.report_of(gen)
            if out is not None and subjects.is_usage_spend(out[0]):
                # Kept by the spend stream: tried until it acknowledges (a report it never
                # took leaves the request uncharged once the admitting limiter is gone).
                self.records.send_first(*out)
            elif out is not None:  # to the admitting limiter alone (tokens, slots)
                self.w.outbox.send_first(*out)
        if self.w.settings.telemetry.enabled:
            end = marks.now_ns()
            self.records.add(self.telemetry_record(gen, end, marks.trace_id(hdrs)))

    async def settle(self, gen: Generation) -> None:
        """After the request ended and left its slot: its usage report (unless it left ahead
        of the final frame), its log line, its span's end and its telemetry record."""
        w = self.w
        hdrs = gen.headers
        if H.RATELIMIT in hdrs and not gen.reported:
            await self._report_usage(gen)
        end = marks.now_ns()
        trace = marks.trace_id(hdrs)
        w.log.info(
            "request",
            request_id=gen.rid,
            client_request_id=hdrs.get(H.CLIENT_REQUEST_ID),
            trace_id=trace,
            outcome=gen.outcome,
            completion_tokens=gen.completion,
            ttft_ms=round((gen.first_ns - gen.t_start) / 1e6, 3) if gen.first_ns else None,
            duration_ms=round((end - gen.t_start) / 1e6, 3),
        )
        if gen.span is not None:
            spans.trace_end(gen)
        if w.settings.telemetry.enabled and not gen.reported:
            self.records.add(self.telemetry_record(gen, end, trace))

    def telemetry_record(self, gen: Generation, end: int, trace: str | None) -> dict[str, Any]:
        """The worker's telemetry record of the request."""
        hdrs = gen.headers
        timings = {**marks.parse(hdrs), "engine_start": gen.t_start, "engine_end": end}
        if gen.first_ns:
            timings["first_token"] = gen.first_ns
        return records.build(
            request_id=gen.rid,
            source="worker",
            model=self.w.model,
            timings=timings,
            outcome=gen.outcome,
            replica=self.w.replica,
            principal=hdrs.get(H.PRINCIPAL),
            kind=gen.req.kind,
            prompt_tokens=max(0, gen.prompt_tokens),
            completion_tokens=gen.completion,
            migrations=marks.number(hdrs.get(H.MIGRATION)) or 0,
            trace_id=trace,
            usage_source=gen.usage_source,
            client_request_id=hdrs.get(H.CLIENT_REQUEST_ID),
            cached_tokens=gen.cached if gen.cached_reported else None,
            kv_predicted_tokens=gen.predicted[0] if gen.predicted is not None else None,
            kv_router=gen.predicted[1] if gen.predicted is not None else None,
        )

    def report_of(self, gen: Generation) -> tuple[str, bytes] | None:
        """The subject and body of the request's usage report (services/usage.py). A copy
        its caller cancelled unread says so: a hold it shares with the copy the caller reads
        (a resend under the same id) is that copy's to settle; a hold of its own it settles
        at what it produced (auth.budgets.SpendBook.settle)."""
        return usage.report_body(
            gen.headers,
            gen.rid,
            max_tokens=gen.req.max_tokens,
            prompt_tokens=gen.prompt_tokens,
            completion=gen.completion,
            cached=gen.cached,
            duplicate=self.w.replica if gen.duplicate else None,
        )

    async def _report_usage(self, gen: Generation) -> None:
        """Tell the rate limiters what the request really used (fire and forget)."""
        out = self.report_of(gen)
        if out is not None:
            with contextlib.suppress(Exception):
                await self.w.nc.publish(*out)
