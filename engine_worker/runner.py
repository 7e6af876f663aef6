"""A worker's requests, served: a dispatch admitted (engine_worker/intake.py) enters the
engine when the flow control gives it a slot, its deltas go out as chunk frames through the
output gate, its final frame ends it, and what it used is told (engine_worker/accounting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, cast

from nats.aio.msg import Msg

from bus_schemas import errors as E
from bus_schemas import frames, marks, subjects
from bus_schemas import headers as H
from bus_schemas.side_outputs import EMBEDDING, GENERATION
from engine_worker import spans, tickets
from engine_worker.backends.base import Delta, DeltaStream, GenerationRequest
from engine_worker.generation import Generation
from engine_worker.outbox import Reader
from engine_worker.replica import Replica
from filter.output_gate import OutputGate
from services import tracing

# (field of a delta, key in a chunk frame) of each output beside the text, in wire order.
_SIDE = tuple((s.name, s.wire) for s in GENERATION)


def _side(d: Delta) -> dict[str, Any]:
    """A delta's output beside its text, under the chunk frame's wire keys
    (bus_schemas/side_outputs.py)."""
    side: dict[str, Any] = {}
    for name, wire in _SIDE:
        value = getattr(d, name)
        if value is not None:
            side[wire] = value
    return side


def _can_resume(backend: object, req: GenerationRequest) -> bool:
    """Whether ``backend`` continues a stream of ``req`` cut off elsewhere exactly (its
    optional ``can_resume``; the sim and vLLM always do). A caller migrates a stream whose
    text it already has only to a replica that said so in its accept frame."""
    if req.token_prompt and not getattr(backend, "resumes_token_prompts", False):
        return False  # the text so far cannot follow token ids without the tokenizer
    can = getattr(backend, "can_resume", None)
    return bool(can(req)) if callable(can) else True


class RequestRunner:
    """Serves one replica's generate and embeddings requests, each in its own task."""

    def __init__(self, worker: Replica) -> None:
        self.w = worker

    async def handle(self, msg: Msg) -> None:
        """Serve one generate request: admit it, start the engine, relay its output, account."""
        try:
            await self._serve(msg)
        finally:
            self.w.intake.forget(msg)

    async def _serve(self, msg: Msg) -> None:
        w = self.w
        gen = await w.intake.admit(msg)
        if gen is None:
            return
        if tracing.on():
            spans.trace_begin(gen, w.replica, w.backend.name)
        if gen.req.kind == subjects.KIND_EMBEDDINGS:
            gen.t_start = marks.now_ns()
            self._track(gen)
            work = self._embed(msg, gen)
        else:
            stream = await self._enter_engine(msg, gen)
            if stream is False:
                return
            work = self._generate(msg, gen, None if stream is True else stream)
        try:
            await work
        except TimeoutError:
            gen.outcome = "timeout"
            w.outbox.send(gen.reply, frames.error(E.Timeout("the request's deadline passed")))
        except asyncio.CancelledError:
            if gen.reply in w.intake.caller_cancelled:
                gen.outcome = "cancelled"
                gen.task.uncancel()
                tracing.event(gen.span, tracing.CANCEL_EVENT, {"tokenbus.by": "caller"})
            else:
                gen.outcome = "interrupted"  # shutdown: the runtime sends interrupted_error()
                raise
        except E.TokenbusError as exc:
            gen.outcome = exc.code
            w.outbox.send(gen.reply, frames.error(exc))
        except Exception as exc:
            gen.outcome = "engine_error"
            w.log.exception("generation_failed", request_id=gen.rid)
            err = E.EngineError(f"the engine failed: {type(exc).__name__}")
            w.outbox.send(gen.reply, frames.error(err))
        finally:
            await self.finish(gen)

    async def _enter_engine(self, msg: Msg, gen: Generation) -> DeltaStream | bool:
        """Start generating when the flow control gives the request a slot now, and take
        its place; True when it must wait for a slot (:meth:`_generate` waits), False once a
        refusal or a failure to start went back in the ack."""
        w = self.w
        if w.flow is not None:
            try:
                gen.ticket = tickets.ticket(w.flow, gen)
            except E.TokenbusError as exc:
                await w.intake.ack(msg, exc)
                if tracing.on():
                    spans.trace_refused(exc)
                return False
            if not gen.ticket.granted.is_set():
                self._track(gen)
                return True
        # The engine starts first (its clock is the user's TTFT); the ack and the accept
        # frame go out while it prefills.
        try:
            stream = self._engine_stream(gen)
        except E.TokenbusError as exc:
            self._leave_flow(gen)
            await w.intake.ack(msg, exc)
            return False
        self._track(gen)
        return stream

    def _engine_stream(self, gen: Generation) -> DeltaStream:
        """The engine's stream of the request, started now; a failure to start is raised as
        a typed error."""
        backend = self.w.backend
        gen.t_start = marks.now_ns()
        gen.waiting_at_start = int(backend.stats().get("waiting", 0))
        try:
            stream = backend.generate(gen.req)
        except E.TokenbusError:
            raise
        except Exception as exc:
            self.w.log.exception("generate_failed", request_id=gen.rid)
            raise E.EngineError(f"the engine failed: {type(exc).__name__}") from exc
        self.w.backlog.enter(gen, int(self.w.cfg.max_model_len or 0))
        return stream

    def _leave_flow(self, gen: Generation) -> None:
        """Give the request's place in the flow control back (its slot to the next)."""
        flow = self.w.flow
        if gen.ticket is not None and flow is not None:
            flow.leave(gen.ticket, gen.completion)
            gen.ticket = None

    def _track(self, gen: Generation) -> None:
        w = self.w
        if not w._active:
            w.heartbeats.busy.set()  # the heartbeat loop may be in an idle (long) sleep
            w.health.progress_at = time.monotonic()  # idle was no sign of a stuck engine
        w._active[gen.reply] = gen.task
        w.adapters.track(gen.reply, gen.req.model)

    async def _accept(self, msg: Msg, gen: Generation) -> None:
        """Ack the router's dispatch and tell the caller which replica serves it."""
        w = self.w
        await w.intake.ack(msg, None)
        info = gen.headers.get(H.RATELIMIT_INFO)
        if gen.headers.get(H.KEEPALIVE):
            w.heartbeats.keepalive[gen.reply] = None
        w.outbox.send(
            gen.reply,
            frames.accept(
                w.replica,
                gen.rid,
                w.cfg.heartbeat_interval_s,
                info,
                gen.headers.get(H.ADMISSION),
                tracing.traceparent(gen.span) if gen.span is not None else None,
                gen.ticket.cls if gen.ticket is not None else tickets.request_class(gen.headers),
                not _can_resume(w.backend, gen.req),
            ),
        )

    async def _generate(self, msg: Msg, gen: Generation, stream: DeltaStream | None) -> None:
        """Accept the request and relay the engine's output; without a ``stream`` the
        request waits for its slot first. One displaced before its first byte by a higher
        class waits again and starts over (engine_worker/flow.py)."""
        try:
            if getattr(stream, "starting", False):
                await asyncio.sleep(0)  # its first step (the engine's start) before the ack
            await self._accept(msg, gen)
        except BaseException:
            if stream is not None:  # started (an upstream may have its request): stopped
                await stream.aclose()
            raise
        t = gen.ticket
        flow = self.w.flow
        while True:
            if stream is None:
                assert t is not None and flow is not None
                await flow.wait(t)
                if tracing.on() and t.arrived:
                    tracing.event(gen.span, tracing.QUEUE_EVENT, tickets.queue_attrs(t))
                stream = self._engine_stream(gen)
            try:
                await self._relay(gen, stream)
                return
            except asyncio.CancelledError:
                if t is None or not t.displaced or gen.reply in self.w.intake.caller_cancelled:
                    raise
                gen.task.uncancel()
            tracing.event(gen.span, tracing.DISPLACED_EVENT, {"tokenbus.service_tier": t.cls})
            stream = None
            self.w.backlog.leave(gen)  # out of the engine: it enters the backlog again behind
            assert flow is not None
            flow.requeue(t)

    async def _embed(self, msg: Msg, gen: Generation) -> None:
        """Accept an embeddings request, embed its inputs, send one chunk frame per vector
        (``em``: index and embedding), then the final frame."""
        await self._accept(msg, gen)
        async with asyncio.timeout(tickets.seconds_left(gen.headers)):
            result = await self.w.backend.embed(gen.req)
        gen.first_ns = marks.now_ns()
        send, reply = self.w.outbox.send, gen.reply
        for i, vec in enumerate(result.vectors):
            send(reply, frames.chunk("", 0, i, {EMBEDDING.wire: {"index": i, "embedding": vec}}))
        self._final_frame(gen, Delta("", 0, "stop", result.prompt_tokens, 0), "stop", None)

    async def _relay(self, gen: Generation, stream: DeltaStream) -> None:
        """Send the engine's deltas as chunk frames until it finishes, then the final frame.

        Output beside the text (tool calls, logprobs, refusal, reasoning) rides in the same
        chunk frames; under an output filter it is held and scanned whole at the end. A
        stream that can ``push`` (the ``openai`` backend) calls ``feed`` where its bytes
        arrive; any other is iterated.

        A caller that takes the answer whole (``Tb-Whole``: not streamed to anyone) gets its
        text in one chunk with the end, not a chunk per step: a batch line of 32 tokens is 2
        messages instead of 33, for this process, the bus and the caller."""
        w = self.w
        timeout = tickets.seconds_left(gen.headers)
        gate = OutputGate.for_policy(gen.policy, w.settings.filter.window, gen.req.resume_text)
        # Queued for the turn's flush, as the final frame is: an answer's last chunk and its
        # end produced in one turn leave as one message, so no caller holds a whole answer
        # without its end (a replica lost between two messages would be resumed past it).
        send = w.outbox.send
        reply = gen.reply
        health = w.health
        # Chunk numbering and tokens not yet sent matter only to this stream: locals.
        index = 0
        held_tokens = 0
        finished = False
        whole = gen.headers.get(H.WHOLE) == "1"
        held: list[str] = []  # text held for a whole answer

        ticket = gen.ticket
        # Under load, text after the first chunk is held up to ``stream_coalesce_ms`` (the
        # outbox drains it): fewer, larger frames for this process, the bus and the caller.
        hold_s = w.cfg.stream_coalesce_ms / 1000 if not whole else 0.0
        hold_from = w.cfg.stream_coalesce_streams
        active = w._active
        # A stream read from a socket reads nothing more while its text is held: the
        # upstream's tokens wait there and come in one read when the hold ends.
        reader = None
        if hold_s and w.cfg.stream_coalesce_reads and hasattr(stream, "pause_reading"):
            reader = cast(Reader, stream)

        def flush(tokens: int) -> None:
            """The held text as one chunk, with ``tokens`` of the tokens not yet sent."""
            nonlocal index, held_tokens
            text = "".join(held)
            held.clear()  # before the send: the outbox may call drain from it
            i = index
            index += 1
            held_tokens -= tokens
            send(reply, frames.chunk(text, tokens, i))

        def drain() -> None:
            """The text held for coalescing, out now (the outbox's call)."""
            if held:
                flush(held_tokens)

        def feed(d: Delta) -> bool:
            """One delta out as a frame; True once the stream is finished."""
            nonlocal index, held_tokens, finished
            if finished or (ticket is not None and ticket.displaced):
                return True
            text = d.text
            finish = d.finish_reason
            side = None
            if d.has_side:
                if gate is None:
                    side = _side(d)
                else:
                    gate.hold(d)
            if gate is not None:
                text = gate.release(text, finish)
                if finish is not None and not gate.blocked:
                    side = gate.release_held()
                if gate.blocked:
                    finish = "content_filter"
            if text or d.tokens or side:
                health.progress_at = time.monotonic()
                held_tokens += d.tokens
                if text or side:
                    first = not gen.first_ns
                    if first:
                        gen.first_ns = marks.now_ns()
                        w.backlog.leave(gen)
                        if ticket is not None:
                            ticket.first_byte = True  # no longer displaced
                        if gen.span is not None:
                            gen.span.add_event(tracing.FIRST_TOKEN)
                    if whole and side is None and finish is None:
                        held.append(text)
                    elif (
                        hold_s
                        and side is None
                        and finish is None
                        and not first
                        and len(active) >= hold_from
                    ):
                        held.append(text)
                        w.outbox.hold(reply, drain, hold_s, reader)
                    else:
                        if held and side is None:
                            held.append(text)
                            text = "".join(held)
                            held.clear()
                        elif held:  # the text held first, then this piece as it came
                            flush(held_tokens - d.tokens)
                        send(reply, frames.chunk(text, held_tokens, index, side))
                        index += 1
                        held_tokens = 0
                gen.completion += d.tokens
            if finish is None:
                return False
            if held:
                flush(held_tokens)
            finished = True
            self._final_frame(gen, d, finish, gate)
            if gate is not None:  # after the final frame: off the caller's clock
                w.accounting.log_flags(gen, gate)
            return True

        try:
            async with asyncio.timeout(timeout), contextlib.aclosing(stream) as deltas:
                push = getattr(stream, "push", None)
                if push is not None:
                    await push(feed)
                else:
                    async for d in deltas:
                        if feed(d):
                            return
                if not finished:
                    raise E.EngineError("the engine ended the stream without a finish reason")
        finally:
            if hold_s and not finished:
                drain()  # text held for coalescing goes ahead of an error frame

    def _final_frame(
        self, gen: Generation, last: Delta, finish: str, gate: OutputGate | None
    ) -> None:
        """Send the final frame (finish reason, token counts, timings); the outcome is set."""
        w = self.w
        timings = marks.parse(gen.headers)
        timings["engine_start"] = gen.t_start
        timings["first_token"] = gen.first_ns or marks.now_ns()
        timings["engine_end"] = marks.now_ns()
        gen.completion = last.completion_tokens or gen.completion
        gen.prompt_tokens = last.prompt_tokens if last.finish_reason else -1
        details = (last.usage or {}).get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            gen.cached = max(0, details["cached_tokens"])
            gen.cached_reported = True
            if gen.predicted is not None:
                w.kv_loop.observe(gen.predicted[0], gen.cached)
        w.accounting.learn(gen, timings["engine_end"])
        if finish == "content_filter":
            w.log.info(
                "output_blocked",
                request_id=gen.rid,
                detector=gate.scan.blocked_by if gate else None,
            )
        w.outbox.send(
            gen.reply,
            frames.final(
                finish,
                max(0, gen.prompt_tokens),
                gen.completion,
                timings,
                last.usage,
                last.stop_sequence if finish == "stop" else None,
                last.usage_source,
                last.kv_transfer_params,
            ),
        )
        gen.usage_source = last.usage_source
        gen.outcome = finish
        w.accounting.report_ahead(gen)

    async def finish(self, gen: Generation) -> None:
        """Free the request's slot, report its usage, write its log line and telemetry record."""
        w = self.w
        self._leave_flow(gen)
        w.backlog.leave(gen)
        gen.duplicate = w.intake.caller_cancelled.get(gen.reply, False)
        await self._free_slot(gen.reply)
        await w.accounting.settle(gen)

    async def _free_slot(self, reply: str) -> None:
        """Forget the request as active; heartbeat at once if that made room."""
        w = self.w
        w._active.pop(reply, None)
        w.heartbeats.keepalive.pop(reply, None)
        w.adapters.release(reply)
        w.intake.caller_cancelled.pop(reply, None)
        if len(w._active) == w.cfg.max_concurrency - 1:
            # It was full: say at once that there is room (routers hold requests for it).
            await w.heartbeat()
