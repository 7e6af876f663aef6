"""The ``openai`` backend: forwards to an OpenAI-compatible server (vllm serve, SGLang, TGI,
llama.cpp server, Ollama, or tokenbus' own ``serve openai-http``) and streams its answer.

What the client sent reaches the upstream unchanged (its messages as they are, every field
tokenbus does not own from ``req.extra``); tokenbus sets only the fields it owns: the
upstream's model name, the token budget, streaming with usage, and the sampling parameters
the client set. What the upstream streams back (text, tool-call fragments, logprobs,
refusal, reasoning, finish reason, usage details) reaches the client.

Closing the stream closes the upstream HTTP response, which is how those servers learn that
the client went away and abort the generation.
"""

from __future__ import annotations

import array
import asyncio
import base64
import collections
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import aiohttp
import orjson

from bus_schemas import errors as E
from bus_schemas.messages import envelope_chars
from engine_worker.backends.base import Delta, Embeddings, GenerationRequest
from engine_worker.backends.http_stream import (
    MAX_ERROR_BODY,
    Response,
    Sent,
    SSEParser,
    UpstreamHTTP,
    UpstreamProtocolError,
)
from engine_worker.backends.openai_shape import (
    chat_messages,
    choice_delta,
    finish_reason,
    set_sampling,
    stop_string,
    usage_details,
)
from engine_worker.backends.upstream_caps import (
    PROBE_TIMEOUT_S,
    USAGE_ESTIMATE,
    USAGE_UPSTREAM,
    Caps,
    Prober,
    PromptCounter,
    Refresh,
    estimate,
    probe,
)
from services import logging as tlog
from services.config import WorkerSettings
from services.runtime import StartRefused

log = tlog.get("worker")

# Upstream statuses that mean "this request is wrong" rather than "the upstream failed".
_INVALID = frozenset({400, 404, 413, 422})


def _upstream_error(status: int, text: str) -> E.TokenbusError:
    """The typed error for an upstream's non-200 answer (or an error event in its stream)."""
    message, param = text[:300], None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            # OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
            message = err["message"]
            p = err.get("param")
            param = p if isinstance(p, str) else None
        elif isinstance(err, str):
            message = err
        elif isinstance(obj.get("message"), str):
            # vLLM's older shape: {"object": "error", "message", "type", "code"}.
            message = obj["message"]
    message = message[:1000]
    if status in _INVALID:
        return E.InvalidRequest(f"the upstream refused the request: {message}", param=param)
    return E.EngineError(f"the upstream answered {status}: {message}")


def _event_error(obj: dict[str, Any]) -> E.TokenbusError:
    """The typed error for an error object the upstream sent inside its stream."""
    err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) else 500
    return _upstream_error(status, json.dumps(obj))


def _decode_vector(v: Any) -> list[float]:
    """An embedding as floats (an upstream that ignored ``encoding_format`` sent base64)."""
    if isinstance(v, str):
        a = array.array("f", base64.b64decode(v))
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()
    return [float(x) for x in v]


_JSON = {"Content-Type": "application/json"}

# A prompt of this many characters or more is written with orjson: the standard library's
# encoder takes ~70 ms of the event loop for 16 MiB of text (orjson ~8 ms), and a worker
# with eight such requests at once missed its heartbeats (docs/large-requests.md). Smaller
# requests are written as they always were.
LARGE_PROMPT_CHARS = 256 * 1024


def _json(body: dict[str, Any], large: bool = False) -> bytes:
    """The request as JSON; a value JSON cannot hold (bytes a NATS client sent in a carried
    field) is the client's mistake, not the upstream's. ``large``: with orjson (the same
    JSON, except that non-ASCII text goes as UTF-8 rather than escaped and a NaN or infinity
    goes as null, where the standard library writes tokens that are not JSON)."""
    if large:
        with contextlib.suppress(TypeError, ValueError):  # its refusal is said below
            return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    try:
        return json.dumps(body).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise E.InvalidRequest(f"the request holds a value that is not JSON: {exc}") from None


def _choice_delta(ch: dict[str, Any]) -> Delta | None:
    """A streamed choice's output as a delta (None when it carries none): one token, or as
    many as its logprobs have entries."""
    logprobs = ch.get("logprobs") or {}
    # Chat: {"content": [an entry a token]} (or "refusal": [...]); completions:
    # {"tokens": [...], "token_logprobs": [...], ...}.
    entries = logprobs.get("content") or logprobs.get("refusal") or logprobs.get("tokens")
    d = choice_delta(ch, len(entries) if entries else 1)
    if entries or d.text or d.tool_calls or d.refusal or d.reasoning:
        return d
    return None


class OpenAIUpstreamBackend:
    """Streams from ``upstream_url`` with the OpenAI API."""

    name = "openai"

    def __init__(self, cfg: WorkerSettings) -> None:
        up = cfg.openai
        if not up.upstream_url:
            raise ValueError("the openai backend needs --upstream-url (e.g. http://host:8000/v1)")
        self.base = up.upstream_url.rstrip("/")
        self.model = up.upstream_model or cfg.model
        self.served_as = cfg.model
        self.model_named = bool(up.upstream_model)  # the operator named the upstream's model
        self.api_key = up.api_key
        self.timeout = up.timeout_s
        self.session: aiohttp.ClientSession | None = None
        # Streamed completions: pushed from the connection as they arrive (http_stream).
        self.http: UpstreamHTTP | None = None
        self.in_flight = 0
        # The model's context length: configured, or read from the upstream's /v1/models
        # where it says (vLLM does). The upstream enforces it against the prompt; a
        # ``max_tokens`` beyond it alone is refused here (see :meth:`generate`).
        self.max_model_len = cfg.max_model_len
        # What the upstream can do (upstream_caps.py): probed at start and after it was
        # unreachable; the operator's settings override the probe field by field.
        set_ = {
            k
            for k in ("stream_usage", "continue_message", "logprobs")
            if getattr(up, k) is not None
        }
        self.caps = Caps(overridden=frozenset(set_), **{k: getattr(up, k) for k in set_})
        self.probing = up.probe
        self.tokenize_url = up.tokenize_url
        self.refresh = Refresh()
        self.counter: PromptCounter | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._probe_timer: asyncio.TimerHandle | None = None
        # LoRA adapters loaded on the upstream at run time (name -> path): vLLM's runtime
        # LoRA endpoints (docs/adapters.md).
        self._adapters: dict[str, str] = {}

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=10),
        )
        self.http = UpstreamHTTP(self.base, headers)
        listed = await self._upstream_models()
        if listed is None:
            # Not up yet, or no model list: requests say what the upstream answers, and its
            # capabilities are probed once it answers.
            log.warning("upstream_models_unknown", upstream=self.base, model=self.model)
            self._new_counter(self._prober(), self.caps)
            return
        self._check_model(listed)
        if not self.max_model_len:
            n = listed[self.model].get("max_model_len")
            self.max_model_len = n if isinstance(n, int) and n > 0 else 0
        await self._probe()

    def _prober(self) -> Prober:
        assert self.session is not None
        return Prober(self.session, self.base, self.model)

    def _new_counter(self, prober: Prober, caps: Caps) -> None:
        """Count prompts with what is known of the upstream now (the last counter's work,
        measuring for caps replaced since, is dropped)."""
        if self.counter is not None:
            self.counter.close()
        self.counter = PromptCounter(
            prober, caps, learn=self.probing, busy=lambda: self.in_flight > 0
        )

    def _lost(self) -> None:
        """The upstream could not be reached: probe it again once it answers, and resume no
        chat stream on it meanwhile (what answers next may be another server)."""
        self.refresh.stale = True
        if "continue_message" not in self.caps.overridden:
            self.caps.continue_message = None

    async def _probe(self) -> None:
        """Find out what the upstream can do (logged, in heartbeats, `tokenbus status`)."""
        prober = self._prober()
        self.refresh.begin()
        caps = self.caps
        try:
            if self.probing:
                caps = await probe(prober, self.caps, self.tokenize_url)
            elif self.tokenize_url:
                caps.tokenize, caps.tokenize_url = await prober.find_tokenizer(self.tokenize_url)
                caps.probed = True
            else:
                caps.probed = True
        except Exception as exc:  # a probe must never take the worker down
            log.warning("upstream_probe_failed", upstream=self.base, error=repr(exc))
        self.caps = caps
        self._new_counter(prober, caps)
        self.refresh.end(caps.probed)
        if caps.probed:
            log.info("upstream_capabilities", upstream=self.base, **caps.to_dict())
        else:
            # Until it is known: no resume of a chat stream, prompts counted here.
            log.warning("upstream_not_probed", upstream=self.base, retry_s=self.refresh.every_s)
            self._probe_timer = asyncio.get_running_loop().call_later(
                self.refresh.every_s, self._probe_later
            )

    def _probe_later(self) -> None:
        """Probe again in the background if due (the upstream was unreachable)."""
        if self.session is not None and not self.session.closed and self.refresh.due():
            self.refresh.begin()
            self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    def capabilities(self) -> dict[str, Any]:
        """What the upstream can do, as probed (and overridden): heartbeats carry it."""
        return self.caps.to_dict()

    def can_resume(self, req: GenerationRequest) -> bool:
        """Whether a stream of ``req`` cut off elsewhere continues here exactly: a text
        completion always does (the prompt and the text so far are one prompt); a chat one
        only where the upstream continues a final assistant message."""
        if req.token_prompt:  # the text so far cannot follow token ids without a tokenizer
            return False
        return req.messages is None or self.caps.continue_message is True

    def _check_model(self, listed: dict[str, dict[str, Any]]) -> None:
        """Join only to serve a model the upstream has: one it does not would fail every
        request. An upstream with a single model, when no ``--upstream-model`` was given,
        serves it under ``--model``'s name (said in the log)."""
        if self.model in listed:
            return
        if len(listed) == 1 and not self.model_named:
            (only,) = listed
            log.warning("upstream_model_mapped", model=self.served_as, upstream_model=only)
            self.model = only
            return
        flag = "--upstream-model" if self.model_named else "--model"
        raise StartRefused(
            f"the upstream at {self.base} does not serve the model {self.model!r} ({flag}); "
            f"it serves {', '.join(repr(m) for m in sorted(listed)) or 'none'}. Give "
            f"--upstream-model with one of those (tokenbus keeps serving it as "
            f"{self.served_as!r}, the --model)"
        )

    async def _upstream_models(self) -> dict[str, dict[str, Any]] | None:
        """The upstream's ``/models`` by id, or None when it cannot be asked now. An upstream
        that takes the connection but answers slowly (a loaded machine) is asked once more,
        for as long as a probe may take, rather than taken for one that is not up: its
        capabilities are probed at start then, not at its first request."""
        assert self.session is not None
        for wait_s in (2.0, PROBE_TIMEOUT_S):
            try:
                async with self.session.get(
                    self.base + "/models", timeout=aiohttp.ClientTimeout(total=wait_s)
                ) as r:
                    if r.status != 200:
                        return None
                    data = (await r.json()).get("data") or ()
                    return {m["id"]: m for m in data if isinstance(m.get("id"), str)}
            except TimeoutError:
                continue
            except Exception:
                return None
        return None

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self._probe_timer is not None:
            self._probe_timer.cancel()
        if self.counter is not None:
            self.counter.close()
        if self.http is not None:
            self.http.close()
        if self.session is not None:
            await self.session.close()

    def stats(self) -> dict[str, Any]:
        return {"running": self.in_flight, "waiting": 0, "kv_usage": 0.0}

    # -- LoRA adapters at run time ----------------------------------------------------------
    @property
    def served_models(self) -> list[str]:
        return [self.served_as, *self._adapters]

    @property
    def adapters(self) -> dict[str, str]:
        return self._adapters

    async def load_adapter(self, name: str, path: str) -> None:
        """Load an adapter on the upstream with vLLM's runtime endpoint (``POST
        /v1/load_lora_adapter``, served by a ``vllm serve`` started with
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``); ``path`` is read by
        the upstream, on its host. Raises what the upstream said when it refused."""
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if name in self._adapters:
            body["load_inplace"] = True  # from another place: replaced, as vLLM does
        await self._lora("/load_lora_adapter", body)
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        await self._lora("/unload_lora_adapter", {"lora_name": name})
        self._adapters.pop(name, None)

    async def _lora(self, path: str, body: dict[str, Any]) -> None:
        if self.session is None:
            raise E.EngineError("the openai backend is not started")
        try:
            async with self.session.post(self.base + path, json=body) as r:
                text = (await r.text())[:500]
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise E.EngineError(f"the upstream {self.base} did not answer {path}: {exc}") from None
        if status in (404, 405) and "lora" not in text.lower():
            raise E.InvalidRequest(
                f"the upstream {self.base} has no {path}: run-time adapters need a vLLM server "
                "started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora",
                param="name",
            )
        if status >= 500:
            raise E.EngineError(f"the upstream failed {path} ({status}): {text}")
        if status >= 400:
            raise E.InvalidRequest(f"the upstream refused it ({status}): {text}", param="path")

    def endpoints(self) -> list[str]:
        # An embedding upstream is declared by the operator (``--endpoints embeddings``).
        return ["chat", "completions"]

    # -- generation -------------------------------------------------------------------------
    def _body(self, req: GenerationRequest) -> tuple[str, dict[str, Any]]:
        """The upstream path and JSON body: the client's fields, then the ones tokenbus owns."""
        # ``extra`` never holds a field tokenbus owns (``messages.carried``): set them here.
        body: dict[str, Any] = dict(req.extra)
        # An adapter loaded at run time is asked for by its name, as the upstream serves it.
        body["model"] = req.model if req.model in self._adapters else self.model
        n = req.engine_max_tokens
        if n is not None:  # none: the upstream fills the context, as for its own clients
            body["max_tokens"] = n
        body["stream"] = True
        if self.caps.stream_options:  # an upstream that refuses the field is asked without
            body["stream_options"] = {"include_usage": True}
        set_sampling(body, req)
        if req.messages is not None:
            # Migration continues the assistant's reply (vLLM's and others' extension).
            body["messages"] = chat_messages(req, body)
            return "/chat/completions", body
        # Token ids go as sent (a migrated one does not resume here: can_resume).
        body["prompt"] = (
            req.prompt if isinstance(req.prompt, list) else (req.prompt or "") + req.resume_text
        )
        return "/completions", body

    def generate(self, req: GenerationRequest) -> _Completion:
        if req.max_tokens < 1:
            raise E.InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if self.http is None:
            raise E.EngineError("the openai backend is not started")
        self._probe_later()
        n = self.max_model_len
        if n and req.max_tokens >= n and req.engine_max_tokens is not None:
            # The prompt holds at least one token, so this cannot fit whatever the prompt;
            # an upstream that does not bound it would generate until the request's deadline.
            raise E.ContextLengthExceeded.of(n, req.max_tokens)
        c = _Completion(self, req)
        c.start_now()
        return c

    async def count_prompt(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """(prompt tokens, usage source) for an answer that came without usage; never zero
        input (:class:`~engine_worker.backends.upstream_caps.PromptCounter`)."""
        try:
            if self.counter is None:
                raise RuntimeError("not started")
            async with asyncio.timeout(5.0):
                return await self.counter.count(path, body)
        except Exception as exc:  # the tokenizer failed or hung: estimate rather than 0
            log.warning("prompt_count_failed", error=repr(exc))
            text = json.dumps(body.get("messages") or body.get("prompt") or "")
            return max(1, estimate(text, self.caps)), USAGE_ESTIMATE

    # -- embeddings -------------------------------------------------------------------------
    async def embed(self, req: GenerationRequest) -> Embeddings:
        session = self.session
        if session is None:
            raise E.EngineError("the openai backend is not started")
        if req.input is None:
            raise E.InvalidRequest("an embeddings request needs 'input'", param="input")
        # Floats from the upstream: the gateway encodes them the way the client asked.
        body = {**req.extra, "model": self.model, "input": req.input, "encoding_format": "float"}
        self.in_flight += 1
        try:
            async with session.post(
                self.base + "/embeddings", data=_json(body), headers=_JSON
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise _upstream_error(resp.status, text)
            obj = json.loads(text)
            items = sorted(obj.get("data") or (), key=lambda d: int(d.get("index", 0)))
            vectors = [_decode_vector(d["embedding"]) for d in items]
            usage = obj.get("usage") or {}
            return Embeddings(vectors, int(usage.get("prompt_tokens") or 0))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise E.EngineError(f"the upstream failed: {type(exc).__name__}: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise E.EngineError(f"the upstream sent a malformed answer: {exc!r}") from None
        finally:
            self.in_flight -= 1


Sink = Callable[[Delta], object]


class _Stopped(Exception):
    """The sink has what it needs (its output was blocked): abort the upstream's answer."""


class _Answer(Response):
    """One streamed completion as it arrives: events parsed into deltas for ``sink``."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.status = 0
        self.error_body = b""
        self.sse = SSEParser(self._event)
        self.finish: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended it (vLLM says)
        self.usage: dict[str, Any] | None = None
        self.produced = 0

    def head(self, status: int, headers: dict[str, str]) -> None:
        self.status = status

    def body(self, data: bytes) -> None:
        if self.status == 200:
            self.sse.feed(data)
        elif len(self.error_body) < MAX_ERROR_BODY:
            self.error_body += data

    def end(self) -> None:
        if self.status == 200:
            self.sse.close()

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            return  # read on to the end, which keeps the connection reusable
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            # orjson is strict JSON; an upstream may write NaN or -Infinity (a logprob) as
            # Python's encoder does, which the standard library's parser takes.
            try:
                obj = json.loads(payload)
            except ValueError as exc:  # an event that is not JSON
                raise E.EngineError(f"the upstream sent a malformed event: {exc}") from None
        if not isinstance(obj, dict):
            raise E.EngineError("the upstream sent a malformed event: not an object")
        if obj.get("usage"):
            self.usage = obj["usage"]
        for ch in obj.get("choices") or ():
            if ch.get("index", 0):
                continue  # one choice is served (``n`` is 1)
            d = _choice_delta(ch)
            if d is not None:
                self.produced += d.tokens
                if self.sink(d):
                    raise _Stopped
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
                self.stop_sequence = stop_string(ch)
        if "error" in obj or obj.get("object") == "error":
            raise _event_error(obj)

    def upstream_prompt_tokens(self) -> int:
        """The prompt tokens the upstream reported (0: it sent none)."""
        n = (self.usage or {}).get("prompt_tokens")
        return n if isinstance(n, int) and n > 0 else 0

    def last(self, prompt_tokens: int, usage_source: str) -> Delta:
        u = self.usage or {}
        finish = finish_reason(self.finish)
        return Delta(
            "",
            0,
            finish,
            prompt_tokens,
            int(u.get("completion_tokens") or self.produced),
            usage=usage_details(u),
            stop_sequence=self.stop_sequence if finish == "stop" else None,
            usage_source=usage_source,
        )


class _Early(NamedTuple):
    """A request :meth:`_Completion.start_now` wrote before it was relayed."""

    sent: Sent
    answer: _Answer
    held: list[Delta]  # what arrived before the relay began
    path: str
    body: dict[str, Any]


class _Completion:
    """A streamed completion from the upstream. ``push`` hands each delta to a callback where
    its bytes arrive (the worker's path: no task wake-up per token); iterated, it is an async
    stream of deltas like any backend's. Closing either aborts the upstream's generation."""

    def __init__(self, backend: OpenAIUpstreamBackend, req: GenerationRequest) -> None:
        self.backend = backend
        self.req = req
        self._task: asyncio.Task[None] | None = None
        self._items: collections.deque[Delta] = collections.deque()
        self._ready = asyncio.Event()
        self._early: _Early | None = None
        self._answer: _Answer | None = None  # the answer being relayed
        # The request as written (path, body, JSON), made once: ``push`` sends the one
        # :meth:`start_now` made when it found no kept connection.
        self._made: tuple[str, dict[str, Any], bytes] | None = None
        self.large = envelope_chars({"messages": req.messages, "prompt": req.prompt}) >= (
            LARGE_PROMPT_CHARS
        )

    def _make(self) -> tuple[str, dict[str, Any], bytes]:
        """The upstream path, the body and its JSON (made once)."""
        if self._made is None:
            path, body = self.backend._body(self.req)
            self._made = (path, body, _json(body, self.large))
        return self._made

    def start_now(self) -> None:
        """Write the request to the upstream now, on a kept connection: ``generate`` calls
        this, so the upstream starts before the worker acknowledges the request and sets up
        its relay (that work then runs while the upstream prefills, off the first token's
        path). What arrives before :meth:`push` is held for it. A request ``push`` would
        refuse, or no kept connection: ``push`` sends it, as it always did."""
        b, req = self.backend, self.req
        http = b.http
        if http is None or req.remaining_tokens <= 0 or (req.resume_text and not b.can_resume(req)):
            return
        try:
            path, body, data = self._make()
        except Exception:  # push raises it where it always did
            return
        held: list[Delta] = []
        answer = _Answer(held.append)
        sent = http.send_now(path, data, self._headers(), answer)
        if sent is not None:
            b.in_flight += 1
            self._early = _Early(sent, answer, held, path, body)

    def _headers(self) -> dict[str, str]:
        # Traced, the upstream (vllm serve --otlp-traces-endpoint, ...) continues the trace.
        t = self.req.trace_headers
        return {**_JSON, **t} if t else _JSON

    async def push(self, sink: Sink) -> None:
        """Call ``sink`` with every delta, the last one (finish reason, usage) included; a
        true answer from ``sink`` ends the stream there (the upstream is aborted)."""
        b, req = self.backend, self.req
        http = b.http
        early, self._early = self._early, None
        if early is not None:
            if http is not None:
                await self._relay(http, early.path, early.body, early.answer, sink, early)
                return
            early.sent.abort()  # stopped meanwhile
            b.in_flight -= 1
        if req.remaining_tokens <= 0:
            # A migrated request whose budget the first replica used up: nothing to ask for.
            sink(Delta("", 0, "length"))
            return
        http = b.http
        if http is None:
            raise E.EngineError("the openai backend is stopped")
        if req.resume_text and not b.can_resume(req):
            # Asked to start over, it would splice a second answer onto the text the caller
            # has: the stream ends here with one retryable error instead.
            raise E.ReplicaLost(
                "the stream was cut off and this replica's upstream cannot continue a "
                "message where it stopped (continue_final_message); retry the request"
            )
        path, body, data = self._make()
        b.in_flight += 1
        await self._relay(http, path, body, _Answer(sink), sink, None, data)

    async def _relay(
        self,
        http: UpstreamHTTP,
        path: str,
        body: dict[str, Any],
        answer: _Answer,
        sink: Sink,
        early: _Early | None,
        data: bytes = b"",
    ) -> None:
        """The answer to ``sink``: the one written early (``early``: what came meanwhile
        first), or a request sent now; the last delta with the usage. Counted in flight."""
        b = self.backend
        sent = None
        self._answer = answer
        try:
            if early is not None:
                sent = early.sent
                for d in early.held:
                    if sink(d):
                        sent.abort()
                        return
                answer.sink = sink  # from here on, where the bytes arrive
            async with asyncio.timeout(b.timeout):
                await http.post(path, data, self._headers(), answer, sent)
            if answer.status != 200:
                text = answer.error_body.decode("utf-8", "replace")
                raise _upstream_error(answer.status, text)
            if answer.finish is None:
                # Cut short, not finished: llama-cpp-python's server ends the answer it is
                # writing this way when another request arrives (--interrupt_requests).
                raise E.EngineError(
                    "the upstream ended its answer without a finish reason (cut short; a "
                    "llama-cpp-python server does so for every new request unless started "
                    "with --interrupt_requests False)"
                )
            n, source = answer.upstream_prompt_tokens(), USAGE_UPSTREAM
            if not n:
                # No usage on its stream: counted here, once the answer ended (a request to
                # the upstream beside the stream may cut it: llama-cpp-python's server stops
                # the answer it is writing for any new request).
                n, source = await b.count_prompt(path, body)
        except _Stopped:
            return
        except (TimeoutError, OSError, UpstreamProtocolError) as exc:
            if isinstance(exc, OSError) and not answer.status:
                b._lost()  # unreachable: probe it again when it is back
            raise E.EngineError(f"the upstream failed: {type(exc).__name__}: {exc}") from None
        finally:
            b.in_flight -= 1
        sink(answer.last(n, source))

    def pause_reading(self) -> None:
        """Read nothing more of the upstream's answer until :meth:`resume_reading` (the
        worker's coalescing hold: its tokens wait in the socket, then come in one read)."""
        a = self._answer
        if a is not None and a.conn is not None:
            a.conn.pause(a)

    def resume_reading(self) -> None:
        a = self._answer
        if a is not None and a.conn is not None:
            a.conn.resume(a)

    # -- as an async iterator ---------------------------------------------------------------
    def __aiter__(self) -> _Completion:
        return self

    def _put(self, d: Delta) -> None:
        self._items.append(d)
        self._ready.set()

    async def __anext__(self) -> Delta:
        task = self._task
        if task is None:
            task = self._task = asyncio.ensure_future(self.push(self._put))
            task.add_done_callback(lambda _: self._ready.set())
        while not self._items:
            if task.done():
                task.result()  # its error, if it failed
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    async def aclose(self) -> None:
        early, self._early = self._early, None
        if early is not None:  # written early, never relayed
            early.sent.abort()
            self.backend.in_flight -= 1
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
