"""The engine worker actor: one replica of one model on the bus.

It listens on its replica-specific generate subject (no queue group: the router chooses),
acknowledges the router's dispatch, streams frames straight to the caller's inbox, aborts
on cancel, and announces its load in heartbeats. When its engine keeps a prefix cache that
reports itself (the sim with ``kv_cache_blocks``), it publishes the cache's KV events in
batches and answers snapshot requests (:mod:`bus_schemas.kv_events`). On SIGTERM it stops
taking work, tells the routers it is draining, and finishes what it has.

:class:`Worker` does little itself: it wires its collaborators, each a module with one job
(as vLLM's ``AsyncLLM`` wires its input and output processors and its engine client):

- :class:`~engine_worker.intake.Intake`: a dispatch acked or refused, the callers' cancels;
- :class:`~engine_worker.runner.RequestRunner`: a request served, from the engine's start
  to its final frame, through the output gate (:mod:`filter.output_gate`);
- :class:`~engine_worker.accounting.Accounting`: usage reports, records, the log line;
- :class:`~engine_worker.heartbeat.Heartbeats` and
  :class:`~engine_worker.health.EngineHealth`: the beats, and the engine's health;
- :class:`~engine_worker.kv_publisher.KVPublisher`: the prefix cache's KV events;
- :class:`~engine_worker.lora.Adapters`: LoRA adapters loaded and unloaded at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from bus_schemas import errors as E
from bus_schemas import frames, marks, subjects
from engine_worker import backends, kvloop, perf
from engine_worker.accounting import Accounting
from engine_worker.backends.base import Backend, kv_event_source
from engine_worker.backlog import PrefillBacklog
from engine_worker.claim import ReplicaClaim, ReplicaTaken
from engine_worker.health import EngineHealth
from engine_worker.heartbeat import Heartbeats
from engine_worker.intake import Intake
from engine_worker.kv_publisher import KVPublisher
from engine_worker.lora import Adapters
from engine_worker.outbox import Outbox
from engine_worker.runner import RequestRunner
from engine_worker.tickets import flow_control
from services.runtime import Service, StartRefused, connect, flush, reply_subject


class Worker(Service):
    """One replica: generate requests, cancel, heartbeats."""

    name = "worker"
    forwards = False  # answers and reports; never hands a request on
    check_deadline = False  # checked in Intake's screen so the router hears it in the ack
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
        # The requests in flight: the caller's reply subject -> the request's task.
        self._active: dict[str, asyncio.Task[Any]] = {}
        self.boot = uuid.uuid4().hex[:12]
        self.log = self.log.bind(replica=self.replica, model=self.model)
        self.discovery.metadata.update(replica=self.replica, model=self.model)
        self.flow = flow_control(cfg)
        self.kv_loop = kvloop.KVLoop()
        self.perf = perf.EnginePerf()  # its engine's speed, learned from its requests
        self.backlog = PrefillBacklog()  # prompt tokens still to compute (backlog.py)
        # The engine's prefix cache's events, when it reports one (set up in setup()).
        self.kv_events: KVPublisher | None = None
        self.health = EngineHealth(self)
        self.heartbeats = Heartbeats(self)
        self.adapters = Adapters(self)
        self.intake = Intake(self)
        self.accounting = Accounting(self)
        self.runner = RequestRunner(self)

    @property
    def engine_failure(self) -> str | None:
        """Why the engine cannot serve (it died, or stopped making output), or None."""
        return self.health.failure

    async def setup(self) -> None:
        self.outbox = Outbox(self.nc)
        await self.accounting.open()
        self.outbox.before = self.accounting.records_first
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
        replica = self.add_group(queue_group=f"replica.{self.replica}")
        await replica.add(
            "generate",
            self.runner.handle,
            subject=subjects.engine_generate(self.model, self.replica),
        )
        self._cancel_sub = await self.nc.subscribe(
            subjects.worker_cancel(self.replica), cb=self.intake.on_cancel
        )
        self._adapters_sub = await self.nc.subscribe(
            subjects.worker_adapters(self.model, self.replica), cb=self.adapters.on_command
        )
        await self.heartbeat()
        self._hb_task = asyncio.get_running_loop().create_task(self.heartbeats.run())
        kv = kv_event_source(self.backend)
        if kv is not None:
            self.kv_events = KVPublisher(
                self.nc,
                kv,
                model=self.model,
                replica=self.replica,
                boot=self.boot,
                interval_s=float(self.cfg.kv_events_interval_s),
                own_reply=self.own_reply,
            )
            await self.kv_events.start()

    # -- heartbeats: what a beat says, each collaborator's part -------------------------------
    def heartbeat_body(self) -> dict[str, Any]:
        """The heartbeat (bus_schemas.messages.Heartbeat) this replica sends now."""
        hb = self.heartbeats
        hb.seq += 1
        st = self.backend.stats()
        adapters = self.adapters.loaded()
        kv = self.kv_events
        failure = self.health.failure
        return {
            "type": "heartbeat",
            "replica": self.replica,
            "model": self.model,
            "backend": self.backend.name,
            "in_flight": len(self._active),
            "running": int(st.get("running", 0)),
            "waiting": int(st.get("waiting", 0)),
            # Prompt tokens its engine has still to compute (engine_worker/backlog.py).
            "prefill_backlog": self.backlog.tokens,
            "kv_usage": float(st.get("kv_usage", 0.0)),
            # How its prefix cache is reported (docs/kv-events.md): events hashed as the sim
            # ("text") or as vLLM ("vllm"); absent: no events (kv_aware keeps approximate
            # affinity for it).
            **({"kv_events": kv.hashing_kind()} if kv is not None else {}),
            # What makes its block hashes comparable (a router that computes them otherwise
            # refuses its events), and the closed loop's totals: the routers' predicted
            # cached tokens beside the engine's reports (engine_worker/kvloop.py).
            **(
                {
                    "kv_hashing": kvloop.hashing(
                        kv.source, self.model, getattr(self.backend, "revision", None)
                    ),
                    "kv_check": self.kv_loop.heartbeat(),
                }
                if kv is not None
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
            # The host it runs on (engine_worker/heartbeat.py's host_of), for operators.
            "host": hb.host,
            **({"pd_role": self.cfg.pd_role} if self.cfg.pd_role != "both" else {}),
            "draining": self.draining,
            # The engine's health: "failed" (with the reason) takes it out of routing.
            "health": "failed" if failure else "ok",
            **({"health_reason": failure} if failure else {}),
            "endpoints": self.endpoints,
            "aliases": [
                m
                for m in getattr(self.backend, "served_models", ())
                if m != self.model and m not in self.adapters.unloading
            ],
            **({"adapters": adapters} if adapters else {}),
            "interval_s": hb.interval(),
            # The model's context length (0: not known here).
            "max_model_len": int(
                self.cfg.max_model_len or getattr(self.backend, "max_model_len", 0) or 0
            ),
            "seq": hb.seq,
            "boot": self.boot,
            # Bumped when the connection came back: frames sent just before may be lost, so
            # callers move their streams on (see the client's watchdog).
            "epoch": self.reconnects,
            "ts_ms": marks.now_ms(),
        }

    async def heartbeat(self) -> None:
        """Beat now (a change the routers must hear at once)."""
        await self.heartbeats.beat()

    def unhealthy(self) -> str | None:
        if self.health.failure is not None:
            return f"the engine {self.health.failure}"
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
        await self.accounting.records.flush()
        self._hb_task.cancel()
        await self.heartbeat()
        await self._claim.release()
        with contextlib.suppress(Exception):
            await self._cancel_sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._adapters_sub.unsubscribe()
        await self.backend.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()

    def interrupted_error(self) -> E.TokenbusError:
        return E.ReplicaLost(f"replica {self.replica} stopped before finishing; retry")

    def own_reply(self, msg: Msg) -> str | None:
        """The reply subject of a request from the bus's roles (a snapshot, an adapter
        call, the router's dispatch to ack), where it is the sender's own inbox
        (services.replies)."""
        return reply_subject(msg, trust_header=False, service="worker", log=self.log)
