"""The HTTP bridge: OpenAI-compatible HTTP + SSE in front of the bus.

Each bridge process holds one NATS connection with one inbox subscription for all of its
requests, a replica registry from heartbeats (for ``/v1/models`` and ``/ready``), and an
HTTP server (uvicorn). Several processes share the port with SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas import marks, subjects
from bus_schemas.messages import EmbeddingRequest, envelope_chars
from gateway import validation
from gateway.admin_adapters import PREFIX as ADAPTERS_PREFIX
from gateway.admin_adapters import AdaptersAdmin
from gateway.admin_keys import PREFIX as ADMIN_PREFIX
from gateway.admin_keys import AdminAPI
from gateway.admin_routing import PREFIX as ROUTING_PREFIX
from gateway.admin_routing import RoutingAdmin
from gateway.anthropic_api import MessagesAPI
from gateway.asgi import HTTPLimits, HTTPServer, Receive, Scope, Send, serve
from gateway.batches_api import BatchAPI
from gateway.console import Console
from gateway.files_api import FilesAPI
from gateway.ingress import Admission
from gateway.openai_api import OpenAIApp
from gateway.responses_api import ResponsesAPI, key_owner
from gateway.stages import LocalStages, stages_before_route
from gateway.start_gate import StartGate
from jobs.background import Background
from jobs.batch_runner import BatchRunner
from jobs.batches import BatchStore
from jobs.files import FileStore
from jobs.response_store import open_store
from router.adapters import AdapterTable, watch_adapters
from router.dispatch import Dispatcher
from router.kv_follow import KVFollower, register_metrics
from router.registry import Registry
from router.routing import RoutingTable
from router.service import HeartbeatTracker, watch_routing
from services import bodies, tracing, usage
from services.aliases import AliasTable, check_key_aliases, envelope_for, watch_aliases
from services.caller import Caller, Stream
from services.runtime import Service
from telemetry import records

# How long a stopping bridge lets its running batch lines finish.
RUNNER_GRACE_S = 3.0
# The longest wait between two tries to open the file, batch and background stores where
# JetStream did not answer at start.
MOUNT_RETRY_MAX_S = 5.0
REQUESTS = Counter("tokenbus_bridge_requests_total", "HTTP generation requests", ["kind", "status"])
DURATION = Histogram(
    "tokenbus_bridge_request_seconds",
    "HTTP generation request duration",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)


class BusSource:
    """Streams from the bus through the NATS-native client."""

    def __init__(
        self,
        client: Caller,
        registry: Registry,
        admission: Admission,
        dispatcher: Dispatcher | None,
        stages: LocalStages | None = None,
        keys: KeyStore | None = None,
        aliases: AliasTable | None = None,
        waiting_room: bool = False,
        pull_bodies: bool = True,
    ) -> None:
        self.client = client
        # Large bodies held here for the replica chosen (bridge.pull_bodies), when routed here.
        self.pull_bodies = pull_bodies and dispatcher is not None
        # Requests wait for a replica to start (router.waiting_room_s): ready without one.
        self.waiting_room = waiting_room
        self.draining = False  # the bridge is stopping: /ready says 503 from then on
        self.aliases = aliases or AliasTable()  # the global model aliases, for /v1/models
        self.keys = keys  # where the pipeline checks keys: who may list the models
        self.registry = registry
        self.admission = admission
        self.dispatcher = dispatcher
        self.stages = stages

    def open(
        self,
        kind: str,
        req: validation.Request,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout: float,
        headers: dict[str, str],
        principal: str | None = None,
    ) -> Stream:
        # The bridge is the ingress of HTTP clients: it admits the request itself and sends
        # the envelope to the first stage, one hop fewer than a NATS client's request.
        t1 = marks.now_ns()
        if not isinstance(req, EmbeddingRequest):
            # Refused here, before any stage, when no replica's context could hold it.
            asked = req.max_completion_tokens or req.max_tokens
            served = self.aliases.resolve(req.model)
            longest = self.registry.longest_context(served) if asked else 0
            if asked and longest and asked >= longest:
                raise E.ContextLengthExceeded.of(longest, asked)
        hdrs = {
            **headers,
            H.DEADLINE: str(marks.now_ms() + int(timeout * 1000)),
            H.GATEWAY_COUNTED: "1",  # its streams' resume counts are this process's own
        }
        hdrs.pop(H.REQUEST_ID, None)  # the request's id is this bridge's own, made per request
        env = self.admission.admit(kind, req, body, hdrs, t1, request_id=request_id)
        meta: dict[str, str | None] = {}  # what the stages learn (the key id), for the log
        sender = None
        stages, dispatcher = self.stages, self.dispatcher
        if (
            principal is not None
            and self.keys is not None
            and (stages is None or stages.keys is None)
        ):
            # Work run for a key by id (a batch line) passes auth in this process only.
            raise E.ServiceUnavailable(
                "work run on a key's behalf needs the bridge to run auth itself "
                "(bridge.fuse_stages with auth in ingress.pipeline)"
            )
        if stages is not None or dispatcher is not None:
            model = req.model
            nc = self.client.nc
            route = subjects.stage(subjects.STAGE_ROUTE)

            async def sender(data: bytes, h: dict[str, str], reply: str) -> str | None:
                try:
                    served = model
                    if stages is not None:
                        changed = await stages.run(h, env, principal)
                        served = h.get(H.MODEL) or model  # auth resolves an alias
                        if served != model:  # the caller's envelope stays as sent
                            data = envelope_for(data, env, served)
                        elif changed:
                            data = bodies.encode(env)
                    meta["principal"] = h.get(H.PRINCIPAL)
                    if dispatcher is not None:
                        span = _route_span(h) if tracing.on() else None
                        with tracing.scope(span):
                            return await dispatcher.dispatch(served, data, h, reply, env)
                except E.TokenbusError:
                    if H.RATELIMIT in h:  # admitted, then refused before any engine ran it
                        await usage.report(nc, h, request_id)
                    raise
                to = self.client.members.subject_for(route)
                await nc.publish(to, data, reply=reply, headers=h)
                return None

        stream = self.client.submit(
            kind,
            env,
            timeout=timeout,
            request_id=request_id,
            headers=hdrs,
            subject=self.admission.first,
            sender=sender,
        )
        stream.meta = meta
        # Routed here: a large body goes to the replica chosen when it asks, not into the
        # store first (services/bodies.py, claim by pull).
        stream.pull_bodies = self.pull_bodies
        if not isinstance(req, EmbeddingRequest):
            stream.before_claim = lambda env: self._fits(req.model, env)
        return stream

    def _fits(self, model: str, env: dict[str, Any]) -> None:
        """Refuse, before its upload, a large prompt that surely exceeds every replica's
        context: estimated at 4 characters a token and refused only past twice the context,
        so a tokenizer that packs more characters into a token is not refused here (the
        engine still judges the exact count)."""
        longest = self.registry.longest_context(self.aliases.resolve(model))
        about = (envelope_chars(env) + 3) // 4
        if longest and about > 2 * longest:
            raise E.ContextLengthExceeded(
                f"This model's maximum context length is {longest} tokens. However, your "
                f"messages are about {about} tokens (estimated, before the request was sent "
                "on). Please reduce the length of the messages.",
                param="messages",
            )

    def models(self) -> list[str]:
        return self.registry.models()

    def models_for(self, api_key: str | None) -> list[str]:
        return list(self.listing(api_key))

    def listing(self, api_key: str | None) -> dict[str, str | None]:
        """What ``GET /v1/models`` lists for ``api_key``: each model served now, None, and
        each alias of one, the model it names (the key's own aliases over the global ones);
        only what the key may use."""
        models = self.registry.models()
        own: dict[str, str] = {}
        allowed: list[str] = []
        if self.keys is not None:
            rec = self.keys.lookup(api_key)  # 401 without a valid key, as on every endpoint
            own, allowed = rec.aliases, rec.models
        out: dict[str, str | None] = dict.fromkeys(models)
        served = set(models)
        for name, target in {**self.aliases.all(), **own}.items():
            if target in served and name not in served:
                out[name] = target
        return {m: t for m, t in out.items() if not allowed or m in allowed or (t and t in allowed)}

    def context_length(self, model: str) -> int:
        return self.registry.context_length(model)

    def adapter_of(self, name: str) -> tuple[str, str] | None:
        """(base model, path) of a LoRA adapter loaded at run time (``/v1/models``)."""
        return self.registry.adapter(name)

    def healthy(self) -> bool:
        return bool(self.client.nc.is_connected)

    def ready(self) -> bool:
        """Connected, and some replica serves (or, with a waiting room, requests wait for
        one to start: a bridge of a model scaled to zero takes them)."""
        if self.draining:
            return False
        return self.healthy() and (self.waiting_room or bool(self.registry.models()))


def _route_span(hdrs: dict[str, str]) -> Any:
    """The fused router's span (a child of the bridge's), made the parent of the replica's."""
    span = tracing.start(
        subjects.STAGE_ROUTE,
        hdrs,
        kind=tracing.PRODUCER,
        attributes={
            tracing.STAGE: subjects.STAGE_ROUTE,
            "tokenbus.fused": True,
            tracing.MESSAGING_SYSTEM: "nats",
            tracing.REQUEST_ID: hdrs.get(H.REQUEST_ID),
            tracing.MODEL: hdrs.get(H.MODEL),
            tracing.KEY_ID: hdrs.get(H.PRINCIPAL),
        },
    )
    tracing.inject(span, hdrs)
    return span


async def _open_bodies(nc: Any, log: Any) -> None:
    """The store of large request bodies (services/bodies.py); without JetStream, large
    requests get 503 and the rest are served (logged)."""
    try:
        await bodies.open_stream(nc)
    except Exception as exc:
        log.warning("bodies_store_unavailable", error=repr(exc))


class Bridge(Service):
    """OpenAI-compatible HTTP bridge."""

    name = "bridge"

    def __init__(self, settings: Any, *, reuse_port: bool = False, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.reuse_port = reuse_port
        self.http: HTTPServer | None = None
        self.gate = StartGate(settings.bridge.start_wait_s, settings.bridge.request_timeout_s)
        self._own_keys: KeyStore | None = None  # /v1/models' key store when auth is not fused
        self.batch_runner: BatchRunner | None = None
        self._mounting: asyncio.Task[None] | None = None  # files and batches, tried again
        self.source: BusSource | None = None

    def _log_migration(self, s: Any, err: E.TokenbusError, failed: bool) -> None:
        if failed:
            self.log.warning(
                "request_migration_failed",
                request_id=s.request_id,
                error=err.code,
                message=err.message[:300],
            )
        else:
            self.log.info(
                "request_migrated", request_id=s.request_id, migration=s.migrations, reason=err.code
            )

    def on_reconnected(self) -> None:
        super().on_reconnected()
        # Frames to this bridge may have been lost in the break: move its streams on.
        client = getattr(self, "client", None)
        if client is not None:
            client.connection_broke()

    async def setup(self) -> None:
        cfg = self.settings.bridge
        await self._listen()  # given a connection, it did not listen in _connect
        self._records = await records.Recorder(
            self.nc, records.spool_for(self.settings.telemetry, "bridge", f"bridge-{self.id}")
        ).open()
        self.client = Caller(self.nc, owner=f"bridge-{self.id}")
        await _open_bodies(self.nc, self.log)
        self.client.on_migration = self._log_migration
        await self.client.start()
        self.registry = Registry(self.settings.router.missed_heartbeats)
        self.registry.bus = self.nc
        register_metrics()  # the KV index's (router/kv_follow.py)
        self._tracker = HeartbeatTracker(self.registry, self.log)
        await self._tracker.start(self.nc)
        admission = Admission(self.settings)
        self.aliases = await watch_aliases(self.nc, self.settings.router.aliases, self.log)
        before = stages_before_route(list(self.settings.ingress.pipeline))
        self.stages: LocalStages | None = None
        if before and cfg.fuse_stages and LocalStages.can_run(before):
            self.stages = await LocalStages(before, self.log).open(
                self.nc, self.settings, owner=f"bridge-{self.id}", aliases=self.aliases
            )
        dispatcher = None
        self.routing: RoutingTable | None = None
        self.kv: KVFollower | None = None
        self.adapters: AdapterTable | None = None
        # Routing in-process saves a hop (and a process's CPU) per request. It needs the
        # stages before routing in-process too, so no request reaches a worker unadmitted.
        if cfg.fuse_router and (not before or self.stages is not None):
            self.kv = KVFollower.of(self.registry, self.log, self.settings)
            self.routing = await watch_routing(self.nc, self.settings.router, self.log, self.kv)
            self.adapters = await watch_adapters(self.nc, self.log)
            dispatcher = Dispatcher(
                self.nc,
                self.registry,
                self.settings.router,
                self.routing,
                self.aliases,
                self.adapters,
                site=self.settings.site,
            )
        keys = await self._keys()
        self.source = BusSource(
            self.client,
            self.registry,
            admission,
            dispatcher,
            self.stages,
            keys,
            self.aliases,
            waiting_room=self.settings.router.waiting_room_s > 0,
            pull_bodies=cfg.pull_bodies,
        )
        api = OpenAIApp(
            self.source,
            max_body_bytes=cfg.max_body_bytes,
            request_timeout_s=cfg.request_timeout_s,
            on_request=self._observe,
            body_timeout_s=cfg.body_timeout_s,
        )
        api.add_route("GET", "/metrics", self.metrics)
        self.admin = AdminAPI(
            self.nc,
            store=self.stages.keys if self.stages else None,
            check_aliases=lambda own: check_key_aliases(
                own, self.aliases.all(), self.registry.models()
            ),
        )
        api.add_prefix(ADMIN_PREFIX, self.admin)
        adapters = AdaptersAdmin(self.nc, self.admin, self.registry)
        api.add_prefix(ADAPTERS_PREFIX, adapters)
        routing = RoutingAdmin(
            self.nc, self.settings.router, self.admin, self.registry, self.aliases
        )
        api.add_prefix(ROUTING_PREFIX, routing)
        # The operator's console (docs/console.md), over the same admin handlers.
        kv = self.kv.check if self.kv is not None else None
        self.console = Console(
            self.admin, routing, self.registry, self.settings, kv, adapters=adapters
        )
        self.console.mount(api)
        # The Responses API, over the same source; its stored responses in JetStream KV.
        store = await open_store(self.nc, self.settings.responses)
        responses = ResponsesAPI(api, store, key_owner(keys))
        responses.mount()
        # Anthropic's Messages API, a translation onto the same chat path.
        MessagesAPI(api).mount()
        await self._mount_batches(api, keys, responses)
        self.gate.open(api)
        self.log.info("bridge_serving")

    async def start(self) -> None:
        try:
            await super().start()
        except BaseException:
            # It listened before it could serve: a start that failed does not leave the
            # port taken (an in-process bridge; a process exits anyway).
            if self.http is not None:
                await self.http.stop()
                self.http = None
            raise

    async def _connect(self) -> Any:
        """Listen first (:mod:`gateway.start_gate`: requests wait while the bridge reaches
        the bus and opens its stores), then connect."""
        await self._listen()
        return await super()._connect()

    async def _listen(self) -> None:
        """Start the HTTP server with the start gate as its app (once)."""
        if self.http is not None:
            return
        cfg = self.settings.bridge
        self.http = await serve(
            self.gate,
            cfg.host,
            cfg.port,
            reuse_port=self.reuse_port,
            shutdown_timeout=self.settings.drain_timeout_s,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            limits=HTTPLimits(
                max_header_bytes=cfg.max_header_bytes,
                header_timeout_s=cfg.header_timeout_s,
                max_connections_per_client=cfg.max_connections_per_client,
                max_connections=cfg.max_connections,
            ),
        )
        scheme = "https" if cfg.tls_cert else "http"
        self.log.info("bridge_listening", url=f"{scheme}://{cfg.host}:{cfg.port}/v1")

    def _observe(self, rec: dict[str, Any]) -> None:
        """Metrics, the bridge's canonical log line and the telemetry record of one HTTP
        request."""
        stream = rec.pop("stream", None)
        t1, t5, t6 = rec.pop("t1_ns"), rec.pop("t5_ns"), rec.pop("t6_ns")
        streamed = rec.pop("streamed", True)
        REQUESTS.labels(rec["kind"], str(rec["status"])).inc()
        DURATION.labels(rec["kind"]).observe(rec["duration_ms"] / 1000.0)
        record = None
        if isinstance(stream, Stream):
            usage = stream.usage
            principal = stream.meta.get("principal")
            record = records.build(
                request_id=stream.request_id,
                client_request_id=rec.get("client_request_id"),
                source="http",
                model=stream.model,
                timings=dict(stream.timings),
                outcome=rec["outcome"],
                replica=stream.replica,
                principal=principal,
                kind=rec["kind"],
                status=rec["status"],
                prompt_tokens=usage.prompt_tokens if usage else 0,
                # A stream cut off before its end: the tokens that reached the client (none
                # of a whole answer that failed).
                completion_tokens=usage.completion_tokens
                if usage
                else (stream.delivered_tokens if streamed else 0),
                migrations=stream.migrations,
                trace_id=stream.trace_id,
                streamed=streamed,
                t1=t1,
                t4=stream.t_first_ns or None,
                t5=t5,
                t6=t6,
            )
            rec.update(
                key_id=principal,
                model=stream.model,
                trace_id=stream.trace_id,
                replica=stream.replica,
                ttft_ms=record["ttft_ms"],
                gateway_ms=record["gateway_ms"],
                engine_ms=record["engine_ms"],
            )
        self.log.info("request", **{**rec, "duration_ms": round(rec["duration_ms"], 3)})
        if record is not None and self.settings.telemetry.enabled:
            self._records.add(record)

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _mount_batches(
        self, api: OpenAIApp, keys: KeyStore | None, responses: ResponsesAPI
    ) -> None:
        """The Files and Batch APIs and background responses (docs/batches.md), and this
        process's batch runner; none where JetStream is not available (logged)."""
        try:
            await self._open_batches(api, keys, responses)
        except Exception as exc:
            # Started while JetStream has no leader for these streams (a node restarting,
            # a host crashed): tried again until it answers, so this process does not go on
            # without files, batches and background responses for the rest of its life
            # (the nemesis' background response left in_progress, seed 202).
            self.log.warning(
                "files_not_served_here", reason="JetStream unavailable", error=repr(exc)
            )
            self._mounting = asyncio.get_running_loop().create_task(
                self._mount_batches_later(api, keys, responses)
            )

    async def _mount_batches_later(
        self, api: OpenAIApp, keys: KeyStore | None, responses: ResponsesAPI
    ) -> None:
        wait = 0.5
        while True:
            await asyncio.sleep(wait)
            wait = min(wait * 2, MOUNT_RETRY_MAX_S)
            try:
                await self._open_batches(api, keys, responses)
            except Exception:
                continue
            self.log.info("files_served_here")
            return

    async def _open_batches(
        self, api: OpenAIApp, keys: KeyStore | None, responses: ResponsesAPI
    ) -> None:
        cfg = self.settings
        handlers: dict[str, Callable[[Any], Awaitable[bool]]] = {}
        files = await FileStore(self.nc, cfg.files).open()
        store = await BatchStore(self.nc, cfg.batches, cfg.files.ttl_s).open()
        if cfg.batches.enabled and responses.store is not None:
            bg = Background(self.nc, store, responses.store, api, validation.check_chat)
            await bg.open(cfg.responses.ttl_s)
            responses.background = bg
            handlers["response"] = bg.run
        FilesAPI(files, key_owner(keys), cfg.files).mount(api)
        api.files.store = files  # files named by id in requests (gateway/file_inputs.py)
        api.key_owner = key_owner(keys)
        if not cfg.batches.enabled:
            return
        BatchAPI(store, files, key_owner(keys), cfg).mount(api)
        self.console.batches, self.console.files, self.console.responses = store, files, responses
        if cfg.batches.run_lines:
            self.batch_runner = BatchRunner(self.nc, store, files, api, cfg.batches, handlers)
            await self.batch_runner.start()

    async def stop_taking_work(self) -> None:
        if self._mounting is not None:
            self._mounting.cancel()
            self._mounting = None
        # /ready says 503 at once, while requests are still taken for ``unready_s``: a load
        # balancer's health checks take this bridge out before it stops listening. Then
        # stop listening, let open HTTP requests finish (up to the drain timeout), close.
        if self.source is not None:
            self.source.draining = True
            if self.settings.bridge.unready_s > 0:
                self.log.info("bridge_unready", listening_for_s=self.settings.bridge.unready_s)
                await asyncio.sleep(self.settings.bridge.unready_s)
        if self.batch_runner is not None:
            # Briefly: a line cut off is not acknowledged, so another runner answers it (once);
            # the drain time is the HTTP requests'.
            await self.batch_runner.stop(min(RUNNER_GRACE_S, self.settings.drain_timeout_s))
            self.batch_runner = None
        await super().stop_taking_work()
        if self.http is not None:
            await self.http.stop()
            self.http = None

    async def _keys(self) -> KeyStore | None:
        """The key store ``/v1/models`` checks keys against when the pipeline has auth: the
        fused auth stage's, or one of the bridge's own."""
        if subjects.STAGE_AUTH not in self.settings.ingress.pipeline:
            return None
        if self.stages is not None and self.stages.keys is not None:
            return self.stages.keys
        self._own_keys = await KeyStore(self.nc).open()
        return self._own_keys

    async def on_stop(self) -> None:
        await self._records.flush()
        await self._tracker.stop()
        if self._own_keys is not None:
            await self._own_keys.close()
        await self.admin.close()
        if self.stages is not None:
            await self.stages.close()
        if self.routing is not None:
            await self.routing.close()
        if self.kv is not None:
            await self.kv.stop()
        if self.adapters is not None:
            await self.adapters.close()
        await self.aliases.close()
        await self.client.close()
