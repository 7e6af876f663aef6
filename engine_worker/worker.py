"""The engine worker actor: one replica of one model on the bus.

It listens on its replica-specific generate subject (no queue group: the router chooses),
acknowledges the router's dispatch, streams frames straight to the caller's inbox, aborts
on cancel, and announces its load in heartbeats. On SIGTERM it stops taking work, tells the
routers it is draining, and finishes what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any

from nats.aio.msg import Msg

from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from engine_worker import backends
from engine_worker.backends.base import Backend, GenerationRequest
from engine_worker.outbox import Outbox
from filter.policy import FilterPolicy
from filter.scanner import Scanner, StreamOutput, StreamScanner
from services.kit.runtime import Service, reply_subject
from telemetry import records

# How long a cancel that arrived before its request is remembered.
EARLY_CANCEL_TTL_S = 30.0


def output_scanner(policy: dict[str, Any] | None, window: int | None) -> StreamScanner | None:
    """A stream scanner for the policy the filter stage put in the envelope, if any.

    It runs only the detectors that change the text (block, redact) and holds back only what
    could still grow into one of their matches, so the first token is not delayed for a
    detector that would merely flag; flags are found by one whole-text scan at the end
    (:func:`output_flags`).
    """
    if not policy:
        return None
    return StreamScanner(FilterPolicy.from_dict(policy), window=window, changes_only=True)


def output_flags(scan: StreamScanner, text: str) -> list[str]:
    """Ids of the detectors the policy flags (not blocks or redacts) that ``text`` triggers."""
    if not text:
        return []
    found = Scanner(scan.policy).scan(text).findings
    return sorted({f.detector for f in found if f.action == "flag"})


class Worker(Service):
    """One replica: generate requests, cancel, heartbeats."""

    name = "worker"
    check_deadline = False  # checked in handle() so the router hears it in the ack

    def __init__(self, settings: Any, *, backend: Backend | None = None, **kw: Any) -> None:
        super().__init__(settings, **kw)
        cfg = settings.worker
        self.cfg = cfg
        self.replica = cfg.replica or f"{cfg.backend}-{uuid.uuid4().hex[:8]}"
        self.model = cfg.model
        self.backend: Backend = backend or backends.create(cfg)
        self.draining = False
        self._active: dict[str, asyncio.Task[Any]] = {}
        self._caller_cancelled: set[str] = set()
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        self.boot = uuid.uuid4().hex[:12]
        self._seq = 0
        self.log = self.log.bind(replica=self.replica, model=self.model)
        self.discovery.metadata.update(replica=self.replica, model=self.model)

    async def setup(self) -> None:
        self.outbox = Outbox(self.nc)
        await self.backend.start()
        await self.add_endpoint(
            "generate", subjects.engine_generate(self.model, self.replica), self.handle
        )
        self._cancel_sub = await self.nc.subscribe(
            subjects.worker_cancel(self.replica), cb=self._on_cancel
        )
        await self.heartbeat()
        self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    # -- heartbeats -------------------------------------------------------------------------
    def heartbeat_body(self) -> dict[str, Any]:
        self._seq += 1
        st = self.backend.stats()
        return {
            "type": "heartbeat",
            "replica": self.replica,
            "model": self.model,
            "backend": self.backend.name,
            "in_flight": len(self._active),
            "running": int(st.get("running", 0)),
            "waiting": int(st.get("waiting", 0)),
            "kv_usage": float(st.get("kv_usage", 0.0)),
            "max_concurrency": self.cfg.max_concurrency,
            "tp": self.cfg.tp,
            "pool": self.cfg.pool,
            "draining": self.draining,
            "interval_s": self.cfg.heartbeat_interval_s,
            "seq": self._seq,
            "boot": self.boot,
            # Bumped when the connection came back: frames sent just before may be lost, so
            # callers move their streams on (see the client's watchdog).
            "epoch": self.reconnects,
            "ts_ms": marks.now_ms(),
        }

    async def heartbeat(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.heartbeat(self.model, self.replica), codec.encode(self.heartbeat_body())
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            await self.heartbeat()

    # -- lifecycle --------------------------------------------------------------------------
    async def stop_taking_work(self) -> None:
        self.draining = True
        await super().stop_taking_work()
        await self.heartbeat()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)

    async def reply_error(self, msg: Msg, err: E.TokenbusError) -> None:
        # Through the outbox, so the error frame stays behind the chunks already queued.
        reply = reply_subject(msg)
        if reply:
            self.outbox.send(reply, frames.error(err))

    async def on_stop(self) -> None:
        await self.outbox.flush()
        self._hb_task.cancel()
        await self.heartbeat()
        with contextlib.suppress(Exception):
            await self._cancel_sub.unsubscribe()
        await self.backend.stop()

    # -- requests ---------------------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        # A cancel names the stream by the caller's inbox: unique per stream and known only
        # to the caller (and the stages that carried it), unlike a request id.
        try:
            key = str(codec.decode_map(msg.data).get("reply", ""))
        except E.TokenbusError:
            return
        if not key:
            return
        task = self._active.get(key)
        if task is not None and not task.done():
            self._caller_cancelled.add(key)
            task.cancel()
        elif task is None:
            # The generate message may still be queued behind this cancel: refuse it later.
            now = time.monotonic()
            self._early_cancels[key] = now + EARLY_CANCEL_TTL_S
            while self._early_cancels and next(iter(self._early_cancels.values())) < now:
                self._early_cancels.popitem(last=False)

    async def handle(self, msg: Msg) -> None:
        reply = reply_subject(msg)
        if self.draining:
            await self._ack(msg, E.ReplicaDraining(f"replica {self.replica} is draining"))
            return
        if marks.expired(msg.headers):
            await self._ack(msg, E.Timeout("the request's deadline passed before it was served"))
            return
        if len(self._active) >= self.cfg.max_concurrency:
            # At capacity (its engine queue included): the router tries another replica or
            # holds the request in its bounded queue.
            await self._ack(
                msg, E.ReplicaBusy(f"replica {self.replica} is at its limit of requests")
            )
            return
        try:
            env = codec.decode_map(msg.data)
            req = GenerationRequest.from_envelope(env)
        except (E.TokenbusError, KeyError, TypeError, ValueError) as exc:
            err = (
                exc
                if isinstance(exc, E.TokenbusError)
                else E.InvalidRequest(f"malformed envelope: {exc}")
            )
            await self._ack(msg, err)
            return
        rid = req.request_id
        task = asyncio.current_task()
        assert task is not None
        if not reply:
            await self._ack(msg, E.InvalidRequest("the request carries no reply subject"))
            return
        if self._early_cancels.pop(reply, None) is not None:
            await self._ack(msg, E.Cancelled("the caller cancelled this request"))
            return
        t_start = marks.now_ns()
        hdrs = msg.headers or {}
        outcome = "ok"
        first_ns = 0
        completion = 0
        prompt_tokens = -1
        # The engine starts first (its clock is the user's TTFT); the ack and the accept
        # frame go out while it prefills.
        try:
            stream = self.backend.generate(req)
        except E.TokenbusError as exc:
            await self._ack(msg, exc)
            return
        except Exception as exc:
            self.log.exception("generate_failed", request_id=rid)
            await self._ack(msg, E.EngineError(f"the engine failed: {type(exc).__name__}"))
            return
        self._active[reply] = task
        send = self.outbox.send
        try:
            await self._ack(msg, None)
            send(
                reply,
                frames.accept(
                    self.replica, rid, self.cfg.heartbeat_interval_s, hdrs.get(H.RATELIMIT_INFO)
                ),
            )
            deadline = marks.deadline_ms(hdrs)
            timeout = None if deadline is None else max(0.0, deadline / 1000.0 - time.time())
            index = 0
            scan = output_scanner(env.get("filter_policy"), self.settings.filter.window)
            raw: list[str] = []  # the engine's text, for the flag scan at the end
            held_tokens = 0
            already = 0  # output the caller already has (a migrated request), not resent
            if scan is not None and req.resume_text:
                # The scanner needs what came before; what it holds of it was sent already.
                already = len(req.resume_text) - len(scan.feed(req.resume_text).text_to_emit)
            async with asyncio.timeout(timeout), contextlib.aclosing(stream) as gen:
                async for d in gen:
                    text = d.text
                    finish = d.finish_reason
                    if scan is not None:
                        # The output filter holds back what could still become a match.
                        raw.append(text)
                        out = scan.feed(text) if text else None
                        if finish is not None and (out is None or out.blocked_by is None):
                            tail = scan.finish()
                            out = StreamOutput(
                                (out.text_to_emit if out else "") + tail.text_to_emit,
                                tail.blocked_by,
                            )
                        text = out.text_to_emit if out else ""
                        if already and text:
                            cut = min(already, len(text))
                            text, already = text[cut:], already - cut
                        if out is not None and out.blocked_by is not None:
                            finish = "content_filter"
                    if text or d.tokens:
                        held_tokens += d.tokens
                        if text:
                            if not first_ns:
                                first_ns = marks.now_ns()
                            send(reply, frames.chunk(text, held_tokens, index))
                            index += 1
                            held_tokens = 0
                        completion += d.tokens
                    if finish is not None:
                        timings = marks.parse(hdrs)
                        timings["engine_start"] = t_start
                        timings["first_token"] = first_ns or marks.now_ns()
                        timings["engine_end"] = marks.now_ns()
                        completion = d.completion_tokens or completion
                        prompt_tokens = d.prompt_tokens if d.finish_reason else -1
                        if finish == "content_filter":
                            self.log.info(
                                "output_blocked",
                                request_id=rid,
                                detector=scan.blocked_by if scan else None,
                            )
                        send(
                            reply, frames.final(finish, max(0, prompt_tokens), completion, timings)
                        )
                        outcome = finish
                        if scan is not None:  # after the final frame: off the caller's clock
                            flags = output_flags(scan, "".join(raw))
                            if flags:
                                self.log.info("output_flagged", request_id=rid, detectors=flags)
                        break
                else:
                    raise E.EngineError("the engine ended the stream without a finish reason")
        except TimeoutError:
            outcome = "timeout"
            send(reply, frames.error(E.Timeout("the request's deadline passed")))
        except asyncio.CancelledError:
            if reply in self._caller_cancelled:
                outcome = "cancelled"
                t = asyncio.current_task()
                if t is not None:
                    t.uncancel()
            else:
                outcome = "interrupted"  # shutdown: the runtime sends interrupted_error()
                raise
        except E.TokenbusError as exc:
            outcome = exc.code
            send(reply, frames.error(exc))
        except Exception as exc:
            outcome = "engine_error"
            self.log.exception("generation_failed", request_id=rid)
            send(reply, frames.error(E.EngineError(f"the engine failed: {type(exc).__name__}")))
        finally:
            self._active.pop(reply, None)
            self._caller_cancelled.discard(reply)
            if len(self._active) == self.cfg.max_concurrency - 1:
                # It was full: say at once that there is room (routers hold requests for it).
                await self.heartbeat()
            if H.RATELIMIT in hdrs:
                await self._report_usage(hdrs, rid, req.max_tokens, prompt_tokens, completion)
            end = marks.now_ns()
            trace = marks.trace_id(hdrs)
            self.log.info(
                "request",
                request_id=rid,
                trace_id=trace,
                outcome=outcome,
                completion_tokens=completion,
                ttft_ms=round((first_ns - t_start) / 1e6, 3) if first_ns else None,
                duration_ms=round((end - t_start) / 1e6, 3),
            )
            if self.settings.telemetry.enabled:
                timings = {**marks.parse(hdrs), "engine_start": t_start, "engine_end": end}
                if first_ns:
                    timings["first_token"] = first_ns
                rec = records.build(
                    request_id=rid,
                    source="worker",
                    model=self.model,
                    timings=timings,
                    outcome=outcome,
                    replica=self.replica,
                    principal=hdrs.get(H.PRINCIPAL),
                    kind=req.kind,
                    prompt_tokens=max(0, prompt_tokens),
                    completion_tokens=completion,
                    migrations=int(hdrs.get(H.MIGRATION, "0") or 0),
                    trace_id=trace,
                )
                await records.publish(self.nc, rec)

    async def _report_usage(
        self, hdrs: dict[str, str], rid: str, max_tokens: int, prompt_tokens: int, completion: int
    ) -> None:
        """Tell the rate limiters what the request really used (fire and forget)."""
        try:
            window, reserved, flags, owner = [*hdrs[H.RATELIMIT].split(","), ""][:4]
            if prompt_tokens < 0:  # ended early: keep the admission's prompt estimate
                prompt_tokens = max(0, int(reserved) - max_tokens)
            body = {
                "principal": hdrs.get(H.PRINCIPAL, ""),
                "request_id": rid,
                "window": int(window),
                "reserved": int(reserved),
                "used": prompt_tokens + completion,
                "flags": flags,
            }
        except (KeyError, ValueError):
            return
        with contextlib.suppress(Exception):
            # To the limiter instance that admitted the request: it holds the request's slot.
            await self.nc.publish(subjects.usage(owner or None), codec.encode(body))

    def interrupted_error(self) -> E.TokenbusError:
        return E.ReplicaLost(f"replica {self.replica} stopped before finishing; retry")

    async def _ack(self, msg: Msg, err: E.TokenbusError | None) -> None:
        if not msg.reply:
            return
        body: dict[str, Any] = {
            "type": "ack",
            "ok": err is None,
            "replica": self.replica,
            "in_flight": len(self._active),
        }
        if err is not None:
            body["error"] = err.to_dict()
        with contextlib.suppress(Exception):
            await self.nc.publish(msg.reply, codec.encode(body))
