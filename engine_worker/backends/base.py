"""The interface every engine backend implements."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bus_schemas import errors as E
from bus_schemas.messages import FILL_CONTEXT, render_prompt
from bus_schemas.side_outputs import GENERATION, carries

# What a backend may serve; a worker announces its list in every heartbeat and the router
# sends a request only to replicas that serve its kind.
ENDPOINTS = ("chat", "completions", "embeddings")


@dataclass(slots=True)
class GenerationRequest:
    """What a backend needs to generate (decoded from the envelope).

    ``messages`` are the client's OpenAI chat messages as sent (content strings or part lists,
    assistant ``tool_calls``, ``tool`` messages with ``tool_call_id``; the filter stage may
    have redacted text in them). ``extra`` holds every request field tokenbus carries but does
    not act on: ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``,
    ``logprobs``/``top_logprobs``, penalties, ``logit_bias``, ``user``, ``reasoning_effort``,
    an engine's own extensions (``chat_template_kwargs``, ``min_tokens``, ...), and for
    embeddings ``dimensions``/``encoding_format``. A backend passes them on (or acts on the
    ones it understands); it never drops them silently.
    """

    request_id: str
    kind: str
    model: str
    max_tokens: int
    # False: max_tokens is the gateway's default, not the client's (it may be lowered to fit).
    max_tokens_set: bool = True
    # None: the engine's (the model's generation config) default.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    # A completion's prompt: text, or token ids (the engine's vocabulary).
    prompt: str | list[int] | None = None
    # Embeddings: the inputs (strings, or token id lists).
    input: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Request migration: the response so far (already delivered); generate what follows,
    # at most ``max_tokens - resume_tokens`` more.
    resume_text: str = ""
    resume_tokens: int = 0
    # W3C trace headers (``traceparent``) of the replica's span when the worker traces: a
    # backend hands them to its engine (vLLM's tracing, an upstream's) so the engine's spans
    # join the request's trace. None when tracing is off.
    trace_headers: dict[str, str] | None = None

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.resume_tokens)

    @property
    def engine_max_tokens(self) -> int | None:
        """``max_tokens`` for an engine that bounds the answer by its own context: the tokens
        left, or None for a request that set none and may fill the context
        (:data:`~bus_schemas.messages.FILL_CONTEXT`), which the engine then fills."""
        if not self.max_tokens_set and self.max_tokens >= FILL_CONTEXT:
            return None
        return self.remaining_tokens

    @classmethod
    def from_envelope(cls, env: dict[str, Any]) -> GenerationRequest:
        p = env.get("params") or {}
        temperature, top_p = p.get("temperature"), p.get("top_p")
        resume = env.get("resume") or {}
        if not isinstance(resume, dict):
            raise TypeError("resume must be a map")
        resume_text = resume.get("text", "")
        if not isinstance(resume_text, str):
            # A NATS client's value: str() of a list nested a thousand deep never returns.
            raise TypeError("resume.text must be a string")
        stop = p.get("stop") or []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            # msgpack carries bytes as well as text: a stop of bytes would fail in the engine.
            raise TypeError("params.stop must be a list of strings")
        return cls(
            request_id=str(env["request_id"]),
            kind=str(env.get("kind", "chat")),
            model=str(env.get("model", "")),
            max_tokens=int(p.get("max_tokens", 256)),
            max_tokens_set=bool(p.get("max_tokens_set", True)),
            temperature=None if temperature is None else float(temperature),
            top_p=None if top_p is None else float(top_p),
            seed=p.get("seed"),
            stop=list(stop),
            messages=env.get("messages"),
            prompt=env.get("prompt"),
            input=env.get("input"),
            extra=dict(env.get("extra") or {}),
            resume_text=resume_text,
            resume_tokens=max(0, int(resume.get("tokens", 0))),
        )

    def prompt_text(self) -> str:
        """A plain-text rendering of the prompt (backends with a tokenizer use templates):
        :func:`bus_schemas.messages.render_prompt`, which a router's KV index hashes too."""
        return render_prompt(self.messages, self.prompt or "")

    @property
    def token_prompt(self) -> bool:
        """Whether the prompt is token ids (not text)."""
        return isinstance(self.prompt, list)

    def check_vocabulary(self, size: int | None) -> None:
        """A 400 naming ``prompt`` when a token id prompt holds an id past a vocabulary of
        ``size`` tokens (None: not known here, the engine judges)."""
        if size and isinstance(self.prompt, list):
            bad = next((t for t in self.prompt if t >= size), None)
            if bad is not None:
                raise E.InvalidRequest(
                    f"prompt: token id {bad} is past the model's vocabulary ({size} tokens)",
                    param="prompt",
                )


_carries_side = carries(GENERATION)


@dataclass(slots=True)
class Delta:
    """New output: text and how many tokens it holds. The last one has ``finish_reason``.

    Beside text a delta may carry, as OpenAI's streaming chunks shape them:
    ``tool_calls`` (tool-call deltas: ``index``, and ``id``/``type``/``function.name`` when a
    call starts, ``function.arguments`` fragments), ``logprobs`` (the choice's logprobs object
    for this delta's tokens: ``{"content": [...]}`` for chat, ``{"tokens": [...], ...}`` for
    text completions), ``refusal`` and ``reasoning`` text, and on the last delta ``usage``
    details (``prompt_tokens_details``, ``completion_tokens_details``) when the engine
    reports them. ``finish_reason`` is ``stop``, ``length``, ``content_filter`` or
    ``tool_calls``; ``stop_sequence`` is the stop string that ended the answer, set only on
    the last delta of a ``stop`` finish caused by one (vLLM's ``stop_reason`` when it is a
    string): None when the model stopped on its own (or on a stop token).
    """

    text: str
    tokens: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: dict[str, Any] | None = None
    refusal: str | None = None
    reasoning: str | None = None
    usage: dict[str, Any] | None = None
    stop_sequence: str | None = None
    # Where ``prompt_tokens`` came from when the engine did not count them itself (the
    # ``openai`` backend: "upstream", "tokenized", "estimate"); None: the engine counted.
    usage_source: str | None = None
    # A prefill's hand-over to a decode replica (vLLM's ``kv_transfer_params`` as the engine
    # returned them), on the last delta of a request that asked ``do_remote_decode``.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def has_side(self) -> bool:
        """Whether the delta carries output beside its text."""
        return _carries_side(self)


@dataclass(slots=True)
class Embeddings:
    """A backend's answer to an embeddings request: one vector per input, in order."""

    vectors: list[list[float]]
    prompt_tokens: int


class DeltaStream(Protocol):
    """What ``generate`` returns: an async iterator of deltas that aborts when closed.

    A stream may also offer ``async push(sink)``: call ``sink(delta)`` with every delta as it
    arrives, from wherever it arrives (a protocol callback), until the last one or until
    ``sink`` returns True; the worker then uses it instead of iterating (no task wake-up per
    delta). Closing the stream still aborts it. A stream whose ``starting`` is True starts
    in a task of its own (:class:`Started`): the worker yields once before its ack."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def __anext__(self) -> Delta: ...

    async def aclose(self) -> None: ...


class Started:
    """An async generator of deltas started now: a task of its own takes its first delta.

    For an engine whose generator does its work only once iterated (vLLM's serving layer
    renders the prompt and hands the request to the engine core on the first step): wrapped,
    the engine starts while the worker sends its ack and accept frame instead of after
    them, as :meth:`Backend.generate` promises. ``starting`` tells the worker to give the
    task a turn of the loop before those. Closing the stream stops the first step if it is
    still running (the generator's own clean-up then aborts the engine request), and closes
    the generator."""

    __slots__ = ("_first", "_gen")
    starting = True

    def __init__(self, gen: AsyncGenerator[Delta, None]) -> None:
        self._gen = gen
        self._first: asyncio.Task[Delta] | None = asyncio.get_running_loop().create_task(
            self._step()
        )

    async def _step(self) -> Delta:
        return await self._gen.__anext__()

    def __aiter__(self) -> Started:
        return self

    async def __anext__(self) -> Delta:
        first, self._first = self._first, None
        if first is not None:
            # Awaited directly: a cancelled consumer cancels the step (and the engine's work).
            return await first
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        first, self._first = self._first, None
        if first is not None:
            first.cancel()
            # Until the step has ended the generator is running and cannot be closed.
            await asyncio.wait((first,))
            if not first.cancelled():
                first.exception()  # retrieved: the stream was closed, not read
        await self._gen.aclose()


class Backend(Protocol):
    """An engine. ``generate`` aborts the request when its consumer closes it."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Load for heartbeats: running, waiting, kv_usage."""
        ...

    def endpoints(self) -> list[str]:
        """Which of :data:`ENDPOINTS` this backend serves (announced in heartbeats)."""
        ...

    def generate(self, req: GenerationRequest) -> DeltaStream:
        """Start generating now; the stream aborts the request when closed early."""
        ...

    async def embed(self, req: GenerationRequest) -> Embeddings:
        """Embed ``req.input`` (kind ``embeddings``); raise InvalidRequest if not served."""
        ...


class KVEventSource(Protocol):
    """What an engine's prefix cache tells the worker, which publishes it on the bus
    (:mod:`bus_schemas.kv_events`): events that change it, numbered from 1 without gaps,
    and snapshots. :class:`engine_worker.kvcache.KVCache` is one.

    Optional: a backend offers it through a method ``kv_events()`` returning it, or None
    while its engine keeps no prefix cache (:func:`kv_event_source`). A source whose engine
    does not hash as the sim does says how it does in an attribute ``hashing``
    (:func:`bus_schemas.kv_events.vllm_scheme`), sent with its snapshots."""

    block_size: int
    capacity: int
    medium: str

    def on_events(self, notify: Callable[[], None] | None) -> None:
        """Keep events from now on for :meth:`drain_events`, calling ``notify()`` (from the
        event loop's thread) when the first is pending; None: keep none."""
        ...

    def drain_events(self) -> tuple[int, list[dict[str, Any]]]:
        """(number of the first, the events in order) kept since the last drain."""
        ...

    def snapshot(self) -> tuple[int, list[tuple[Any, Any]]]:
        """(number of the last event, every cached block as (hash, parent hash or None))."""
        ...

    def stats(self) -> dict[str, Any]:
        """The cache's own account (usage, hits), sent with snapshots."""
        ...


def kv_event_source(backend: object) -> KVEventSource | None:
    """The backend's KV event source (its optional ``kv_events()``), None when it has none."""
    get = getattr(backend, "kv_events", None)
    if not callable(get):
        return None
    source: KVEventSource | None = get()
    return source


# -- prefill/decode disaggregation (vLLM's kv_transfer_params; docs/disaggregation.md) ------
def asks_handover(kvt: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` make it a prefill replica's part: compute
    the prompt and hand its KV cache over at the end."""
    return isinstance(kvt, dict) and kvt.get("do_remote_decode") is True


def reads_remote_prompt(kvt: Any) -> bool:
    """Whether they carry a prefill's hand-over: the prompt's KV cache is read from there."""
    return (
        isinstance(kvt, dict)
        and kvt.get("do_remote_prefill") is True
        and isinstance(kvt.get("remote_block_ids"), list)
    )


def kv_handover(
    engine_id: str, prompt_tokens: int, block_size: int, tp: int, host: str
) -> dict[str, Any]:
    """What a simulated KV connector returns at a prefill's end (the fields of vLLM's
    NixlConnector's ``request_finished``): where the prompt's blocks are."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range(-(-prompt_tokens // block_size))),
        "remote_host": host,
        "remote_port": 0,
        "tp_size": tp,
    }


def kv_transfer_s(tokens: int, bytes_per_token: int, gb_per_s: float) -> float:
    """How long ``tokens`` of a prompt's KV cache take over a link of ``gb_per_s`` GB/s."""
    return tokens * bytes_per_token / (gb_per_s * 1e9)
