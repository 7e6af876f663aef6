"""The ``vllm`` backend: vLLM's own ``vllm serve`` front end and engine in this process.

The worker builds what ``vllm serve`` builds, minus HTTP: vLLM's serve parser reads the
options (``worker.vllm.engine_args``: engine and front-end options alike), ``AsyncLLM`` is
created with the API server's usage context, and vLLM's ``init_app_state`` sets up its
OpenAI serving classes over it (chat with the configured tool and reasoning parsers,
completions, embeddings for pooling models, LoRA modules). Each request is turned into vLLM's
own protocol request model (the client's messages and fields as sent, plus the fields
tokenbus owns) and handed to ``create_chat_completion`` / ``create_completion`` / the
embedding handler; the streamed chunks come back as :class:`Delta` objects. Chat templates,
multimodal inputs, tool calls, structured output, logprobs, penalties, the model's
generation-config defaults and request validation are therefore exactly ``vllm serve``'s.
docs/vllm.md says why, and what it costs per request.

vLLM is imported only in :meth:`VLLMBackend.start`, after :func:`pin_gpus` has set
``CUDA_VISIBLE_DEVICES``, so importing this module never needs vLLM or torch. The names used
are listed in :data:`vllm_serving.VLLM_NAMES`; tests pass a fake with the same names.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from bus_schemas import errors as E
from engine_worker.backends import vllm_serving as vs
from engine_worker.backends.base import (
    Delta,
    DeltaStream,
    Embeddings,
    GenerationRequest,
    Started,
    asks_handover,
)
from engine_worker.backends.openai_shape import finish_reason
from services import tracing
from services.config import WorkerSettings

# vLLM forks its engine-core process by default; a fork would inherit this worker's NATS
# socket (and any threads' locks). Spawn starts it clean. Set unless the operator chose.
MULTIPROC_ENV = "VLLM_WORKER_MULTIPROC_METHOD"

# The protocol vLLM's own tracing exports with (it defaults to gRPC); tokenbus exports
# OTLP/HTTP, so vLLM is set to the same, one collector endpoint for both.
OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

# Supported tasks (vLLM's ``get_supported_tasks``) -> the endpoints they serve.
_GENERATE_ENDPOINTS = ["chat", "completions"]
_POOLING_RUNNERS = ("pooling",)
_EMBED_CONVERTS = ("embed",)


def pin_gpus(gpus: str) -> None:
    """Make only ``gpus`` (e.g. ``"0,1"``) visible to this process and its vLLM workers.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when torch initialises it, so the variable must
    be set before torch is imported. Raises RuntimeError if torch is already imported and the
    value would change, rather than silently running on the wrong GPUs. An empty string leaves
    the environment as it is.
    """
    wanted = ",".join(p.strip() for p in gpus.split(",") if p.strip())
    if not wanted:
        return
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if current is not None and current.replace(" ", "") == wanted:
        return
    if "torch" in sys.modules:
        raise RuntimeError(
            f"cannot pin GPUs to {wanted!r}: torch is already imported in this process "
            f"(CUDA_VISIBLE_DEVICES={current!r}); set CUDA_VISIBLE_DEVICES before starting the "
            "worker or run one vllm worker per process"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _in_thread(fn: Callable[[], Any], on_orphan: Callable[[Any], None]) -> asyncio.Future[Any]:
    """Run ``fn`` in a daemon thread; its result or exception completes the future.

    A daemon thread, not the loop's executor, so a SIGTERM during minutes of weight loading
    does not keep the process waiting for it at exit. If the future was cancelled (the
    caller gave up) by the time ``fn`` returns, ``on_orphan(result)`` disposes of it.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.cancelled():
            if ok:
                on_orphan(value)
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, fn()
        except BaseException as exc:
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody is waiting
            if ok:
                on_orphan(value)

    threading.Thread(target=target, name="vllm-engine-build", daemon=True).start()
    return fut


class VLLMBackend:
    """vLLM's OpenAI front end and ``AsyncLLM`` in-process: one instance is one replica on the
    GPUs in ``cfg.vllm.gpus``.

    ``vllm`` replaces :func:`vllm_serving.load_vllm` (the names in ``VLLM_NAMES``; tests pass
    a fake). After :meth:`start`: ``tp`` is the effective tensor-parallel size (from
    ``--tp`` or the ``tensor_parallel_size`` option), ``served_models`` the model names this
    replica answers to (served names, then LoRA adapter names), ``args`` the parsed
    ``vllm serve`` namespace, ``state`` vLLM's app state with its serving objects.
    """

    name = "vllm"

    def __init__(self, cfg: WorkerSettings, *, vllm: Any = None) -> None:
        self.cfg = cfg
        self._vllm = vllm
        self.engine: Any = None
        self.state: Any = None
        self.args: Any = None
        self.supported_tasks: tuple[str, ...] | None = None
        self.served_models: list[str] = []
        # LoRA adapters loaded at run time (docs/adapters.md): name -> path.
        self.adapters: dict[str, str] = {}
        opts = self.options()
        self.tp = int(opts.get("tensor_parallel_size", opts.get("tp", 1)) or 1)
        # The model's revision where the options pin one (announced with its KV hashing).
        rev = opts.get("revision")
        self.revision: str | None = str(rev) if rev else None
        self._embedding_adapter: Any = None
        # The chat serving object whose stream yields chunk objects, not their SSE
        # (_stream_chat_objects).
        self._raw_chat: Any = None
        # Our requests still in the engine: key -> True once the engine produced output.
        self._inflight: dict[object, bool] = {}
        # Latest scheduler snapshot per engine core: (running, waiting, kv_usage).
        self._sched: dict[int, tuple[int, int, float]] = {}
        # vLLM's KV events, forwarded (docs/kv-events.md); the folder of their IPC sockets.
        self._kv: Any = None
        self._kv_folder: str | None = None

    # -- configuration ----------------------------------------------------------------------
    def options(self) -> dict[str, Any]:
        """The ``vllm serve`` options: ``cfg.vllm.engine_args`` with ``model`` defaulting to
        ``cfg.model`` and ``tensor_parallel_size`` to ``cfg.tp``. Engine arguments and
        front-end options (``tool_call_parser``, ``enable_auto_tool_choice``,
        ``reasoning_parser``, ``chat_template``, ``lora_modules``...) go in the same mapping,
        by the names ``vllm serve --help`` shows (``-`` or ``_``). When this process traces
        (docs/telemetry.md), ``otlp_traces_endpoint`` defaults to its collector."""
        opts = self._operator_options()
        opts.setdefault("model", self.cfg.model)
        # Traced, vLLM traces too, to the same collector, unless the operator chose where.
        endpoint = tracing.traces_endpoint()
        if endpoint and "otlp_traces_endpoint" not in opts:
            opts["otlp_traces_endpoint"] = endpoint
        if self.cfg.tp > 1 and "tensor_parallel_size" not in opts and "tp" not in opts:
            opts["tensor_parallel_size"] = self.cfg.tp
        return opts

    def endpoints(self) -> list[str]:
        """chat and completions for a generative model, embeddings for an embedding model
        (vLLM's supported tasks once started; before, a guess from ``runner``/``convert``)."""
        tasks = self.supported_tasks
        if tasks is None:
            opts = self.options()
            if opts.get("runner") in _POOLING_RUNNERS or opts.get("convert") in _EMBED_CONVERTS:
                return ["embeddings"]
            return list(_GENERATE_ENDPOINTS)
        out: list[str] = []
        if "generate" in tasks:
            out += _GENERATE_ENDPOINTS
        if "embed" in tasks:
            out.append("embeddings")
        return out

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Build vLLM as ``vllm serve`` does, without blocking the event loop.

        Parsing, engine construction (weight loading and CUDA graph capture happen in the
        engine-core process; this one waits for it) run in a thread, so the worker keeps
        answering NATS pings and signals meanwhile. The serving objects are then set up on
        the loop with vLLM's ``init_app_state``.
        """
        if self.engine is not None:
            return
        pin_gpus(self.cfg.vllm.gpus)
        os.environ.setdefault(MULTIPROC_ENV, "spawn")
        if tracing.traces_endpoint() and "otlp_traces_endpoint" not in self._operator_options():
            os.environ.setdefault(OTLP_PROTOCOL_ENV, "http/protobuf")
        args, engine = await _in_thread(self._build, self._shutdown_orphan)
        try:
            vllm = self._vllm
            await _maybe_await(engine.reset_mm_cache())  # as vllm serve does after building
            tasks = tuple(await _maybe_await(engine.get_supported_tasks()))
            state = vllm.State()
            await vllm.init_app_state(engine, state, args, tasks)
            if getattr(state, "serving_embedding", None) is not None:
                from pydantic import TypeAdapter

                self._embedding_adapter = TypeAdapter(vllm.EmbeddingRequest)
        except BaseException:
            self._shutdown_orphan((args, engine))
            raise
        self.engine, self.state, self.args, self.supported_tasks = engine, state, args, tasks
        chat = getattr(state, "openai_serving_chat", None)
        self._raw_chat = chat if _stream_chat_objects(chat) else None
        models = getattr(state, "openai_serving_models", None)
        names = [p.name for p in getattr(models, "base_model_paths", ())]
        names += [n for n in getattr(models, "lora_requests", {}) if n not in names]
        self.served_models = names
        await self._follow_kv_events(engine)

    # -- LoRA adapters at run time (docs/adapters.md) ------------------------------------------
    def _serving_models(self) -> Any:
        models = getattr(self.state, "openai_serving_models", None)
        if models is None:
            raise E.InvalidRequest("this vLLM replica is not started", param="model")
        if not getattr(self.args, "enable_lora", False):
            raise E.InvalidRequest(
                "LoRA is off on this replica: start it with --engine-arg enable_lora=true "
                "(and max_lora_rank for the adapters' rank)",
                param="name",
            )
        return models

    async def load_adapter(self, name: str, path: str) -> None:
        """Load through vLLM's own front end, as ``POST /v1/load_lora_adapter`` does (its
        checks, its engine call); again in place when the name is loaded already."""
        models = self._serving_models()
        request = self._vllm.LoadLoRAAdapterRequest(
            lora_name=name, lora_path=path, load_inplace=name in self.adapters
        )
        out = await models.load_lora_adapter(request)
        if isinstance(out, self._vllm.ErrorResponse):
            err = self._error_from_info(out.error)
            if isinstance(err, E.ModelNotFound):  # vLLM: no adapter at that path
                err = E.InvalidRequest(err.message, param="path")
            raise err
        self.adapters[name] = path
        if name not in self.served_models:
            self.served_models.append(name)

    async def unload_adapter(self, name: str) -> None:
        """Unload through vLLM's front end (``POST /v1/unload_lora_adapter``)."""
        models = self._serving_models()
        out = await models.unload_lora_adapter(self._vllm.UnloadLoRAAdapterRequest(lora_name=name))
        if isinstance(out, self._vllm.ErrorResponse):
            err = self._error_from_info(out.error)
            if not isinstance(err, E.ModelNotFound):  # gone already: unloaded
                raise err
        self.adapters.pop(name, None)
        if name in self.served_models:
            self.served_models.remove(name)

    async def _follow_kv_events(self, engine: Any) -> None:
        """Subscribe to the engine's KV-event publisher, if it has one (rank 0: a worker is
        one data-parallel rank)."""
        get = getattr(engine, "get_kv_event_sources", None)
        sources = get() if callable(get) else {}
        config = sources.get(0) if isinstance(sources, dict) else None
        if config is None or not getattr(config, "enable_kv_cache_events", False):
            return
        from engine_worker.backends import vllm_kv

        vc = engine.vllm_config
        kv = vllm_kv.VLLMKVEvents(
            block_size=int(vc.cache_config.block_size),
            capacity=int(vc.cache_config.num_gpu_blocks or 0),
            hashing=vllm_kv.hashing_of(vc),
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            topic=config.topic,
            folder=self._kv_folder,
        )
        await kv.start()
        self._kv = kv

    def kv_events(self) -> Any:
        """vLLM's KV events as the worker's event source (None: not on)."""
        return self._kv

    def _build(self) -> tuple[Any, Any]:
        """Parse the options with vLLM's serve parser and create the engine (in a thread)."""
        if self._vllm is None:
            self._vllm = vs.load_vllm()
        vllm = self._vllm
        args = self.parse_args()
        vllm.validate_parsed_serve_args(args)
        vllm.init_parser_plugin(args)
        vllm.validate_api_server_args(args)
        self.tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
        gpus = self.cfg.vllm.gpus
        n_gpus = len([g for g in gpus.split(",") if g.strip()])
        world = self.tp * int(getattr(args, "pipeline_parallel_size", 1) or 1)
        if n_gpus and world > n_gpus:
            raise RuntimeError(
                f"the vllm worker needs {world} GPUs (tensor x pipeline parallel) but "
                f"worker.vllm.gpus={gpus!r} names only {n_gpus}"
            )
        engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
        usage = vllm.UsageContext.OPENAI_API_SERVER
        vllm_config = engine_args.create_engine_config(usage_context=usage)
        kwargs: dict[str, Any] = {}
        factory = self._stat_logger_factory()
        if factory is not None:
            kwargs["stat_loggers"] = [factory]
        with self._engine_core():
            engine = vllm.AsyncLLM.from_vllm_config(
                vllm_config=vllm_config,
                usage_context=usage,
                enable_log_requests=engine_args.enable_log_requests,
                aggregate_engine_logging=engine_args.aggregate_engine_logging,
                disable_log_stats=engine_args.disable_log_stats,
                **kwargs,
            )
        return args, engine

    def _engine_core(self) -> contextlib.AbstractContextManager[None]:
        """vLLM's own engine core, or the scripted one (no GPU step; docs/vllm.md) when
        ``worker.vllm.scripted_core`` is set. ``AsyncLLM`` builds its engine-core client
        while it is constructed, so the replacement ends when construction does."""
        scripted = self.cfg.vllm.scripted_core
        if scripted is None:
            return contextlib.nullcontext()
        from engine_worker.backends import scripted_core as sc

        return sc.installed(sc.ScriptedCoreSettings.model_validate(scripted))

    def parse_args(self) -> Any:
        """The options parsed by ``vllm serve``'s own argument parser (a Namespace).

        The served model name defaults to ``cfg.model`` (the name the router routes by),
        unless that is the name of one of the LoRA modules.
        """
        vllm = self._vllm
        parser = vllm.make_arg_parser(vllm.FlexibleArgumentParser(prog="vllm serve"))

        def refuse(message: str) -> Any:
            raise ValueError(f"invalid vllm option: {message}")

        parser.error = refuse  # argparse would print usage and exit the worker
        argv = vs.serve_argv(self.options(), parser)
        args = parser.parse_args(argv)
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        loras = {getattr(m, "name", None) for m in getattr(args, "lora_modules", None) or ()}
        if getattr(args, "served_model_name", None) is None and self.cfg.model not in loras:
            args.served_model_name = [self.cfg.model]
        self._turn_on_kv_events(args)
        if (
            getattr(args, "enable_prompt_tokens_details", None) is False
            and "enable_prompt_tokens_details" not in self._operator_options()
        ):
            # Cached prompt tokens in usage, as OpenAI always reports them.
            args.enable_prompt_tokens_details = True
        return args

    def _turn_on_kv_events(self, args: Any) -> None:
        """Turn vLLM's KV events on (``worker.vllm.kv_events``), on IPC sockets of this
        worker's own, unless the operator configured them (their publisher is followed
        then) or prefix caching is off."""
        if (
            not self.cfg.vllm.kv_events
            or getattr(args, "kv_events_config", "absent") is not None
            or getattr(args, "enable_prefix_caching", None) is False
        ):
            return
        from vllm.config import KVEventsConfig

        from engine_worker.backends import vllm_kv

        self._kv_folder = vllm_kv.private_folder()
        args.kv_events_config = KVEventsConfig(**vllm_kv.events_config(self._kv_folder))

    @staticmethod
    def _shutdown_orphan(built: Any) -> None:
        """Shut down an engine nobody will use (start failed or was cancelled)."""
        with contextlib.suppress(Exception):
            built[1].shutdown()

    def _stat_logger_factory(self) -> Callable[..., Any] | None:
        """A vLLM stat-logger factory feeding :meth:`observe_scheduler_stats`, or None.

        vLLM calls ``factory(vllm_config, engine_index)`` and then ``logger.record(...)`` from
        its output handler; ``record`` never raises because an exception there would kill the
        output handler.
        """
        base = getattr(self._vllm, "StatLoggerBase", None)
        if base is None:
            return None
        sink = self.observe_scheduler_stats

        class _SchedulerStatsSink(base):  # type: ignore[misc,valid-type]
            def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(
                self,
                scheduler_stats: Any = None,
                iteration_stats: Any = None,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                try:
                    if scheduler_stats is not None:
                        sink(scheduler_stats, engine_idx or self.engine_index)
                except Exception:
                    pass

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

        try:
            # A release with more abstract methods than we implement fails here, not inside
            # AsyncLLM after its engine processes have started.
            _SchedulerStatsSink(None, 0)
        except TypeError:
            return None

        def factory(vllm_config: Any, engine_index: int = 0) -> Any:
            return _SchedulerStatsSink(vllm_config, engine_index)

        return factory

    async def stop(self) -> None:
        """Shut the engine down (its core processes and IPC); its cache is gone too."""
        engine, self.engine = self.engine, None
        self.state = None
        if engine is None:
            return
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            await _maybe_await(shutdown())
        if self._kv is not None:
            await self._kv.close()

    # -- load -------------------------------------------------------------------------------
    def observe_scheduler_stats(self, stats: Any, engine_index: int = 0) -> None:
        """Record a vLLM ``SchedulerStats`` snapshot (called by the stat logger each step)."""
        kv = getattr(stats, "kv_cache_usage", None)
        if kv is None:
            kv = getattr(stats, "gpu_cache_usage", 0.0)
        waiting = int(getattr(stats, "num_waiting_reqs", 0) or 0)
        waiting += int(getattr(stats, "num_skipped_waiting_reqs", 0) or 0)
        self._sched[engine_index] = (
            int(getattr(stats, "num_running_reqs", 0) or 0),
            waiting,
            float(kv or 0.0),
        )

    def stats(self) -> dict[str, Any]:
        """running/waiting/kv_usage from vLLM's scheduler when it reports them, else from our
        own count of requests in flight (waiting until the engine's first output)."""
        try:
            n = len(self._inflight)
            if self._sched:
                snaps = list(self._sched.values())
                kv = max(s[2] for s in snaps)
                if n == 0:
                    # The last snapshot may predate the end of the last request.
                    return {"running": 0, "waiting": 0, "kv_usage": min(1.0, max(0.0, kv))}
                running = sum(s[0] for s in snaps)
                waiting = sum(s[1] for s in snaps)
                # Requests submitted since the last engine step are not in the snapshot yet.
                waiting += max(0, n - running - waiting)
                return {"running": running, "waiting": waiting, "kv_usage": min(1.0, max(0.0, kv))}
            started = sum(1 for v in self._inflight.values() if v)
            return {"running": started, "waiting": n - started, "kv_usage": 0.0}
        except Exception:
            return {"running": 0, "waiting": 0, "kv_usage": 0.0}

    def health(self) -> str | None:
        """Why the engine cannot serve (None: it can): vLLM's engine core died."""
        return "died (vLLM's engine core; AsyncLLM.errored)" if self._engine_dead() else None

    # -- errors -----------------------------------------------------------------------------
    def _engine_dead(self) -> bool:
        try:
            return bool(getattr(self.engine, "errored", False))
        except Exception:
            return False

    def _error_from_info(self, info: Any) -> E.TokenbusError:
        """A typed error for vLLM's ``ErrorInfo`` (a model or a dict)."""
        get = info.get if isinstance(info, dict) else lambda k, d=None: getattr(info, k, d)
        try:
            status = int(get("code", 500) or 500)
        except (TypeError, ValueError):
            status = 500
        return vs.error_for_status(
            status,
            str(get("message", "") or ""),
            get("param"),
            engine_dead=status >= 500 and self._engine_dead(),
        )

    def _error_from_exception(self, exc: BaseException) -> E.TokenbusError:
        """A typed error for an exception vLLM raised, classified as ``vllm serve`` answers
        it (vLLM's ``create_error_response``: ``VLLMClientError`` 4xx, ...)."""
        if isinstance(exc, E.TokenbusError):
            return exc
        vllm = self._vllm
        dead_cls = getattr(vllm, "EngineDeadError", None)
        if dead_cls is not None and isinstance(exc, dead_cls):
            return vs.error_for_status(500, "", engine_dead=True)
        try:
            response = vllm.create_error_response(exc)
            return self._error_from_info(response.error)
        except Exception:
            return E.EngineError(f"vLLM failed: {type(exc).__name__}: {exc}"[:500])

    # -- generation -------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> DeltaStream:
        """Stream the request's output; closing the iterator early aborts it in vLLM."""
        if req.max_tokens < 1:
            raise E.InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if self.state is None:
            raise E.EngineError("the vllm backend is not started")
        chat = req.messages is not None
        serving = getattr(
            self.state, "openai_serving_chat" if chat else "openai_serving_completion", None
        )
        if serving is None:
            kind = "chat" if chat else "completions"
            raise E.InvalidRequest(f"this vLLM model does not serve {kind}", param="model")
        if req.remaining_tokens == 0:
            return self._spent(req)
        # Built and validated now, so a request vLLM refuses is refused before it is accepted.
        model = self._model(req)
        body = vs.chat_body(req, model) if chat else vs.completion_body(req, model)
        handover = asks_handover(req.extra.get("kv_transfer_params") if req.extra else None)
        if handover:
            # A prefill replica's part (docs/disaggregation.md): vLLM returns the KV
            # connector's hand-over on a whole answer only, as its P/D proxies ask for it.
            body["stream"] = False
            body.pop("stream_options", None)
        cls = self._vllm.ChatCompletionRequest if chat else self._vllm.CompletionRequest
        request = self._request(cls, body)
        if handover:
            return Started(self._handover(request, serving, chat, self._raw_request(req)))
        # Started now: vLLM renders the prompt and queues it on the generator's first step.
        return Started(self._stream(request, serving, chat, self._raw_request(req)))

    async def _ask(self, request: Any, serving: Any, chat: bool, raw_request: Any) -> Any:
        """vLLM's answer to ``request`` (a stream, or a whole answer); a refusal raised as
        the error it names."""
        try:
            if chat:
                result = await serving.create_chat_completion(request, raw_request)
            else:
                result = await serving.create_completion(request, raw_request)
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise self._error_from_exception(exc) from exc
        if isinstance(result, self._vllm.ErrorResponse):
            raise self._error_from_info(result.error)
        return result

    async def _handover(
        self, request: Any, serving: Any, chat: bool, raw_request: Any
    ) -> AsyncGenerator[Delta, None]:
        """A prefill's whole answer (its one token) as one delta with vLLM's
        ``kv_transfer_params`` for the decode replica."""
        result = await self._ask(request, serving, chat, raw_request)
        choices = getattr(result, "choices", None)
        if not choices:
            raise E.EngineError(f"vLLM answered a prefill with {type(result).__name__}")
        c = choices[0]
        text = (c.message.content or "") if chat else (c.text or "")
        usage = result.usage
        done = int(getattr(usage, "completion_tokens", 0) or 0)
        yield Delta(
            text,
            done,
            finish_reason(c.finish_reason or "length"),
            int(getattr(usage, "prompt_tokens", 0) or 0),
            done,
            kv_transfer_params=getattr(result, "kv_transfer_params", None),
        )

    def _raw_request(self, req: GenerationRequest) -> Any:
        """What vLLM's serving layer reads the trace context from: an HTTP request (a
        starlette ``Request``, as ``vllm serve`` passes) holding only the trace headers.
        vLLM hands them to ``AsyncLLM.generate(trace_headers=...)`` when its tracing is on
        (``otlp_traces_endpoint``), so its spans are children of this replica's. None when
        the request carries none (tracing off): vLLM gets what it always got."""
        if not req.trace_headers:
            return None
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/",
            "query_string": b"",
            "headers": [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in req.trace_headers.items()
            ],
        }
        return self._vllm.Request(scope, _no_body)

    def _operator_options(self) -> dict[str, Any]:
        return {str(k).replace("-", "_"): v for k, v in self.cfg.vllm.engine_args.items()}

    @staticmethod
    async def _spent(req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """A migrated request whose budget the text already delivered used up: done."""
        yield Delta("", 0, "length", 0, 0)

    def _model(self, req: GenerationRequest) -> str:
        return req.model or self.cfg.model

    def _request(self, cls: Any, body: dict[str, Any]) -> Any:
        """vLLM's protocol request model for ``body``; its validation errors are 400s."""
        try:
            return cls.model_validate(body)
        except Exception as exc:
            err = self._error_from_exception(exc)
            if isinstance(err, E.EngineError):  # pydantic's own ValidationError: a 400 too
                err = E.InvalidRequest(f"invalid request: {exc}"[:500])
            raise err from None

    async def _stream(
        self, request: Any, serving: Any, chat: bool, raw_request: Any = None
    ) -> AsyncGenerator[Delta, None]:
        key = object()
        self._inflight[key] = False
        events: AsyncIterator[str] | None = None
        finished = False
        try:
            result = await self._ask(request, serving, chat, raw_request)
            if not hasattr(result, "__anext__"):
                raise E.EngineError(f"vLLM answered a stream with {type(result).__name__}")
            events = result
            decoder = vs.StreamDecoder(chat)
            feed = decoder.feed_chunk if serving is self._raw_chat else decoder.feed
            inflight = self._inflight
            async for event in result:
                inflight[key] = True
                try:
                    d = feed(event)
                except vs.ErrorEvent as err:
                    raise self._error_from_info(err.info) from None
                if d is None:
                    continue
                if d.finish_reason is not None:
                    finished = True
                    # vLLM is done with it even if our consumer never closes this generator.
                    inflight.pop(key, None)
                    yield d
                    return
                yield d
            if not finished:
                d = decoder.final()  # raises if it ended without finishing
                finished = True
                inflight.pop(key, None)
                yield d
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise self._error_from_exception(exc) from exc
        finally:
            self._inflight.pop(key, None)
            if events is not None and not finished:
                # Closing vLLM's generator ends the engine request: AsyncLLM.generate aborts
                # it by its own internal id when closed or cancelled. No abort by the
                # caller's id here: that would abort every request sharing it.
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

    async def embed(self, req: GenerationRequest) -> Embeddings:
        """Embed ``req.input`` with vLLM's embedding handler (pooling models)."""
        state = self.state
        if state is None:
            raise E.EngineError("the vllm backend is not started")
        serving = getattr(state, "serving_embedding", None)
        if serving is None or self._embedding_adapter is None:
            raise E.InvalidRequest("this vLLM model does not serve embeddings", param="model")
        body = vs.embedding_body(req, self._model(req))
        adapter = self._embedding_adapter
        try:
            request = adapter.validate_python(body)
        except Exception as exc:
            err = self._error_from_exception(exc)
            if isinstance(err, E.EngineError):
                err = E.InvalidRequest(f"invalid request: {exc}"[:500])
            raise err from None
        key = object()
        self._inflight[key] = True
        try:
            response = await serving(request, self._raw_request(req))
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise self._error_from_exception(exc) from exc
        finally:
            self._inflight.pop(key, None)
        if isinstance(response, self._vllm.ErrorResponse):
            raise self._error_from_info(response.error)
        try:
            data = json.loads(bytes(response.body))
        except (AttributeError, TypeError, ValueError) as exc:
            raise E.EngineError(f"vLLM answered embeddings with {type(response).__name__}") from exc
        status = int(getattr(response, "status_code", 200) or 200)
        if status >= 400 or "error" in data:
            raise self._error_from_info(data.get("error") or {"code": status})
        items = sorted(data.get("data") or (), key=lambda item: int(item.get("index", 0)))
        vectors = [list(item["embedding"]) for item in items]
        usage = data.get("usage") or {}
        return Embeddings(vectors, int(usage.get("prompt_tokens") or 0))


def _stream_chat_objects(serving: Any) -> bool:
    """Have ``serving`` (vLLM's ``OpenAIServingChat``) stream chunk objects, not SSE text.

    vLLM 0.33's ``create_chat_completion`` returns ``chat_completion_stream_generator``, a
    wrapper that serialises each chunk of ``chat_completion_stream_generator_raw`` into a
    ``data: ...`` event and ends with ``[DONE]``; an HTTP server needs that, this worker
    does not (it would parse the JSON straight back). An instance attribute pointing the
    wrapper's name at the raw generator skips both: same chunks, same error objects, no
    JSON. True when done; False (events decoded as before) for a vLLM without the raw
    generator.
    """
    raw = getattr(serving, "chat_completion_stream_generator_raw", None)
    if raw is None or not callable(getattr(serving, "chat_completion_stream_generator", None)):
        return False
    serving.chat_completion_stream_generator = raw
    return True


async def _no_body() -> dict[str, Any]:
    """The ASGI receive of :meth:`VLLMBackend._raw_request`: a request without a body."""
    return {"type": "http.request", "body": b"", "more_body": False}
