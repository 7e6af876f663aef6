"""The engine worker actor: one replica of one model on the bus.

It listens on its replica-specific generate subject (no queue group: the router chooses),
acknowledges the router's dispatch, streams frames straight to the caller's inbox, aborts
on cancel, and announces its load in heartbeats. When its engine keeps a prefix cache that
reports itself (the sim with ``kv_cache_blocks``), it publishes the cache's KV events in
batches and answers snapshot requests (:mod:`bus_schemas.kv_events`). On SIGTERM it stops
taking work, tells the routers it is draining, and finishes what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from pydantic import ValidationError

from bus_schemas import codec, frames, marks, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import kv_events as KV
from bus_schemas.messages import CLAIM, AdapterCommand, check_envelope, envelope_chars
from engine_worker import backends, kvloop, perf
from engine_worker.backends.base import (
    Backend,
    Delta,
    DeltaStream,
    GenerationRequest,
    KVEventSource,
    kv_event_source,
)
from engine_worker.claim import ReplicaClaim, ReplicaTaken
from engine_worker.flow import FlowConfig, FlowControl, Ticket, class_of
from engine_worker.outbox import Outbox
from filter.policy import FilterPolicy
from filter.scanner import Scanner, StreamOutput, StreamScanner
from services import bodies, tracing, usage
from services.caller import Assembled, Chunk
from services.runtime import Service, StartRefused, connect, flush, reply_subject
from telemetry import records

# How long a cancel that arrived before its request is remembered.
EARLY_CANCEL_TTL_S = 30.0
# A worker whose engine died or is stuck exits with this status (EX_TEMPFAIL: start it again)
# once its requests were handed back, at the latest this long after it found out.
ENGINE_FAILED_EXIT = 75
ENGINE_EXIT_GRACE_S = 15.0


def output_scanner(policy: FilterPolicy | None, window: int | None) -> StreamScanner | None:
    """A stream scanner for the policy the filter stage put in the envelope (checked in
    Worker._screen), if any.

    It runs only the detectors that change the text (block, redact) and holds back only what
    could still grow into one of their matches, so the first token is not delayed for a
    detector that would merely flag; flags are found by one whole-text scan at the end
    (:func:`output_flags`).
    """
    if policy is None:
        return None
    return StreamScanner(policy, window=window, changes_only=True)


def output_flags(scan: StreamScanner, text: str) -> list[str]:
    """Ids of the detectors the policy flags (not blocks or redacts) that ``text`` triggers."""
    if not text:
        return []
    found = Scanner(scan.policy).scan(text).findings
    return sorted({f.detector for f in found if f.action == "flag"})


class OutputGate:
    """The output filter on one stream: what of the engine's text the caller may see, when.

    It holds back what could still grow into a block or redact match, stops at a block, and
    on a migrated request cuts what the caller already has.
    """

    __slots__ = ("_already", "_changed", "_held", "_raw", "blocked", "scan")

    def __init__(self, scan: StreamScanner, resume_text: str) -> None:
        self.scan = scan
        self.blocked = False
        self._raw: list[str] = []  # the engine's text, for the flag scan at the end
        # Output beside the text (tool calls, refusal, reasoning, logprobs), held to the end
        # and scanned whole there.
        self._held = Assembled()
        self._changed = False  # the policy redacted some of the held output
        self._already = 0  # output the caller already has (a migrated request), not resent
        if resume_text:
            # The scanner needs what came before; what it holds of it was sent already.
            self._already = len(resume_text) - len(scan.feed(resume_text).text_to_emit)

    @classmethod
    def for_policy(
        cls, policy: FilterPolicy | None, window: int | None, resume_text: str
    ) -> OutputGate | None:
        """A gate for the policy the filter stage put in the envelope, if any."""
        scan = output_scanner(policy, window)
        return None if scan is None else cls(scan, resume_text)

    def release(self, text: str, finish: str | None) -> str:
        """What may go to the caller now of the engine's next ``text`` (the held tail too when
        ``finish`` ends the stream); sets ``blocked`` when the policy stops the stream."""
        self._raw.append(text)
        scan = self.scan
        out = scan.feed(text) if text else None
        if finish is not None and (out is None or out.blocked_by is None):
            tail = scan.finish()
            out = StreamOutput(
                (out.text_to_emit if out else "") + tail.text_to_emit, tail.blocked_by
            )
        if out is None:
            return ""
        text = out.text_to_emit
        if self._already and text:
            cut = min(self._already, len(text))
            text = text[cut:]
            self._already -= cut
        if out.blocked_by is not None:
            self.blocked = True
        return text

    def hold(self, d: Delta) -> None:
        """Keep ``d``'s output beside the text until :meth:`release_held`."""
        self._held.add(Chunk("", 0, 0, d.tool_calls, d.logprobs, d.refusal, d.reasoning))

    def release_held(self) -> dict[str, Any] | None:
        """The held output, scanned: tool-call arguments, refusal and reasoning text are
        redacted or stop the stream (``blocked``) as the policy says; logprobs go out only
        when the filter changed none of the output (their tokens would show what it
        removed)."""
        held = self._held
        side: dict[str, Any] = {}
        scanner = Scanner(self.scan.policy)
        calls = held.tool_calls
        for call in calls or ():
            fn = call["function"]
            fn["arguments"] = self._scan_whole(scanner, fn["arguments"])
        if calls and not self.blocked:
            side["tc"] = [{"index": i, **c} for i, c in enumerate(calls)]
        for key, text in (("rf", held.refusal), ("rs", held.reasoning)):
            if text and not self.blocked:
                side[key] = self._scan_whole(scanner, text)
        if self.blocked:
            return None
        if held.logprobs is not None and not self.scan.findings and not self._changed:
            side["lp"] = held.logprobs
        return side or None

    def _scan_whole(self, scanner: Scanner, text: str) -> str:
        res = scanner.scan(text)
        if res.blocked:
            self.blocked = True
            return ""
        if res.redacted:
            self._changed = True
            return res.redacted_text
        return text

    def flags(self) -> list[str]:
        """Ids of the detectors the policy flags that the whole output triggers."""
        return output_flags(self.scan, "".join(self._raw))


@dataclass(slots=True)
class _Generation:
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
    duplicate: bool = False  # a copy its caller cancelled unread (see Worker._on_cancel)
    # The output filter's policy the filter stage put in the envelope, checked once.
    policy: FilterPolicy | None = None
    # The router's predicted cached prompt tokens and its id (Tb-Kv-Predicted), if any.
    predicted: tuple[int, str] | None = None
    cached_reported: bool = False  # the engine said how many prompt tokens it read cached
    waiting_at_start: int = 0  # sequences waiting in the engine when it entered

    @property
    def rid(self) -> str:
        """The request id."""
        return self.req.request_id


def _side(d: Delta) -> dict[str, Any]:
    """A delta's output beside its text, under the chunk frame's wire keys."""
    side: dict[str, Any] = {}
    if d.tool_calls is not None:
        side["tc"] = d.tool_calls
    if d.logprobs is not None:
        side["lp"] = d.logprobs
    if d.refusal is not None:
        side["rf"] = d.refusal
    if d.reasoning is not None:
        side["rs"] = d.reasoning
    return side


def _can_resume(backend: object, req: GenerationRequest) -> bool:
    """Whether ``backend`` continues a stream of ``req`` cut off elsewhere exactly (its
    optional ``can_resume``; the sim and vLLM always do). A caller migrates a stream whose
    text it already has only to a replica that said so in its accept frame."""
    if req.token_prompt and not getattr(backend, "resumes_token_prompts", False):
        return False  # the text so far cannot follow token ids without the tokenizer
    can = getattr(backend, "can_resume", None)
    return bool(can(req)) if callable(can) else True


# Outcomes that are a finish reason: the request ended as the engine or the filter decided.
_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def _trace_refused(err: E.TokenbusError) -> None:
    """The replica refused the dispatch (busy, draining, expired, malformed): its span says
    why; only a refusal another replica cannot help with is an error."""
    span = tracing.current()
    tracing.outcome(span, err.code)
    if err.code not in (E.ReplicaBusy.code, E.ReplicaDraining.code):
        tracing.fail(span, err.code)


def flow_control(cfg: Any) -> FlowControl | None:
    """The flow control of a worker with settings ``cfg`` (``worker``), None when off."""
    f = cfg.flow
    if not f.enabled:
        return None
    slots = f.slots or engine_batch(cfg)
    slots = max(1, min(slots, cfg.max_concurrency))
    reserved = {c: max(1, math.ceil(share * slots)) for c, share in f.reserved.items() if share > 0}
    return FlowControl(
        FlowConfig(
            slots=slots,
            reserved=reserved,
            max_queued=dict(f.max_queued),
            max_queued_tokens=dict(f.max_queued_tokens),
            max_wait_s=dict(f.max_wait_s),
            aging_s=f.aging_s,
            input_weight=f.input_weight,
            output_weight=f.output_weight,
            displace=f.displace,
        )
    )


def engine_batch(cfg: Any) -> int:
    """The sequences the engine runs at once, as configured: the sim's ``max_running``,
    vLLM's ``max_num_seqs`` (its default, 256, when unset); for an upstream server it is
    not known here: ``max_concurrency``."""
    if cfg.backend == "sim":
        return int(cfg.sim.max_running)
    if cfg.backend == "vllm":
        return int(cfg.vllm.engine_args.get("max_num_seqs") or 256)
    return int(cfg.max_concurrency)


def _class(hdrs: dict[str, str] | None) -> str:
    """The request's class (``service_tier``) as auth settled it."""
    return class_of((hdrs or {}).get(H.PRIORITY))


def _weight(value: str | None) -> float:
    try:
        w = float(value) if value else 1.0
    except ValueError:
        return 1.0
    return w if 0 < w < 1e6 else 1.0


def _prompt_estimate(env: dict[str, Any]) -> int:
    """The prompt's tokens, estimated before the engine counts them (4 characters a
    token, of the text the envelope carries, as the ratelimit stage estimates them): what
    the flow control charges and bounds queues by."""
    return envelope_chars(env) // 4 + 1


def _queue_attrs(t: Ticket) -> dict[str, Any]:
    return {
        "tokenbus.service_tier": t.cls,
        "tokenbus.queue_wait_ms": round((time.monotonic() - t.arrived) * 1000, 3),
    }


def _seconds_left(hdrs: dict[str, str]) -> float | None:
    """Time left before the request's deadline, or None when it carries none."""
    deadline = marks.deadline_ms(hdrs)
    return None if deadline is None else max(0.0, deadline / 1000.0 - time.time())


class Worker(Service):
    """One replica: generate requests, cancel, heartbeats."""

    name = "worker"
    forwards = False  # answers and reports; never hands a request on
    check_deadline = False  # checked in _screen() so the router hears it in the ack
    releases_usage = False  # reports what the engine used (a refusal: the router does)

    async def _connect(self) -> Any:
        """Its connection, whose replies (reads of claim-checked bodies) come to the one inbox
        root the locked bus lets workers hear."""
        return await connect(
            self.settings.url(),
            f"tokenbus-{self.name}-{self.id}",
            on_reconnected=self.on_reconnected,
            inbox_prefix=subjects.bodies_reply_root(),
            **self.settings.nats_auth(),
        )

    def __init__(self, settings: Any, *, backend: Backend | None = None, **kw: Any) -> None:
        super().__init__(settings, **kw)
        cfg = settings.worker
        self.cfg = cfg
        self.replica = cfg.replica or f"{cfg.backend}-{uuid.uuid4().hex[:8]}"
        self.model = cfg.model
        self.backend: Backend = backend or backends.create(cfg)
        self.endpoints = list(cfg.endpoints) or list(self.backend.endpoints())
        # What its upstream can do, when the backend fronts one (the openai backend).
        caps = getattr(self.backend, "capabilities", None)
        self._upstream_caps: Callable[[], dict[str, Any]] | None = caps if callable(caps) else None
        self.draining = False
        # Why the engine cannot serve (it died, or stopped making output): set once.
        self.engine_failure: str | None = None
        self._progress_at = time.monotonic()  # the engine's last output, any request's
        self._active: dict[str, asyncio.Task[Any]] = {}
        self._busy = asyncio.Event()  # set when an idle replica takes a request: beat now
        # Streams whose callers cannot see heartbeats (Tb-Keepalive): reply -> None.
        self._keepalive: dict[str, None] = {}
        # Streams their callers cancelled: reply -> a copy the caller never read (it sent
        # the request elsewhere meanwhile), whose usage report leaves the spend to the copy
        # it reads.
        self._caller_cancelled: dict[str, bool] = {}
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        # Dispatches acknowledged before their claim-checked body was fetched (id of the
        # message -> the caller's reply): a later refusal goes to the caller as an error.
        self._acked_early: dict[int, str] = {}
        self.boot = uuid.uuid4().hex[:12]
        self._seq = 0
        self.log = self.log.bind(replica=self.replica, model=self.model)
        self.discovery.metadata.update(replica=self.replica, model=self.model)
        self.flow = flow_control(cfg)
        self.kv_loop = kvloop.KVLoop()
        self.perf = perf.EnginePerf()  # its engine's speed, learned from its requests
        # The engine's prefix cache, when it reports one (set up in setup()).
        self._kv: KVEventSource | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._kv_wake = asyncio.Event()
        self._kv_closing = False
        # LoRA adapters at run time (docs/adapters.md): the requests on each (reply -> name),
        # those draining to be unloaded and those unloaded here (refused, so a router with
        # an older view sends them elsewhere), one change at a time.
        self._on_adapter: dict[str, str] = {}
        self._unloading: set[str] = set()
        self._unloaded: set[str] = set()
        self._adapter_left = asyncio.Event()
        self._adapter_lock = asyncio.Lock()

    async def setup(self) -> None:
        self.outbox = Outbox(self.nc)
        self._records = await records.Recorder(
            self.nc, records.spool_for(self.settings.telemetry, "worker", self.replica)
        ).open()
        self.outbox.before = self._records_first
        # Before the engine loads: a second process with this id refuses at once.
        self._claim = ReplicaClaim(self.nc, self.replica, self.boot, self.give_up)
        try:
            await self._claim.take(self.cfg.claim_wait_s)
        except ReplicaTaken as exc:
            raise StartRefused(str(exc)) from None
        await self.backend.start()
        if not self.cfg.endpoints:  # the engine may know better once loaded (vllm: the runner)
            self.endpoints = list(self.backend.endpoints())
        # A queue group of its own: should two processes serve the id for a moment (one
        # that was cut off comes back), each request still goes to one of them.
        await self.add_endpoint(
            "generate",
            subjects.engine_generate(self.model, self.replica),
            self.handle,
            queue=f"replica.{self.replica}",
        )
        self._cancel_sub = await self.nc.subscribe(
            subjects.worker_cancel(self.replica), cb=self._on_cancel
        )
        self._adapters_sub = await self.nc.subscribe(
            subjects.worker_adapters(self.model, self.replica), cb=self._on_adapters
        )
        await self.heartbeat()
        self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        await self._start_kv_events()

    # -- KV-cache events ----------------------------------------------------------------------
    async def _start_kv_events(self) -> None:
        """Publish the engine's KV events and answer snapshot requests, if it has any."""
        kv = self._kv = kv_event_source(self.backend)
        if kv is None:
            return
        kv.on_events(self._kv_wake.set)
        self._kv_sub = await self.nc.subscribe(
            subjects.kv_snapshot(self.model, self.replica), cb=self._on_kv_snapshot
        )
        self._kv_task = asyncio.get_running_loop().create_task(self._kv_loop())

    async def _kv_loop(self) -> None:
        """Publish pending KV events, gathered over ``kv_events_interval_s`` (or one
        event-loop turn) into as few messages as hold them, until the worker stops."""
        interval = float(self.cfg.kv_events_interval_s)
        while True:
            await self._kv_wake.wait()
            if not self._kv_closing:
                await asyncio.sleep(interval)  # 0: the events of this loop turn
            self._kv_wake.clear()
            await self._publish_kv()
            if self._kv_closing:
                return

    async def _publish_kv(self) -> None:
        kv = self._kv
        if kv is None:
            return
        first, events = kv.drain_events()
        if not events:
            return
        subject = subjects.kv_events(self.model, self.replica)
        for batch in KV.batches(
            replica=self.replica,
            model=self.model,
            boot=self.boot,
            block_size=kv.block_size,
            seq_first=first,
            events=events,
            ts_ms=marks.now_ms(),
        ):
            # A batch lost here is a gap in the numbers: its readers ask for a snapshot.
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, codec.encode(batch))

    async def _on_kv_snapshot(self, msg: Msg) -> None:
        """Answer a snapshot request (whatever its body) with the cache as it is now, in as
        many pages as it takes, all built at this instant."""
        kv = self._kv
        if kv is None or not self._own_reply(msg):
            return
        seq, blocks = kv.snapshot()
        pages = KV.snapshot_pages(
            replica=self.replica,
            model=self.model,
            boot=self.boot,
            block_size=kv.block_size,
            capacity_blocks=kv.capacity,
            seq=seq,
            blocks=blocks,
            stats=kv.stats(),
            medium=kv.medium,
            hashing=getattr(kv, "hashing", None),
        )
        for page in pages:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, codec.encode(page))

    async def _stop_kv_events(self) -> None:
        """After the engine stopped: publish its last events (its cache cleared), then stop."""
        if self._kv is None:
            return
        with contextlib.suppress(Exception):
            await self._kv_sub.unsubscribe()
        self._kv_closing = True
        self._kv_wake.set()
        if self._kv_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv_task, 2.0)
        self._kv.on_events(None)

    # -- heartbeats -------------------------------------------------------------------------
    def heartbeat_body(self) -> dict[str, Any]:
        self._seq += 1
        st = self.backend.stats()
        adapters = self._adapters()
        return {
            "type": "heartbeat",
            "replica": self.replica,
            "model": self.model,
            "backend": self.backend.name,
            "in_flight": len(self._active),
            "running": int(st.get("running", 0)),
            "waiting": int(st.get("waiting", 0)),
            "kv_usage": float(st.get("kv_usage", 0.0)),
            # How its prefix cache is reported (docs/kv-events.md): events hashed as the sim
            # ("text") or as vLLM ("vllm"); absent: no events (kv_aware keeps approximate
            # affinity for it).
            **({"kv_events": self._kv_hashing()} if self._kv is not None else {}),
            # What makes its block hashes comparable (a router that computes them otherwise
            # refuses its events), and the closed loop's totals: the routers' predicted
            # cached tokens beside the engine's reports (engine_worker/kvloop.py).
            **(
                {
                    "kv_hashing": kvloop.hashing(
                        self._kv, self.model, getattr(self.backend, "revision", None)
                    ),
                    "kv_check": self.kv_loop.heartbeat(),
                }
                if self._kv is not None
                else {}
            ),
            # Its engine's speed as learned from its requests (predicted_latency routing).
            **({"perf": p} if (p := self.perf.heartbeat()) is not None else {}),
            **(
                {"flow": self.flow.stats(), "flows": self.flow.flow_stats()}
                if self.flow is not None
                else {}
            ),
            # What an upstream can do (the openai backend's probe): shown by `tokenbus status`.
            **({"upstream": self._upstream_caps()} if self._upstream_caps is not None else {}),
            "max_concurrency": self.cfg.max_concurrency,
            # The backend's effective degree when it knows it (vllm: its engine options).
            "tp": int(getattr(self.backend, "tp", self.cfg.tp)),
            "pool": self.cfg.pool,
            **({"site": self.settings.site} if self.settings.site else {}),
            **({"pd_role": self.cfg.pd_role} if self.cfg.pd_role != "both" else {}),
            "draining": self.draining,
            # The engine's health: "failed" (with the reason) takes it out of routing.
            "health": "failed" if self.engine_failure else "ok",
            **({"health_reason": self.engine_failure} if self.engine_failure else {}),
            "endpoints": self.endpoints,
            "aliases": [
                m
                for m in getattr(self.backend, "served_models", ())
                if m != self.model and m not in self._unloading
            ],
            **({"adapters": adapters} if adapters else {}),
            "interval_s": self._interval(),
            # The model's context length (0: not known here).
            "max_model_len": int(
                self.cfg.max_model_len or getattr(self.backend, "max_model_len", 0) or 0
            ),
            "seq": self._seq,
            "boot": self.boot,
            # Bumped when the connection came back: frames sent just before may be lost, so
            # callers move their streams on (see the client's watchdog).
            "epoch": self.reconnects,
            "ts_ms": marks.now_ms(),
        }

    def _kv_hashing(self) -> str:
        hashing = getattr(self._kv, "hashing", None)
        return str(hashing.get("kind")) if isinstance(hashing, dict) else KV.SCHEME_TEXT

    async def heartbeat(self) -> None:
        if self.failure is not None:  # given up (a second process of its id, or its engine
            return  # failed after its last beat said so): the id's beats are not its own
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.heartbeat(self.model, self.replica), codec.encode(self.heartbeat_body())
            )

    async def _heartbeat_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._busy.wait(), self._interval())
            self._busy.clear()
            if self.engine_failure is None:
                problem = self._engine_problem()
                if problem is not None:
                    await self._engine_lost(problem)
            await self.heartbeat()
            if self._keepalive:
                # Through the outbox: behind the chunks already queued for each stream.
                frame = frames.alive(self.boot, self.reconnects)
                for reply in list(self._keepalive):
                    self.outbox.send(reply, frame)

    # -- the engine's health -----------------------------------------------------------------
    def _engine_problem(self) -> str | None:
        """Why the engine cannot serve, or None: the backend says it died (vLLM's engine
        core), or no request in flight has had any output for ``engine_stuck_s``."""
        health = getattr(self.backend, "health", None)
        problem = health() if callable(health) else None
        if problem:
            return str(problem)
        stuck = float(self.cfg.engine_stuck_s)
        quiet = time.monotonic() - self._progress_at
        if stuck > 0 and self._active and quiet > stuck:
            return f"made no output for {quiet:.0f} s with {len(self._active)} requests in flight"
        return None

    async def _engine_lost(self, problem: str) -> None:
        """Out of routing at once (a beat that says so), every request in flight ended with
        a retryable ``replica_lost`` (its caller moves it to another replica), then the
        process exits with :data:`ENGINE_FAILED_EXIT` so that its supervisor (compose's
        restart policy, Kubernetes, ``tokenbus up``) starts it again; a stuck engine that
        does not let it stop cleanly is left after :data:`ENGINE_EXIT_GRACE_S`."""
        self.engine_failure = problem
        self.draining = True
        self.log.error("engine_failed", reason=problem, in_flight=len(self._active))
        await self.heartbeat()
        for task in list(self._active.values()):
            task.cancel()
        self.give_up(f"replica {self.replica}: the engine {problem}", ENGINE_FAILED_EXIT)
        timer = threading.Timer(ENGINE_EXIT_GRACE_S, os._exit, (ENGINE_FAILED_EXIT,))
        timer.daemon = True
        timer.start()

    def unhealthy(self) -> str | None:
        if self.engine_failure is not None:
            return f"the engine {self.engine_failure}"
        return super().unhealthy()

    # -- lifecycle --------------------------------------------------------------------------
    async def stop_taking_work(self) -> None:
        self.draining = True
        await super().stop_taking_work()
        await self.heartbeat()
        with contextlib.suppress(Exception):
            await flush(self.nc, timeout=2)  # behind the heartbeat, not ahead of it

    async def reply_error(self, msg: Msg, err: E.TokenbusError) -> None:
        # Through the outbox, so the error frame stays behind the chunks already queued.
        reply = reply_subject(msg, service="worker", log=self.log)
        if reply:
            self.outbox.send(reply, frames.error(err))

    async def on_stop(self) -> None:
        await self.outbox.flush()
        await self._records.flush()
        self._hb_task.cancel()
        await self.heartbeat()
        await self._claim.release()
        with contextlib.suppress(Exception):
            await self._cancel_sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._adapters_sub.unsubscribe()
        await self.backend.stop()
        await self._stop_kv_events()

    # -- LoRA adapters at run time (docs/adapters.md) ------------------------------------------
    def _adapters(self) -> dict[str, str]:
        """The adapters the engine loaded at run time, name -> path (the backend's own map:
        read, never changed here)."""
        held = getattr(self.backend, "adapters", None)
        return held if isinstance(held, dict) else {}

    async def _on_adapters(self, msg: Msg) -> None:
        """Load, unload or list adapters, one change at a time; the answer says what the
        replica holds after it, or the typed error naming this replica."""
        t0 = time.monotonic()
        extra: dict[str, Any] = {}
        try:
            try:
                cmd = AdapterCommand.model_validate(codec.decode_map(msg.data))
            except ValidationError as exc:
                raise E.from_validation(exc) from None
            if cmd.op != "list":
                async with self._adapter_lock:
                    if cmd.op == "load":
                        await self._load_adapter(cmd.name, cmd.path)
                        extra["load_ms"] = round((time.monotonic() - t0) * 1000, 1)
                    else:
                        extra.update(await self._unload_adapter(cmd.name, cmd.drain_s))
            body: dict[str, Any] = {"ok": True, **extra}
        except E.TokenbusError as exc:
            body = {"ok": False, "error": exc.to_dict()}
        body.update(
            type="adapters", replica=self.replica, model=self.model, adapters=dict(self._adapters())
        )
        if self._own_reply(msg):
            with contextlib.suppress(Exception):
                await msg.respond(codec.encode(body))

    async def _load_adapter(self, name: str, path: str) -> None:
        load = getattr(self.backend, "load_adapter", None)
        if not callable(load):
            raise E.InvalidRequest(
                f"replica {self.replica} (backend {self.backend.name}) cannot load adapters "
                "at run time",
                param="model",
            )
        if not name or not path:
            raise E.InvalidRequest("an adapter load names the adapter and its path", param="name")
        if name == self.model or (
            name in getattr(self.backend, "served_models", ()) and name not in self._adapters()
        ):
            raise E.InvalidRequest(
                f"{name!r} is a model replica {self.replica} serves already; an adapter needs "
                "a name of its own",
                param="name",
            )
        if self._adapters().get(name) == path:
            return  # loaded already, from the same place: done
        if self.draining or self.engine_failure:
            raise E.ReplicaDraining(f"replica {self.replica} is not taking work")
        try:
            await load(name, path)
        except E.TokenbusError as exc:
            why = exc.message
            exc.message = f"replica {self.replica} could not load the adapter {name!r}: {why}"
            raise
        except Exception as exc:
            raise E.EngineError(
                f"replica {self.replica} could not load the adapter {name!r}: {exc}"
            ) from None
        self._unloaded.discard(name)
        self.log.info("adapter_loaded", adapter=name, path=path)
        await self.heartbeat()  # routers send its requests here from now

    async def _unload_adapter(self, name: str, drain_s: float) -> dict[str, int]:
        if name not in self._adapters():
            raise E.NotFound(
                f"replica {self.replica} holds no adapter {name!r} loaded at run time",
                param="name",
            )
        # New requests go elsewhere at once (the beat, and the refusal of a late one); those
        # on it run on, for at most drain_s.
        self._unloading.add(name)
        try:
            await self.heartbeat()
            on = [r for r, n in self._on_adapter.items() if n == name]
            deadline = time.monotonic() + drain_s
            while any(self._on_adapter.get(r) == name for r in on):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._adapter_left.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._adapter_left.wait(), left)
            cut = [r for r in on if self._on_adapter.get(r) == name]
            for reply in cut:
                task = self._active.get(reply)
                if task is not None and not task.done():
                    task.cancel()  # ends as interrupted: its caller moves it on
            await self.backend.unload_adapter(name)  # type: ignore[attr-defined]
        finally:
            self._unloading.discard(name)
        self._unloaded.add(name)
        self.log.info("adapter_unloaded", adapter=name, drained=len(on) - len(cut), cut=len(cut))
        await self.heartbeat()
        return {"drained": len(on) - len(cut), "cut": len(cut)}

    # -- requests ---------------------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        # A cancel names the stream by the caller's inbox: unique per stream and known only
        # to the caller (and the stages that carried it), unlike a request id.
        try:
            body = codec.decode_map(msg.data)
            key = str(body.get("reply", ""))
        except E.TokenbusError:
            return
        if not key:
            return
        task = self._active.get(key)
        if task is not None and not task.done():
            self._caller_cancelled[key] = bool(body.get("dup"))
            task.cancel()
        elif task is None:
            # The generate message may still be queued behind this cancel: refuse it later.
            now = time.monotonic()
            self._early_cancels[key] = now + EARLY_CANCEL_TTL_S
            while self._early_cancels and next(iter(self._early_cancels.values())) < now:
                self._early_cancels.popitem(last=False)

    async def handle(self, msg: Msg) -> None:
        """Serve one generate request: admit it, start the engine, relay its output, account."""
        try:
            await self._handle(msg)
        finally:
            self._acked_early.pop(id(msg), None)

    async def _handle(self, msg: Msg) -> None:
        gen = await self._admit(msg)
        if gen is None:
            return
        if tracing.on():
            self._trace_begin(gen)
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
            self.outbox.send(gen.reply, frames.error(E.Timeout("the request's deadline passed")))
        except asyncio.CancelledError:
            if gen.reply in self._caller_cancelled:
                gen.outcome = "cancelled"
                gen.task.uncancel()
                tracing.event(gen.span, tracing.CANCEL_EVENT, {"tokenbus.by": "caller"})
            else:
                gen.outcome = "interrupted"  # shutdown: the runtime sends interrupted_error()
                raise
        except E.TokenbusError as exc:
            gen.outcome = exc.code
            self.outbox.send(gen.reply, frames.error(exc))
        except Exception as exc:
            gen.outcome = "engine_error"
            self.log.exception("generation_failed", request_id=gen.rid)
            err = E.EngineError(f"the engine failed: {type(exc).__name__}")
            self.outbox.send(gen.reply, frames.error(err))
        finally:
            await self._finish(gen)

    async def _admit(self, msg: Msg) -> _Generation | None:
        """The request to serve, or None once its refusal went back in the ack."""
        # Once per message: a reply subject refused is counted and logged once.
        reply = reply_subject(msg, service="worker", log=self.log)
        if reply in self._active:
            # The same dispatch again: its ack was lost while the bus stalled, and the router
            # asked again (router/dispatch.py). It runs already: acknowledged, not run twice.
            await self._ack(msg, None)
            return None
        try:
            env = codec.decode_map(msg.data)
            if CLAIM in env and reply:
                # Its messages by claim check. The refusals that need no body go in the ack;
                # then the ack, so that the router does not wait on the fetch (one request
                # behind another's prompt on a busy worker waited seconds); a refusal after
                # it goes to the caller as an error frame (see _ack).
                self._refuse_early(msg)
                check_envelope(env)
                await self._ack(msg, None)
                self._acked_early[id(msg)] = reply
                await bodies.resolve(self.nc, env)
            return self._screen(msg, reply, env)
        except E.TokenbusError as err:
            await self._ack(msg, err)
            if tracing.on():
                _trace_refused(err)
            return None

    def _refuse_early(self, msg: Msg) -> None:
        """The refusals that need no envelope: draining, past its deadline, full."""
        if self.draining:
            raise E.ReplicaDraining(f"replica {self.replica} is draining")
        if marks.expired(msg.headers):
            raise E.Timeout("the request's deadline passed before it was served")
        if len(self._active) >= self.cfg.max_concurrency and (
            self.flow is None or self.flow.shed_for(_class(msg.headers)) is None
        ):
            # At capacity (its queues included) with nothing of a lower class to shed: the
            # router tries another replica or holds the request in its bounded queue.
            raise E.ReplicaBusy(f"replica {self.replica} is at its limit of requests")

    def _screen(self, msg: Msg, reply: str | None, env: dict[str, Any]) -> _Generation:
        """Decode the request if this replica can take it; raise the typed refusal if not."""
        self._refuse_early(msg)
        # A frame that breaks the wire contract is refused here, in the ack, not by an
        # exception in the engine or in the output filter later.
        check_envelope(env)
        policy = None
        try:
            req = GenerationRequest.from_envelope(env)
            if env.get("filter_policy") is not None:
                policy = FilterPolicy.from_dict(env["filter_policy"])
        except (KeyError, TypeError, ValueError) as exc:
            raise E.InvalidRequest(f"malformed envelope: {exc}") from exc
        task = asyncio.current_task()
        assert task is not None
        if not reply:
            raise E.InvalidRequest("the request carries no reply subject")
        if self._early_cancels.pop(reply, None) is not None:
            raise E.Cancelled("the caller cancelled this request")
        if req.model in self._unloading or req.model in self._unloaded:
            # The router's view is older than the unload: another replica may hold it.
            raise E.ReplicaDraining(
                f"replica {self.replica} is unloading the adapter {req.model!r}", param="model"
            )
        if req.kind not in self.endpoints:
            raise E.InvalidRequest(
                f"replica {self.replica} of {self.model!r} does not serve {req.kind} "
                f"(it serves {', '.join(self.endpoints)})",
                param="model",
            )
        gen = _Generation(reply, msg.headers or {}, env, req, task)
        gen.predicted = kvloop.predicted(gen.headers)
        if env.get("filter_policy"):  # an empty policy filters nothing, as none does
            gen.policy = policy
        return gen

    async def _enter_engine(self, msg: Msg, gen: _Generation) -> DeltaStream | bool:
        """Start generating when the flow control gives the request a slot now, and take
        its place; True when it must wait for a slot (:meth:`_generate` waits), False once a
        refusal or a failure to start went back in the ack."""
        if self.flow is not None:
            try:
                gen.ticket = self._ticket(gen)
            except E.TokenbusError as exc:
                await self._ack(msg, exc)
                if tracing.on():
                    _trace_refused(exc)
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
            await self._ack(msg, exc)
            return False
        self._track(gen)
        return stream

    def _engine_stream(self, gen: _Generation) -> DeltaStream:
        """The engine's stream of the request, started now; a failure to start is raised as
        a typed error."""
        gen.t_start = marks.now_ns()
        gen.waiting_at_start = int(self.backend.stats().get("waiting", 0))
        try:
            return self.backend.generate(gen.req)
        except E.TokenbusError:
            raise
        except Exception as exc:
            self.log.exception("generate_failed", request_id=gen.rid)
            raise E.EngineError(f"the engine failed: {type(exc).__name__}") from exc

    def _ticket(self, gen: _Generation) -> Ticket:
        """The request's place in the flow control, from what auth and the client said."""
        assert self.flow is not None
        hdrs = gen.headers
        left = _seconds_left(hdrs)
        ttft = marks.number(hdrs.get(H.TTFT_OBJECTIVE))
        t = self.flow.enter(
            flow=hdrs.get(H.FLOW) or hdrs.get(H.PRINCIPAL) or "",
            sub=hdrs.get(H.FAIRNESS, "")[:128],
            cls=_class(hdrs),
            weight=_weight(hdrs.get(H.FLOW_WEIGHT)),
            prompt_tokens=_prompt_estimate(gen.env),
            deadline=None if left is None else time.monotonic() + left,
            ttft_objective_s=ttft / 1000.0 if ttft else None,
            max_tokens=gen.req.remaining_tokens,
        )
        task = gen.task

        def displace() -> None:
            if not task.done():
                task.cancel()

        t.on_displace = displace
        return t

    def _leave_flow(self, gen: _Generation) -> None:
        """Give the request's place in the flow control back (its slot to the next)."""
        if gen.ticket is not None and self.flow is not None:
            self.flow.leave(gen.ticket, gen.completion)
            gen.ticket = None

    def _track(self, gen: _Generation) -> None:
        if not self._active:
            self._busy.set()  # the heartbeat loop may be in an idle (long) sleep
            self._progress_at = time.monotonic()  # idle was no sign of a stuck engine
        self._active[gen.reply] = gen.task
        if gen.req.model != self.model and gen.req.model in self._adapters():
            self._on_adapter[gen.reply] = gen.req.model

    def _interval(self) -> float:
        """Seconds to the next heartbeat: the full rate while any request is in flight (its
        caller watches the beats) or while draining, slower when idle."""
        fast = float(self.cfg.heartbeat_interval_s)
        if self._active or self.draining:
            return fast
        return fast * float(self.cfg.idle_heartbeat_factor)

    async def _accept(self, msg: Msg, gen: _Generation) -> None:
        """Ack the router's dispatch and tell the caller which replica serves it."""
        await self._ack(msg, None)
        info = gen.headers.get(H.RATELIMIT_INFO)
        if gen.headers.get(H.KEEPALIVE):
            self._keepalive[gen.reply] = None
        self.outbox.send(
            gen.reply,
            frames.accept(
                self.replica,
                gen.rid,
                self.cfg.heartbeat_interval_s,
                info,
                gen.headers.get(H.ADMISSION),
                tracing.traceparent(gen.span) if gen.span is not None else None,
                gen.ticket.cls if gen.ticket is not None else _class(gen.headers),
                not _can_resume(self.backend, gen.req),
            ),
        )

    async def _generate(self, msg: Msg, gen: _Generation, stream: DeltaStream | None) -> None:
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
        while True:
            if stream is None:
                assert t is not None and self.flow is not None
                await self.flow.wait(t)
                if tracing.on() and t.arrived:
                    tracing.event(gen.span, tracing.QUEUE_EVENT, _queue_attrs(t))
                stream = self._engine_stream(gen)
            try:
                await self._relay(gen, stream)
                return
            except asyncio.CancelledError:
                if t is None or not t.displaced or gen.reply in self._caller_cancelled:
                    raise
                gen.task.uncancel()
            tracing.event(gen.span, tracing.DISPLACED_EVENT, {"tokenbus.service_tier": t.cls})
            stream = None
            assert self.flow is not None
            self.flow.requeue(t)

    async def _embed(self, msg: Msg, gen: _Generation) -> None:
        """Accept an embeddings request, embed its inputs, send one chunk frame per vector
        (``em``: index and embedding), then the final frame."""
        await self._accept(msg, gen)
        async with asyncio.timeout(_seconds_left(gen.headers)):
            result = await self.backend.embed(gen.req)
        gen.first_ns = marks.now_ns()
        send, reply = self.outbox.send, gen.reply
        for i, vec in enumerate(result.vectors):
            send(reply, frames.chunk("", 0, i, {"em": {"index": i, "embedding": vec}}))
        self._final_frame(gen, Delta("", 0, "stop", result.prompt_tokens, 0), "stop", None)

    async def _relay(self, gen: _Generation, stream: DeltaStream) -> None:
        """Send the engine's deltas as chunk frames until it finishes, then the final frame.

        Output beside the text (tool calls, logprobs, refusal, reasoning) rides in the same
        chunk frames; under an output filter it is held and scanned whole at the end. A
        stream that can ``push`` (the ``openai`` backend) calls ``feed`` where its bytes
        arrive; any other is iterated.

        A caller that takes the answer whole (``Tb-Whole``: not streamed to anyone) gets its
        text in one chunk with the end, not a chunk per step: a batch line of 32 tokens is 2
        messages instead of 33, for this process, the bus and the caller."""
        timeout = _seconds_left(gen.headers)
        gate = OutputGate.for_policy(gen.policy, self.settings.filter.window, gen.req.resume_text)
        # Queued for the turn's flush, as the final frame is: an answer's last chunk and its
        # end produced in one turn leave as one message, so no caller holds a whole answer
        # without its end (a replica lost between two messages would be resumed past it).
        send = self.outbox.send
        reply = gen.reply
        # Chunk numbering and tokens not yet sent matter only to this stream: locals.
        index = 0
        held_tokens = 0
        finished = False
        whole = gen.headers.get(H.WHOLE) == "1"
        held: list[str] = []  # text held for a whole answer

        ticket = gen.ticket

        def flush(tokens: int) -> None:
            """The held text as one chunk, with ``tokens`` of the tokens not yet sent."""
            nonlocal index, held_tokens
            send(reply, frames.chunk("".join(held), tokens, index))
            index += 1
            held_tokens -= tokens
            held.clear()

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
                self._progress_at = time.monotonic()
                held_tokens += d.tokens
                if text or side:
                    if not gen.first_ns:
                        gen.first_ns = marks.now_ns()
                        if ticket is not None:
                            ticket.first_byte = True  # no longer displaced
                        if gen.span is not None:
                            gen.span.add_event(tracing.FIRST_TOKEN)
                    if whole and side is None and finish is None:
                        held.append(text)
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
                self._log_flags(gen, gate)
            return True

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

    def _final_frame(
        self, gen: _Generation, last: Delta, finish: str, gate: OutputGate | None
    ) -> None:
        """Send the final frame (finish reason, token counts, timings); the outcome is set."""
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
                self.kv_loop.observe(gen.predicted[0], gen.cached)
        self._learn(gen, timings["engine_end"])
        if finish == "content_filter":
            self.log.info(
                "output_blocked",
                request_id=gen.rid,
                detector=gate.scan.blocked_by if gate else None,
            )
        self.outbox.send(
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
        self._report_ahead(gen)

    def _learn(self, gen: _Generation, end_ns: int) -> None:
        """Teach the latency models (engine_worker/perf.py) what this request took."""
        if not gen.first_ns or gen.prompt_tokens < 0 or gen.req.kind == subjects.KIND_EMBEDDINGS:
            return
        tpot = None
        if gen.completion > 1:
            tpot = (end_ns - gen.first_ns) / 1e6 / (gen.completion - 1)
        self.perf.observe(
            ttft_ms=(gen.first_ns - gen.t_start) / 1e6,
            computed_tokens=max(0, gen.prompt_tokens - gen.cached),
            waiting=gen.waiting_at_start,
            tpot_ms=tpot,
            running=int(self.backend.stats().get("running", 1)) - 1,
        )

    def _log_flags(self, gen: _Generation, gate: OutputGate) -> None:
        """Log the detectors the policy flags that the whole output triggered, if any."""
        flags = gate.flags()
        if flags:
            self.log.info("output_flagged", request_id=gen.rid, detectors=flags)

    async def _finish(self, gen: _Generation) -> None:
        """Free the request's slot, report its usage, write its log line and telemetry record."""
        self._leave_flow(gen)
        gen.duplicate = self._caller_cancelled.get(gen.reply, False)
        await self._free_slot(gen.reply)
        hdrs = gen.headers
        if H.RATELIMIT in hdrs and not gen.reported:
            await self._report_usage(hdrs, gen)
        end = marks.now_ns()
        trace = marks.trace_id(hdrs)
        self.log.info(
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
            self._trace_end(gen)
        if self.settings.telemetry.enabled and not gen.reported:
            self._records.add(self._telemetry_record(gen, end, trace))

    def _report_ahead(self, gen: _Generation) -> None:
        """Queue the ended request's usage report and telemetry record to leave ahead of its
        final frame (engine_worker/outbox.py): once its caller has the answer, the limiters'
        spend stream and the records' stream have been sent what it used, even if this
        process is killed the next moment."""
        gen.reported = True
        hdrs = gen.headers
        if H.RATELIMIT in hdrs:
            out = self._report_of(gen)
            if out is not None and subjects.is_usage_spend(out[0]):
                # Kept by the spend stream: tried until it acknowledges (a report it never
                # took leaves the request uncharged once the admitting limiter is gone).
                self._records.send_first(*out)
            elif out is not None:  # to the admitting limiter alone (tokens, slots)
                self.outbox.send_first(*out)
        if self.settings.telemetry.enabled:
            end = marks.now_ns()
            self._records.add(self._telemetry_record(gen, end, marks.trace_id(hdrs)))

    async def _records_first(self) -> None:
        """The outbox's hook: records of requests that ended leave before their frames."""
        if self._records.waiting:
            await self._records.send_now()

    # -- tracing ----------------------------------------------------------------------------
    def _trace_begin(self, gen: _Generation) -> None:
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
                tracing.REPLICA: self.replica,
                tracing.BACKEND: self.backend.name,
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

    def _trace_end(self, gen: _Generation) -> None:
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

    async def _free_slot(self, reply: str) -> None:
        """Forget the request as active; heartbeat at once if that made room."""
        self._active.pop(reply, None)
        self._keepalive.pop(reply, None)
        if self._on_adapter.pop(reply, None) is not None:
            self._adapter_left.set()
        self._caller_cancelled.pop(reply, None)
        if len(self._active) == self.cfg.max_concurrency - 1:
            # It was full: say at once that there is room (routers hold requests for it).
            await self.heartbeat()

    def _telemetry_record(self, gen: _Generation, end: int, trace: str | None) -> dict[str, Any]:
        """The worker's telemetry record of the request."""
        hdrs = gen.headers
        timings = {**marks.parse(hdrs), "engine_start": gen.t_start, "engine_end": end}
        if gen.first_ns:
            timings["first_token"] = gen.first_ns
        return records.build(
            request_id=gen.rid,
            source="worker",
            model=self.model,
            timings=timings,
            outcome=gen.outcome,
            replica=self.replica,
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

    def _report_of(self, gen: _Generation) -> tuple[str, bytes] | None:
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
            duplicate=self.replica if gen.duplicate else None,
        )

    async def _report_usage(self, hdrs: dict[str, str], gen: _Generation) -> None:
        """Tell the rate limiters what the request really used (fire and forget)."""
        out = self._report_of(gen)
        if out is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(*out)

    def interrupted_error(self) -> E.TokenbusError:
        return E.ReplicaLost(f"replica {self.replica} stopped before finishing; retry")

    def _own_reply(self, msg: Msg) -> str | None:
        """The reply subject of a request from the bus's roles (a snapshot, an adapter
        call), where it is the sender's own inbox (services.replies)."""
        return reply_subject(msg, trust_header=False, service="worker", log=self.log)

    async def _ack(self, msg: Msg, err: E.TokenbusError | None) -> None:
        early = self._acked_early.pop(id(msg), None)
        if early is not None:  # acknowledged already (a claim-checked body's fetch)
            if err is not None:
                self.outbox.send(early, frames.error(err))
            return
        if not self._own_reply(msg):
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
