"""The ``vllm`` backend: vLLM's v1 ``AsyncLLM`` running in this process.

vLLM and torch are imported only in :meth:`VLLMBackend.start`, after :func:`pin_gpus` has set
``CUDA_VISIBLE_DEVICES``, so importing this module (or running the other backends) never needs
them. The vLLM interface used here:

* ``vllm.engine.arg_utils.AsyncEngineArgs(**engine_args)`` and
  ``vllm.v1.engine.async_llm.AsyncLLM.from_engine_args(args, stat_loggers=...)``;
* ``AsyncLLM.generate(prompt, sampling_params, request_id)``: an async generator of
  ``RequestOutput`` (``.finished``, ``.prompt_token_ids``, ``.outputs[0]`` a
  ``CompletionOutput`` with ``.text``, ``.token_ids``, ``.finish_reason``);
* ``await AsyncLLM.abort(request_id)``, ``AsyncLLM.shutdown()``, ``AsyncLLM.get_tokenizer()``
  (a coroutine in older releases, so its result is awaited when it is one);
* ``vllm.sampling_params.SamplingParams`` with ``output_kind=RequestOutputKind.DELTA`` so each
  output carries only the new text and token ids;
* a custom stat logger (``vllm.v1.metrics.loggers.StatLoggerBase``) that receives
  ``SchedulerStats`` (``num_running_reqs``, ``num_waiting_reqs``, ``kv_cache_usage``, called
  ``gpu_cache_usage`` in older releases) for heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import sys
from collections.abc import AsyncGenerator, Callable
from typing import Any

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from services.config import WorkerSettings

# vLLM's finish reasons (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS) mapped onto ours.
# "error" (a request-level engine failure) and "abort" (the engine dropped a request we did
# not cancel) are not normal endings: they raise EngineError instead, so the caller sees a
# retryable failure rather than a silently truncated answer.
_FINISH = {"stop": "stop", "length": "length", "repetition": "stop"}
_FAILED_FINISH = {
    "error": "the vLLM engine failed the request",
    "abort": "the vLLM engine aborted the request",
}


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


def _message_text(content: Any) -> str:
    """Flatten OpenAI-style content (a string or a list of parts) to text for the template."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise E.InvalidRequest(
                    f"the vllm backend accepts only text content, got {kind!r}", param="messages"
                )
        return "".join(texts)
    return str(content)


def _map_error(exc: BaseException, produced: bool) -> E.TokenbusError:
    """A typed error for an exception raised by the engine."""
    if isinstance(exc, E.TokenbusError):
        return exc
    name = type(exc).__name__
    # vLLM validates a request when it is added (prompt longer than max_model_len, bad
    # sampling values...) and raises ValueError (VLLMValidationError in newer releases);
    # that is the caller's fault and retrying elsewhere would not help.
    if not produced and isinstance(exc, ValueError):
        return E.InvalidRequest(f"vLLM rejected the request: {exc}"[:500])
    if name == "EngineDeadError":
        return E.EngineError("the vLLM engine process died; the replica must be restarted")
    # EngineGenerateError is raised "from" the real cause and has no message of its own.
    cause = exc.__cause__
    detail = f"{name}: {exc}" if str(exc) else name
    if cause is not None:
        detail += f" (caused by {type(cause).__name__}: {cause})"
    return E.EngineError(f"vLLM generation failed: {detail}"[:500])


class VLLMBackend:
    """vLLM ``AsyncLLM`` in-process; one instance is one replica on the GPUs in ``cfg.vllm.gpus``.

    ``engine_factory(engine_args) -> engine`` replaces ``AsyncLLM.from_engine_args`` (tests
    pass a fake with the same interface); ``sampling_params_cls`` and ``request_output_kind``
    replace vLLM's ``SamplingParams`` and ``RequestOutputKind`` when vLLM is not installed.
    """

    name = "vllm"

    def __init__(
        self,
        cfg: WorkerSettings,
        *,
        engine_factory: Callable[[dict[str, Any]], Any] | None = None,
        sampling_params_cls: Callable[..., Any] | None = None,
        request_output_kind: Any = None,
    ) -> None:
        self.cfg = cfg
        self._engine_factory = engine_factory
        self._sp_cls = sampling_params_cls
        self._kind = request_output_kind
        self.engine: Any = None
        self.tokenizer: Any = None
        # Our requests still in the engine: key -> True once the engine produced output.
        self._inflight: dict[object, bool] = {}
        # Latest scheduler snapshot per engine core: (running, waiting, kv_usage).
        self._sched: dict[int, tuple[int, int, float]] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments for ``AsyncEngineArgs``: ``cfg.vllm.engine_args`` with
        ``model`` defaulting to ``cfg.model`` and ``tensor_parallel_size`` to ``cfg.tp``."""
        args = dict(self.cfg.vllm.engine_args)
        args.setdefault("model", self.cfg.model)
        if self.cfg.tp > 1:
            args.setdefault("tensor_parallel_size", self.cfg.tp)
        return args

    async def start(self) -> None:
        """Pin the GPUs, then build the engine and fetch its tokenizer (for chat templates)."""
        if self.engine is not None:
            return
        gpus = self.cfg.vllm.gpus
        pin_gpus(gpus)
        args = self.engine_args()
        n_gpus = len([g for g in gpus.split(",") if g.strip()])
        world = int(args.get("tensor_parallel_size", 1)) * int(
            args.get("pipeline_parallel_size", 1)
        )
        if n_gpus and world > n_gpus:
            raise RuntimeError(
                f"the vllm worker needs {world} GPUs (tensor x pipeline parallel) but "
                f"worker.vllm.gpus={gpus!r} names only {n_gpus}"
            )
        self._load_types()
        if self._engine_factory is not None:
            engine = await _maybe_await(self._engine_factory(args))
        else:
            engine = self._build_vllm_engine(args)
        self.engine = engine
        try:
            self.tokenizer = await _maybe_await(engine.get_tokenizer())
        except Exception:
            # skip_tokenizer_init=True engines have none; chat then uses the plain rendering.
            self.tokenizer = None

    def _load_types(self) -> None:
        if self._sp_cls is not None:
            return
        try:
            from vllm.sampling_params import RequestOutputKind, SamplingParams
        except ImportError as exc:
            raise RuntimeError("the vllm backend needs vLLM: pip install 'tokenbus[vllm]'") from exc
        self._sp_cls = SamplingParams
        self._kind = RequestOutputKind

    def _build_vllm_engine(self, args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs(**args)
        kwargs: dict[str, Any] = {}
        factory = self._stat_logger_factory()
        if (
            factory is not None
            and "stat_loggers" in inspect.signature(AsyncLLM.from_engine_args).parameters
        ):
            kwargs["stat_loggers"] = [factory]
        # Built on the event loop, as vLLM's own API server does: AsyncLLM starts its output
        # handler eagerly when a loop is running, so early engine failures are not missed.
        return AsyncLLM.from_engine_args(engine_args, **kwargs)

    def _stat_logger_factory(self) -> Callable[..., Any] | None:
        """A vLLM stat-logger factory feeding :meth:`observe_scheduler_stats`, or None.

        vLLM calls ``factory(vllm_config, engine_index)`` and then ``logger.record(...)`` from
        its output handler; the ``record`` signature differs between releases, so it takes
        anything, and it never raises because an exception there would kill the output handler.
        """
        try:
            from vllm.v1.metrics.loggers import StatLoggerBase
        except Exception:
            return None
        sink = self.observe_scheduler_stats

        class _SchedulerStatsSink(StatLoggerBase):  # type: ignore[misc]
            def __init__(
                self, vllm_config: Any = None, engine_index: int = 0, *a: Any, **kw: Any
            ) -> None:
                self.engine_index = engine_index

            def record(self, *args: Any, **kwargs: Any) -> None:
                try:
                    stats = kwargs.get("scheduler_stats", args[0] if args else None)
                    if stats is not None:
                        sink(stats, self.engine_index)
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
        """Shut the engine down (its core processes and IPC)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            await _maybe_await(shutdown())

    # -- load -------------------------------------------------------------------------------
    def observe_scheduler_stats(self, stats: Any, engine_index: int = 0) -> None:
        """Record a vLLM ``SchedulerStats`` snapshot (called by the stat logger each step)."""
        kv = getattr(stats, "kv_cache_usage", None)
        if kv is None:
            kv = getattr(stats, "gpu_cache_usage", 0.0)
        self._sched[engine_index] = (
            int(getattr(stats, "num_running_reqs", 0) or 0),
            int(getattr(stats, "num_waiting_reqs", 0) or 0),
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

    # -- generation -------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """Stream the request's output; closing the iterator early aborts it in vLLM."""
        if req.max_tokens < 1:
            raise E.InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if self.engine is None:
            raise E.EngineError("the vllm backend is not started")
        return self._stream(req)

    def _prompt(self, req: GenerationRequest) -> tuple[Any, int]:
        """vLLM's prompt for ``req`` and its token count when known here (else 0)."""
        tok = self.tokenizer
        if req.messages is None or tok is None or not getattr(tok, "chat_template", None):
            # A migrated request continues after the text already sent.
            return req.prompt_text() + req.resume_text, 0
        messages = [{**m, "content": _message_text(m.get("content"))} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except E.TokenbusError:
            raise
        except Exception as exc:
            # Templates raise for conversations they do not accept (e.g. roles that do not
            # alternate): the caller's to fix.
            raise E.InvalidRequest(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc
        text += req.resume_text  # the assistant's reply so far (migration), continued
        encode = getattr(tok, "encode", None)
        if encode is None:
            return text, 0
        # The rendered template already holds the BOS token; letting vLLM tokenize the text
        # would add a second one, so pass token ids tokenized without special tokens (what
        # vLLM's own chat endpoint does).
        ids = list(encode(text, add_special_tokens=False))
        return {"prompt_token_ids": ids}, len(ids)

    def _sampling_params(self, req: GenerationRequest) -> tuple[Any, bool]:
        """vLLM SamplingParams for ``req`` and whether outputs will be deltas."""
        assert self._sp_cls is not None
        kwargs: dict[str, Any] = {
            "max_tokens": max(1, req.remaining_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": list(req.stop) or None,
        }
        delta = self._kind is not None and hasattr(self._kind, "DELTA")
        if delta:
            kwargs["output_kind"] = self._kind.DELTA
        try:
            return self._sp_cls(**kwargs), delta
        except (ValueError, TypeError) as exc:
            raise E.InvalidRequest(f"invalid sampling parameters: {exc}") from exc

    async def _stream(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        engine = self.engine
        if engine is None:
            raise E.EngineError("the vllm backend is stopped")
        prompt, prompt_tokens = self._prompt(req)
        params, delta_mode = self._sampling_params(req)
        rid = req.request_id
        key = object()
        self._inflight[key] = False
        outputs: Any = None
        produced = False  # the engine has sent at least one output
        done = False  # the engine has finished the request (nothing left to abort)
        prev_text, prev_ids = "", 0
        completion = 0
        final_text, final_ids = "", 0
        reason: str | None = None
        try:
            # The loop runs to the generator's natural end (right after the finished output)
            # so vLLM cleans the request up without an abort.
            outputs = engine.generate(prompt, params, rid)
            async for out in outputs:
                produced = True
                self._inflight[key] = True
                if out.prompt_token_ids is not None:
                    prompt_tokens = len(out.prompt_token_ids)
                if done or not out.outputs:
                    continue
                comp = out.outputs[0]
                text = comp.text or ""
                n_ids = len(comp.token_ids or ())
                if not delta_mode:  # cumulative outputs: take what is new
                    text, prev_text = text[len(prev_text) :], text
                    n_ids, prev_ids = n_ids - prev_ids, n_ids
                completion += n_ids
                if out.finished:
                    done = True
                    final_text, final_ids = text, n_ids
                    reason = str(comp.finish_reason) if comp.finish_reason is not None else "stop"
                elif text or n_ids:
                    yield Delta(text, n_ids)
            if not done:
                raise E.EngineError("vLLM ended the stream without finishing the request")
            if reason in _FAILED_FINISH:
                raise E.EngineError(_FAILED_FINISH[reason])
            # The engine is done with it even if our consumer never closes this generator.
            self._inflight.pop(key, None)
            yield Delta(
                final_text,
                final_ids,
                _FINISH.get(reason or "stop", "stop"),
                prompt_tokens,
                completion,
            )
        except (GeneratorExit, asyncio.CancelledError):
            if not done:
                await self._abort(engine, rid)
            raise
        except E.TokenbusError:
            raise
        except Exception as exc:
            raise _map_error(exc, produced) from exc
        finally:
            self._inflight.pop(key, None)
            if not done:
                # Close vLLM's generator now rather than at garbage collection.
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

    @staticmethod
    async def _abort(engine: Any, request_id: str) -> None:
        """Tell the engine to drop the request and free its KV cache (best effort)."""
        abort = getattr(engine, "abort", None)
        if abort is None:
            return
        with contextlib.suppress(Exception):
            await _maybe_await(abort(request_id))
