"""An engine backend served as a plain OpenAI-compatible HTTP server, no bus in between.

``tokenbus serve openai-http`` runs the same HTTP code as the bridge over an in-process
engine, so "through tokenbus" and "straight to the engine" differ only by the bus path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from bus_schemas.subjects import KIND_EMBEDDINGS
from engine_worker import backends
from engine_worker.backends.base import Backend, Delta, GenerationRequest
from gateway import validation
from gateway.anthropic_api import MessagesAPI
from gateway.asgi import serve
from gateway.openai_api import OpenAIApp
from gateway.responses_api import ResponsesAPI
from services import logging as tlog
from services.caller import Chunk, Usage
from services.config import Settings
from services.runtime import stop_event


class DirectStream:
    """A backend generation shaped like :class:`services.caller.Stream`."""

    def __init__(self, gen: AsyncIterator[Delta], request_id: str) -> None:
        self._gen = gen
        self.request_id = request_id
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.rate_limits: dict[str, str] = {}
        self.service_tier: str | None = None  # no flow control in front of the engine
        self._ready: list[Chunk] = []  # chunks to hand out before reading the backend again

    @classmethod
    def embeddings(cls, backend: Backend, req: GenerationRequest, request_id: str) -> DirectStream:
        """An embeddings request: one chunk per vector, then the end."""

        async def run() -> AsyncIterator[Delta]:
            result = await backend.embed(req)
            stream._ready = [
                Chunk("", 0, i, embedding={"index": i, "embedding": v})
                for i, v in enumerate(result.vectors)
            ]
            yield Delta("", 0, "stop", result.prompt_tokens, 0)

        stream = cls(run(), request_id)
        return stream

    def __aiter__(self) -> DirectStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._ready:
            return self._ready.pop(0)
        async for d in self._gen:
            side = d.has_side
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason
                self.stop_sequence = d.stop_sequence
                details = d.usage or {}
                self.usage = Usage(
                    d.prompt_tokens,
                    d.completion_tokens,
                    d.prompt_tokens + d.completion_tokens,
                    details.get("prompt_tokens_details"),
                    details.get("completion_tokens_details"),
                )
                if not d.text and not side:
                    if self._ready:
                        return self._ready.pop(0)
                    break
            if side:
                return Chunk(d.text, d.tokens, 0, d.tool_calls, d.logprobs, d.refusal, d.reasoning)
            if d.text:
                return Chunk(d.text, d.tokens, 0)
        raise StopAsyncIteration

    def pending(self) -> int:
        return 0

    def push_to(self, sink: Callable[[str], bool] | None) -> None:
        """Nothing to hand over: chunks come from the backend in the consumer's own task."""

    async def aclose(self) -> None:
        await self._gen.aclose()  # type: ignore[attr-defined]


class DirectSource:
    """Generations from one in-process backend."""

    def __init__(self, backend: Backend, model: str, default_max_tokens: int) -> None:
        self.backend = backend
        self.model = model
        self.default_max_tokens = default_max_tokens

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
    ) -> DirectStream:
        if req.model != self.model:
            from bus_schemas import errors as E

            raise E.ModelNotFound(
                f"the model {req.model!r} does not exist (serving {self.model})", param="model"
            )
        env = validation.envelope(
            kind,
            req,
            body,
            request_id,
            default_max_tokens=self.default_max_tokens,
            deadline_ms=None,
        )
        greq = GenerationRequest.from_envelope(env)
        if kind == KIND_EMBEDDINGS:
            return DirectStream.embeddings(self.backend, greq, request_id)
        return DirectStream(self.backend.generate(greq), request_id)

    def models(self) -> list[str]:
        return [self.model]

    def models_for(self, api_key: str | None) -> list[str]:
        return [self.model]  # the direct baseline checks no keys

    def context_length(self, model: str) -> int:
        return int(getattr(self.backend, "max_model_len", 0) or 0)

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


async def run_direct(settings: Settings, host: str, port: int) -> None:
    """Serve the configured worker backend over HTTP until cancelled or signalled."""
    log = tlog.get("openai-http")
    backend = backends.create(settings.worker)
    await backend.start()
    api = OpenAIApp(
        DirectSource(backend, settings.worker.model, settings.ingress.default_max_tokens),
        max_body_bytes=settings.bridge.max_body_bytes,
        request_timeout_s=settings.bridge.request_timeout_s,
    )
    # The Responses API over the same engine, so a benchmark can compare that path too
    # (without a bus there is nowhere to keep responses: store comes back false).
    ResponsesAPI(api, None).mount()
    MessagesAPI(api).mount()
    http = await serve(api, host, port, reuse_port=False, shutdown_timeout=5)
    log.info("openai_http_listening", url=f"http://{host}:{port}/v1", model=settings.worker.model)
    stop = stop_event()
    try:
        await stop.wait()
    finally:
        await http.stop()
        await backend.stop()
