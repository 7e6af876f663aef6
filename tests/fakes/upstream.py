"""A small OpenAI-compatible HTTP server standing in for ``vllm serve``, SGLang and the like.

Used in-process by the ``openai`` backend's tests and as a separate process by end-to-end
tests::

    python -m tests.fakes.upstream --port 8123     # prints "READY 8123", serves until SIGTERM

or, inside an event loop::

    up = FakeUpstream()
    port = await up.start()          # base URL: up.url ("http://127.0.0.1:<port>/v1")
    ...
    await up.stop()

(``runner, port = await start()`` does the same with a plain ``aiohttp.web.AppRunner``.)

Endpoints (all under ``/v1``):

* ``POST /chat/completions`` (streamed or not). When the body has ``tools`` (and
  ``tool_choice`` is not ``"none"``) and the last message is not a ``tool`` message, the
  answer is a call to the first tool: id ``call_up_1``, arguments
  ``{"city": "Paris", "unit": "celsius"}`` streamed in 3 fragments, finish ``tool_calls``.
  Otherwise the text ``hello from upstream``, a word a chunk (cut at ``max_tokens`` words,
  finish ``length``; cut before a ``stop`` string found in it, finish ``stop`` with vLLM's
  ``stop_reason`` naming it; else ``stop``, ``stop_reason`` null), with ``logprobs.content``
  entries when ``logprobs`` is true (``top_logprobs`` alternatives each), and
  ``reasoning_content`` "thinking" first when ``chat_template_kwargs.enable_thinking`` is
  true. The last chunk carries usage (with
  ``prompt_tokens_details.cached_tokens`` 3) when ``stream_options.include_usage`` is true.
* ``POST /completions``: the same text as a text completion (``logprobs`` an int there).
* ``POST /embeddings``: a deterministic vector per input, ``dimensions`` long (default 8),
  as floats or base64 (``encoding_format``), with usage.
* ``GET /models``: the model ``upstream-model`` (with ``max_model_len`` when one is set),
  and the LoRA adapters loaded at run time (``parent``, ``root``), as vLLM lists them.
* ``POST /load_lora_adapter`` / ``POST /unload_lora_adapter`` (flavor ``vllm``; vLLM's
  runtime LoRA endpoints, on with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): load a name from a
  path that exists (400 when it does not, or when the name is loaded already), unload a
  loaded one (404 otherwise).
* ``GET /last_request``: the last POST body as received (``null`` before any);
  ``GET /requests``: all of them; ``DELETE /requests``: forget them.
  ``GET /last_headers``: the last POST's headers; ``GET /stats``: request and abort counts.

Flavors (``--flavor``, ``FakeUpstream(flavor=...)``) stand in for servers that differ where
tokenbus depends on them:

* ``vllm`` (the default): usage on streams; continues a final assistant message left open
  (``continue_final_message``); prompt tokens counted through a template
  (:func:`template_tokens`); vLLM's ``POST /tokenize`` (``{"count", "tokens"}``).
* ``llamacpp``: as llama-cpp-python's server: no usage on streams (whole answers have it),
  ignores ``continue_final_message`` (a final assistant message is closed and a new answer
  starts from its beginning), counts the prompt as a chat template renders it (see
  :func:`template_tokens`), and llama.cpp's ``POST /tokenize`` (``{"content"}`` ->
  ``{"tokens"}``).
* ``bare``: as ``llamacpp`` without any tokenize endpoint.
* ``closer``: as ``vllm``, but a final assistant message is closed (no generation prompt
  after it when ``add_generation_prompt`` is false) and the answer starts over.
* ``textcount``: as ``vllm``, but its usage counts the messages' words alone (no template
  tokens) and the answer starts over.

``"fake_words": N`` makes the answer ``word1 word2 ... wordN`` (a word a chunk) instead of
the three words; a flavor that continues a message left open goes on after the words that
message already holds. ``"fake_no_finish": true`` ends a streamed chat answer with
``[DONE]`` and no finish reason, as llama-cpp-python's server does to the answer it is
writing when another request arrives.

Any POST body with ``"fail_status": N`` is answered with status N and an OpenAI error body
(``"fake upstream failure N"``), and ``"fake_chunk_delay_s": S`` waits S seconds before each
streamed chunk (the ``--chunk-delay`` option sets a default).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import signal
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from aiohttp import web

MODEL = "upstream-model"
WORDS = ("hello", "from", "upstream")
TOOL_CALL_ID = "call_up_1"
TOOL_ARGUMENTS = ('{"city": ', '"Paris", "unit": ', '"celsius"}')
CACHED_TOKENS = 3


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }
    return _json(body, status)


def _count_words(value: Any) -> int:
    """A stand-in token count: the words of a prompt, messages or content parts."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_count_words(v) for v in value)
    if isinstance(value, dict):  # a message or a content part
        return _count_words(value.get("content")) + _count_words(value.get("text"))
    return 0


FLAVORS = ("vllm", "llamacpp", "bare", "closer", "textcount")
STREAM_USAGE = frozenset({"vllm", "closer", "textcount"})  # usage on streams
TOKENIZE = {"vllm": "vllm", "closer": "vllm", "textcount": "vllm", "llamacpp": "llama.cpp"}
DEFAULT_SYSTEM = "You are a helpful assistant"  # what the llamacpp flavor's template adds


def template_tokens(
    messages: list[Any],
    *,
    flavor: str = "llamacpp",
    continue_final: bool = False,
    generation_prompt: bool = True,
) -> int:
    """The prompt tokens of ``messages`` as ``flavor`` counts them: a ChatML-like template in
    words, 3 tokens a message around its words and 2 for the generation prompt.

    * ``llamacpp``, ``bare``: a system message of its own first when there is none (as
      SmolLM2's template does); the generation prompt always (a final assistant message is
      closed, not continued);
    * ``vllm``: a final assistant message left open (``continue_final``) costs 2 and its
      words, with no generation prompt after it;
    * ``closer``: leaves the generation prompt out when asked, but closes every message;
    * ``textcount``: the words alone, no template (as some proxies count).
    """
    msgs = [m for m in messages if isinstance(m, dict)]
    if flavor == "textcount":
        return max(1, sum(_count_words(m) for m in msgs))
    if flavor in ("llamacpp", "bare"):
        if not msgs or msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": DEFAULT_SYSTEM}, *msgs]
        generation_prompt = True
    elif flavor == "vllm" and continue_final and msgs and msgs[-1].get("role") == "assistant":
        return sum(3 + _count_words(m) for m in msgs[:-1]) + 2 + _count_words(msgs[-1])
    return sum(3 + _count_words(m) for m in msgs) + (2 if generation_prompt else 0)


def _left_open(body: dict[str, Any]) -> int:
    """Words already in a final assistant message left open (0: none)."""
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if body.get("continue_final_message") and last.get("role") == "assistant":
        return _count_words(last.get("content"))
    return 0


def _pieces(body: dict[str, Any], skip: int = 0) -> tuple[list[str], str, str | None]:
    """The text pieces to send (word by word), the finish reason and vLLM's ``stop_reason``:
    the stop string (of ``stop``) that ended the text, cut before it, or None. ``skip``:
    words of a ``fake_words`` answer already written (a message continued)."""
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    n_words = body.get("fake_words")
    if isinstance(n_words, int) and n_words > 0:
        words = [f"word{i}" for i in range(1, n_words + 1)]
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)][skip:]
    else:
        words = list(WORDS)
        pieces = [w if i == 0 else " " + w for i, w in enumerate(WORDS)]
    if isinstance(limit, int) and limit < len(pieces):
        pieces = pieces[: max(0, limit)]
    raw = body.get("stop")
    stops = [raw] if isinstance(raw, str) else [s for s in raw or () if isinstance(s, str) and s]
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        # As vLLM checks them: after each token, the first stop string (in the request's
        # order) found in the text ends it there; what streamed never passes it (vLLM holds
        # text back while it could still be the start of a stop string).
        hit = next((s for s in stops if s in text), None)
        if hit is not None:
            end, pos, out = text.find(hit), 0, []
            for p in pieces[: i + 1]:
                if p[: max(0, end - pos)]:
                    out.append(p[: max(0, end - pos)])
                pos += len(p)
            return out, "stop", hit
    if len(pieces) < len(words) - (skip if n_words else 0):
        return pieces, "length", None
    return pieces, "stop", None


def _token_logprob(piece: str, i: int, top: int) -> dict[str, Any]:
    """A chat ``logprobs.content`` entry for ``piece`` with ``top`` alternatives."""
    lp = round(-0.1 * (i + 1), 4)
    alternatives = [
        {"token": piece, "logprob": lp, "bytes": list(piece.encode())},
        *(
            {"token": f"alt{k}", "logprob": round(lp - k, 4), "bytes": list(f"alt{k}".encode())}
            for k in range(1, top)
        ),
    ][:top]
    return {
        "token": piece,
        "logprob": lp,
        "bytes": list(piece.encode()),
        "top_logprobs": alternatives,
    }


def _vector(item: Any, dims: int) -> list[float]:
    """A deterministic unit vector for an embedding input."""
    seed = zlib.crc32(json.dumps(item).encode())
    raw = [math.sin(seed * 0.001 + k * 1.7) for k in range(dims)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


class FakeUpstream:
    """The server; ``requests`` holds every POST body received, in order."""

    def __init__(
        self,
        chunk_delay: float = 0.0,
        model: str = MODEL,
        max_model_len: int | None = None,
        flavor: str = "vllm",
    ) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}")
        self.flavor = flavor
        self.chunk_delay = chunk_delay
        self.model = model
        self.max_model_len = max_model_len
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.aborted = 0
        self.loras: dict[str, str] = {}  # loaded at run time: name -> path
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/last_request", self.last_request)
        app.router.add_get("/v1/last_headers", self.last_headers)
        app.router.add_get("/v1/requests", self.all_requests)
        app.router.add_delete("/v1/requests", self.forget)
        app.router.add_get("/v1/stats", self.stats)
        if self.flavor in TOKENIZE:
            app.router.add_post("/tokenize", self.tokenize)
        if self.flavor == "vllm":
            app.router.add_post("/v1/load_lora_adapter", self.load_lora)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)
        return app

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
        if not name or not path:
            return _error(400, "both 'lora_name' and 'lora_path' must be provided.")
        if name in self.loras and not body.get("load_inplace"):
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if not Path(path).exists():
            return _error(400, f"No adapter found for {path}")
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        name = str((await request.json()).get("lora_name") or "")
        if self.loras.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (vllm flavor) or llama.cpp's (llamacpp): a token a word."""
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if TOKENIZE[self.flavor] == "vllm":
            text = body.get("prompt") if isinstance(body, dict) else None
            if not isinstance(text, str):
                return _error(400, "'prompt' must be a string")
            tokens = list(range(len(text.split())))
            return _json({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})
        text = body.get("content") if isinstance(body, dict) else None
        if not isinstance(text, str):
            return _error(500, "'content' must be a string")
        return _json({"tokens": list(range(len(text.split())))})

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Listen on ``port`` (0: a free one); returns the port."""
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- recording --------------------------------------------------------------------------
    async def _record(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The POST body (recorded), or the error response to send instead."""
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        status = body.get("fail_status")
        if isinstance(status, int) and status >= 400:
            return _error(status, f"fake upstream failure {status}")
        return body

    async def last_request(self, request: web.Request) -> web.Response:
        return _json(self.requests[-1] if self.requests else None)

    async def last_headers(self, request: web.Request) -> web.Response:
        return _json(self.headers[-1] if self.headers else None)

    async def all_requests(self, request: web.Request) -> web.Response:
        return _json(self.requests)

    async def forget(self, request: web.Request) -> web.Response:
        self.requests.clear()
        self.headers.clear()
        return _json({"ok": True})

    async def stats(self, request: web.Request) -> web.Response:
        return _json({"requests": len(self.requests), "aborted": self.aborted})

    async def models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "fake",
        }
        if self.max_model_len:
            model["max_model_len"] = self.max_model_len
        loras = [
            {"id": n, "object": "model", "parent": self.model, "root": p}
            for n, p in self.loras.items()
        ]
        return _json({"object": "list", "data": [model, *loras]})

    # -- streaming --------------------------------------------------------------------------
    async def _stream(
        self, request: web.Request, body: dict[str, Any], chunks: list[dict[str, Any]]
    ) -> web.StreamResponse:
        delay = float(body.get("fake_chunk_delay_s", self.chunk_delay) or 0)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            for chunk in chunks:
                if delay:
                    await asyncio.sleep(delay)
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return resp

    def _usage(
        self, body: dict[str, Any], prompt: Any, completion: int, reasoning: int
    ) -> dict[str, Any]:
        if isinstance(prompt, list):  # chat messages, through the flavor's template
            prompt_tokens = template_tokens(
                prompt,
                flavor=self.flavor,
                continue_final=bool(body.get("continue_final_message")),
                generation_prompt=body.get("add_generation_prompt") is not False,
            )
        else:
            prompt_tokens = max(1, _count_words(prompt))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        }

    # -- chat -------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list")
        model = body.get("model") or self.model
        rid = f"chatcmpl-fake{len(self.requests)}"
        created = int(time.time())
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage and self.flavor in STREAM_USAGE
        raw_tools = body.get("tools")
        tools: list[Any] = raw_tools if isinstance(raw_tools, list) else []
        last_role = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        call_tool = bool(tools) and body.get("tool_choice") != "none" and last_role != "tool"

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> Any:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            choice.update(extra)
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        if call_tool:
            first = tools[0] if isinstance(tools[0], dict) else {}
            name = str((first.get("function") or {}).get("name", "tool"))
            usage = self._usage(body, messages, len(TOOL_ARGUMENTS) + 1, 0)
            if not stream:
                call = {
                    "id": TOOL_CALL_ID,
                    "type": "function",
                    "function": {"name": name, "arguments": "".join(TOOL_ARGUMENTS)},
                }
                reply = {"role": "assistant", "content": None, "tool_calls": [call]}
                return self._completion(rid, created, model, reply, "tool_calls", usage)
            head = {
                "index": 0,
                "id": TOOL_CALL_ID,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            chunks = [chunk({"role": "assistant", "content": None, "tool_calls": [head]})]
            chunks += [
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
                for part in TOOL_ARGUMENTS
            ]
            chunks.append(chunk({}, "tool_calls"))
            return await self._stream(request, body, self._with_usage(chunks, include_usage, usage))

        pieces, finish, stop_reason = _pieces(
            body, _left_open(body) if self.flavor == "vllm" else 0
        )
        thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking"))
        want_logprobs = bool(body.get("logprobs"))
        top = int(body.get("top_logprobs") or 0)
        entries = [_token_logprob(p, i, top) for i, p in enumerate(pieces)]
        usage = self._usage(body, messages, len(pieces) + thinking, int(thinking))
        if not stream:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(pieces)}
            if thinking:
                message["reasoning_content"] = "thinking"
            logprobs = {"content": entries} if want_logprobs else None
            return self._completion(
                rid, created, model, message, finish, usage, logprobs, stop_reason
            )
        chunks = [chunk({"role": "assistant", "content": ""})]
        if thinking:
            chunks.append(chunk({"reasoning_content": "thinking"}))
        for piece, entry in zip(pieces, entries, strict=True):
            lp = {"content": [entry]} if want_logprobs else None
            chunks.append(chunk({"content": piece}, logprobs=lp))
        if not body.get("fake_no_finish"):  # else cut short, as an interrupted server does
            chunks.append(chunk({}, finish, stop_reason=stop_reason))
        return await self._stream(request, body, self._with_usage(chunks, include_usage, usage))

    @staticmethod
    def _with_usage(
        chunks: list[dict[str, Any]], include_usage: bool, usage: dict[str, Any]
    ) -> list[dict[str, Any]]:
        if include_usage:
            last = chunks[-1]
            chunks.append({**last, "choices": [], "usage": usage})
        return chunks

    @staticmethod
    def _completion(
        rid: str,
        created: int,
        model: str,
        message: dict[str, Any],
        finish: str,
        usage: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | None = None,
    ) -> web.Response:
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        return _json(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    # -- text completions -------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        model = body.get("model") or self.model
        rid = f"cmpl-fake{len(self.requests)}"
        created = int(time.time())
        pieces, finish, stop_reason = _pieces(body)
        n_logprobs = body.get("logprobs")
        usage = self._usage(body, body.get("prompt"), len(pieces), 0)

        def logprobs(piece: str, i: int, offset: int) -> dict[str, Any] | None:
            if n_logprobs is None or n_logprobs is False:
                return None
            lp = round(-0.1 * (i + 1), 4)
            top = {piece: lp, **{f"alt{k}": round(lp - k, 4) for k in range(1, int(n_logprobs))}}
            return {
                "tokens": [piece],
                "token_logprobs": [lp],
                "top_logprobs": [top],
                "text_offset": [offset],
            }

        def choice(text: str, lp: Any, finish_reason: str | None) -> dict[str, Any]:
            out = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:  # vLLM's: which stop string ended it, if one did
                out["stop_reason"] = stop_reason
            return out

        def wrap(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }

        if not body.get("stream"):
            text = "".join(pieces)
            parts = [logprobs(p, i, 0) for i, p in enumerate(pieces)]
            lp = None
            if parts and parts[0] is not None:
                lp = {
                    k: [x for part in parts if part is not None for x in part[k]]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
            return _json({**wrap([choice(text, lp, finish)]), "usage": usage})
        chunks, offset = [], 0
        for i, piece in enumerate(pieces):
            chunks.append(wrap([choice(piece, logprobs(piece, i, offset), None)]))
            offset += len(piece)
        chunks.append(wrap([choice("", None, finish)]))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage and self.flavor in STREAM_USAGE
        return await self._stream(request, body, self._with_usage(chunks, include_usage, usage))

    # -- embeddings -------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body, web.Response):
            return body
        raw = body.get("input")
        if isinstance(raw, str) or (
            isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)
        ):
            items: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            return _error(400, "'input' must be a string or a non-empty list")
        dims = body.get("dimensions") or 8
        if not isinstance(dims, int) or dims < 1:
            return _error(400, "'dimensions' must be a positive integer")
        b64 = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(items):
            vec = _vector(item, dims)
            emb: Any = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if b64 else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = sum(len(x) if isinstance(x, list) else max(1, _count_words(x)) for x in items)
        return _json(
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


async def start(port: int = 0, chunk_delay: float = 0.0) -> tuple[web.AppRunner, int]:
    """Start a fake upstream in this event loop; ``runner.cleanup()`` stops it."""
    up = FakeUpstream(chunk_delay=chunk_delay)
    port = await up.start(port)
    assert up.runner is not None
    return up.runner, port


async def _serve(host: str, port: int, chunk_delay: float, flavor: str = "vllm") -> None:
    up = FakeUpstream(chunk_delay=chunk_delay, flavor=flavor)
    port = await up.start(port, host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"READY {port}", flush=True)
    try:
        await stop.wait()
    finally:
        await up.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument(
        "--chunk-delay", type=float, default=0.0, help="Seconds before each streamed chunk."
    )
    parser.add_argument("--flavor", choices=FLAVORS, default="vllm", help="Which server to act.")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.chunk_delay, args.flavor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
