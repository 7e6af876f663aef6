"""The parts of the ``vllm`` backend that talk vLLM's OpenAI serving layer, without vLLM.

The backend runs vLLM's own ``vllm serve`` front end in-process (see docs/vllm.md): the
serving classes that ``vllm serve`` builds (``OpenAIServingChat``, ``OpenAIServingCompletion``,
``ServingEmbedding``) over its ``AsyncLLM``, fed vLLM's own protocol request models. This
module holds what sits between them and tokenbus, none of which imports vLLM:

* :func:`load_vllm`: the vLLM names the backend uses (:data:`VLLM_NAMES`), imported from
  where vLLM 0.33 keeps them;
* :func:`serve_argv`: ``worker.vllm.engine_args`` as ``vllm serve`` command-line flags, so
  vLLM's own parser reads them (engine and front-end options alike);
* :func:`chat_body`, :func:`completion_body`, :func:`embedding_body`: the OpenAI request body
  vLLM's protocol models are built from (the client's messages and ``extra`` fields, and the
  fields tokenbus owns);
* :class:`StreamDecoder`: vLLM's streamed server-sent events back into :class:`Delta`;
* :func:`error_for_status`: an HTTP status from vLLM's ``ErrorResponse`` as a typed error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

# About 4x faster than json on the chunks decoded per token (a tokenbus dependency, and
# vLLM's).
from orjson import loads as _loads

from bus_schemas import errors as E
from engine_worker.backends.base import Delta, GenerationRequest
from engine_worker.backends.openai_shape import (
    USAGE_DETAILS,
    chat_messages,
    choice_delta,
    finish_reason,
    has_output,
    set_sampling,
    stop_string,
    usage_details,
)

# The vLLM release this module is written and checked against (pyproject pins its minor).
VLLM_VERSION = "0.33.0"

# name -> module it is imported from in vLLM 0.33.
VLLM_NAMES: dict[str, str] = {
    "FlexibleArgumentParser": "vllm.utils.argparse_utils",
    "make_arg_parser": "vllm.entrypoints.common.cli_args",
    "validate_parsed_serve_args": "vllm.entrypoints.common.cli_args",
    "init_parser_plugin": "vllm.entrypoints.common.cli_args",
    "validate_api_server_args": "vllm.entrypoints.common.cli_args",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
    "UsageContext": "vllm.usage.usage_lib",
    "AsyncLLM": "vllm.v1.engine.async_llm",
    "EngineDeadError": "vllm.v1.engine.exceptions",
    "StatLoggerBase": "vllm.v1.metrics.loggers",
    "init_app_state": "vllm.entrypoints.launchers.api_server.app_state",
    "State": "starlette.datastructures",
    # The HTTP request vLLM's serving layer reads the trace headers from (tracing on).
    "Request": "starlette.requests",
    "ChatCompletionRequest": "vllm.entrypoints.openai.chat_completion.protocol",
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "EmbeddingRequest": "vllm.entrypoints.pooling.embed.protocol",
    "ErrorResponse": "vllm.entrypoints.serve.engine.protocol",
    # LoRA adapters loaded at run time (vLLM's /v1/load_lora_adapter; docs/adapters.md).
    "LoadLoRAAdapterRequest": "vllm.entrypoints.serve.lora.protocol",
    "UnloadLoRAAdapterRequest": "vllm.entrypoints.serve.lora.protocol",
    "create_error_response": "vllm.entrypoints.serve.exception_handling.error_response",
}


def load_vllm() -> SimpleNamespace:
    """vLLM's names in :data:`VLLM_NAMES`, as attributes (imports vLLM and torch)."""
    import importlib

    out: dict[str, Any] = {}
    for name, module in VLLM_NAMES.items():
        try:
            out[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(
                f"the vllm backend needs vLLM {VLLM_VERSION} (pip install 'tokenbus[vllm]'): "
                f"cannot import {name} from {module}: {exc}"
            ) from exc
    return SimpleNamespace(**out)


# -- vllm serve's command line ------------------------------------------------------------------
def _find_action(parser: Any, key: str) -> tuple[str, Any]:
    """The option string and argparse action of ``key`` (``max_model_len``, ``max-model-len``
    or a short alias such as ``tp``) in vLLM's ``vllm serve`` parser."""
    actions: Mapping[str, Any] = parser._option_string_actions
    dashed = key.replace("_", "-")
    for opt in (f"--{dashed}", f"-{dashed}", f"-{key}", f"--{key}"):
        action = actions.get(opt)
        if action is not None:
            return opt, action
    raise ValueError(f"{key!r} is not a `vllm serve` option (engine or front-end)")


def _flag(opt: str, action: Any, value: Any) -> list[str]:
    """A no-value option for a boolean ``value``: store_true, ``--x/--no-x``, or vLLM's
    ``--enable-x/--disable-x`` (whose negative strings it lists in
    ``negative_option_strings``). ``disable_x=True`` works as well as ``enable_x=False``."""
    truthy = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    negatives = set(getattr(action, "negative_option_strings", None) or ()) or {
        o for o in action.option_strings if o.startswith("--no-")
    }
    wanted = truthy != (opt in negatives)  # the value the option's destination should get
    if wanted:
        if opt not in negatives:
            return [opt]
        positives = [o for o in action.option_strings if o not in negatives]
        return positives[:1]
    if opt in negatives:
        return [opt]
    if negatives:
        return [sorted(negatives)[0]]
    return []  # a store_true option left unset is off


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def serve_argv(options: Mapping[str, Any], parser: Any) -> list[str]:
    """``options`` (``worker.vllm.engine_args``: engine and front-end options by name) as
    ``vllm serve`` flags for ``parser`` (``make_arg_parser(FlexibleArgumentParser())``).

    Values are written as a person writes them on the command line, so vLLM parses them as
    ``vllm serve`` does (``32k``, JSON objects, ``name=path`` LoRA modules, ``--no-x``).
    Raises ValueError for a name ``vllm serve`` does not know.
    """
    argv: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        opt, action = _find_action(parser, key)
        if action.nargs == 0:
            argv += _flag(opt, action, value)
        elif action.nargs in ("+", "*"):
            if isinstance(value, Mapping):
                items = [f"{k}={v}" for k, v in value.items()]
            elif isinstance(value, list | tuple):
                items = [_value(v) for v in value]
            else:
                items = [_value(value)]
            if items:
                argv += [opt, *items]
        else:
            argv += [opt, _value(value)]
    return argv


# -- request bodies -------------------------------------------------------------------------
# Streamed with a usage object on every chunk: its completion_tokens gives each delta's
# token count, the last one the totals.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}

# Structured-output fields vLLM removed (they are ignored there with a warning) and the
# ``structured_outputs`` key that replaced each.
_LEGACY_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}
_LEGACY_DROPPED = ("guided_decoding_backend",)


def _carried(req: GenerationRequest) -> dict[str, Any]:
    """The client's own fields, legacy ``guided_*`` ones turned into ``structured_outputs``."""
    body = dict(req.extra)
    if any(k in body for k in _LEGACY_GUIDED) or any(k in body for k in _LEGACY_DROPPED):
        structured: dict[str, Any] = {}
        for old, new in _LEGACY_GUIDED.items():
            if old in body:
                value = body.pop(old)
                if value is not None:
                    structured[new] = value
        for old in _LEGACY_DROPPED:
            body.pop(old, None)
        if structured and body.get("structured_outputs") is None:
            body["structured_outputs"] = structured
    return body


def _owned(body: dict[str, Any], req: GenerationRequest, model: str) -> None:
    """The fields tokenbus owns: model, one streamed choice, the sampling values set."""
    body["model"] = model
    body["n"] = 1
    body["stream"] = True
    body["stream_options"] = dict(STREAM_OPTIONS)
    body["request_id"] = req.request_id
    # Unset values stay unset: vLLM then applies the model's generation_config defaults.
    set_sampling(body, req)


def chat_body(req: GenerationRequest, model: str) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body for ``req`` (a ``ChatCompletionRequest``'s input).

    A migrated request (``resume_text``) continues the assistant's reply: the text already
    delivered becomes a final assistant message that the template leaves open
    (``continue_final_message``), appended to the client's own prefill when it sent one.
    """
    body = _carried(req)
    body["messages"] = chat_messages(req, body)
    if req.resume_text:
        body["echo"] = False  # the caller has the text already
    body["max_completion_tokens"] = req.engine_max_tokens  # None: vLLM fills the context
    _owned(body, req, model)
    return body


def completion_body(req: GenerationRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body for ``req``; a migrated request's prompt is followed by
    the text already delivered."""
    body = _carried(req)
    # Token ids go as sent: vLLM takes them as its own (a migration starts them over).
    body["prompt"] = (
        req.prompt if isinstance(req.prompt, list) else (req.prompt or "") + req.resume_text
    )
    if req.resume_text:
        body["echo"] = False
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = req.engine_max_tokens  # None: vLLM fills the context
    _owned(body, req, model)
    return body


def embedding_body(req: GenerationRequest, model: str) -> dict[str, Any]:
    """The ``/v1/embeddings`` body: the client's fields (``dimensions``, ``user``...), its
    inputs, and float vectors (the bridge encodes them as the client asked)."""
    body = dict(req.extra)
    body["model"] = model
    body["input"] = req.input if req.input is not None else []
    body["encoding_format"] = "float"
    body["request_id"] = req.request_id
    return body


# -- streamed output ------------------------------------------------------------------------
# vLLM's finish reasons (after its chat tool parser) map onto ours (``repetition`` becomes
# "stop"); "abort" (the engine dropped a request we did not cancel) raises instead, "error"
# arrives as an error event.


class ErrorEvent(Exception):
    """vLLM streamed an error object (``{"error": {message, type, param, code}}``)."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        super().__init__(str(info.get("message", "")))
        self.info = info


class StreamDecoder:
    """Turns the server-sent events of vLLM's streaming chat or completion generator into
    :class:`Delta` objects.

    Each event is ``data: <chunk JSON>\\n\\n`` (a ``ChatCompletionStreamResponse`` or
    ``CompletionStreamResponse``), then ``data: [DONE]``. With :data:`STREAM_OPTIONS` every
    chunk has a usage object whose ``completion_tokens`` counts the tokens so far; the chunk
    with a ``finish_reason`` is followed by one usage chunk without choices. The delta that
    finishes is held back until then so that it carries the totals.
    """

    __slots__ = (
        "_details",
        "_last",
        "chat",
        "completion_tokens",
        "finish",
        "prompt_tokens",
        "stop_sequence",
    )

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended it
        self._last: Delta | None = None
        self._details: dict[str, Any] | None = None

    def feed(self, event: str) -> Delta | None:
        """The delta in ``event``, the final delta at ``[DONE]``, or None (nothing new).

        Raises :class:`ErrorEvent` for an error event and EngineError for a stream that ends
        without finishing or that vLLM aborted.
        """
        if not event.startswith("data:"):
            return None  # an SSE comment (keep-alive)
        data = event[5:].strip()
        if data == "[DONE]":
            return self.final()
        return self.take(_loads(data))

    def feed_chunk(self, chunk: Any) -> Delta | None:
        """The delta in one of the objects vLLM's raw chat generator yields (a
        ``ChatCompletionStreamResponse`` or an ``ErrorResponse``), as :meth:`feed` reads the
        same chunk serialised: no JSON in between. The stream's end is the generator's."""
        return self.take(chunk_dict(chunk))

    def take(self, obj: dict[str, Any]) -> Delta | None:
        """The delta in one decoded chunk (a dict of the chunk's JSON shape), or None."""
        choices = obj.get("choices")
        if choices is None and "error" in obj:
            raise ErrorEvent(obj["error"] or {})
        n = 0
        usage = obj.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or self.prompt_tokens
            total = usage.get("completion_tokens") or 0
            if total > self.completion_tokens:
                n = total - self.completion_tokens
                self.completion_tokens = total
        if not choices:
            if usage:
                self._details = usage_details(usage)
            if n and self._last is not None:
                self._last.tokens += n
            return None
        d = choice_delta(choices[0], n)
        finish = choices[0].get("finish_reason")
        if finish is not None:
            self.finish = str(finish)
            self.stop_sequence = stop_string(choices[0])
            self._last = d
            return None
        if n or has_output(d):
            return d
        return None

    def final(self) -> Delta:
        """The delta that ends the stream, with the finish reason and the totals."""
        if self.finish is None or self._last is None:
            raise E.EngineError("vLLM ended the stream without finishing the request")
        if self.finish == "abort":
            raise E.EngineError("the vLLM engine aborted the request")
        d = self._last
        d.finish_reason = finish_reason(self.finish)
        if d.finish_reason == "stop":
            d.stop_sequence = self.stop_sequence
        d.prompt_tokens = self.prompt_tokens
        d.completion_tokens = self.completion_tokens
        d.usage = self._details
        return d


def _json(model: Any) -> Any:
    """A part of a chunk as its JSON would have it (``exclude_unset``, as vLLM serialises)."""
    dump = getattr(model, "model_dump", None)
    return model if dump is None else dump(mode="json", exclude_unset=True)


def chunk_dict(chunk: Any) -> dict[str, Any]:
    """What :class:`StreamDecoder` reads of a vLLM chat chunk object, in the shape of its
    JSON: the first choice's delta (content, reasoning, tool calls, refusal), logprobs,
    finish and stop reasons, and usage; ``{"error": ...}`` for an ``ErrorResponse``. Plain
    attribute reads for what every token carries; sub-models are dumped only when present.
    A chunk that is already a dict of that shape is taken as it is."""
    if isinstance(chunk, dict):
        return chunk
    choices = getattr(chunk, "choices", None)
    if choices is None:
        return {"error": _json(getattr(chunk, "error", None)) or {}}
    out: dict[str, Any] = {"choices": choices}
    if choices:
        c = choices[0]
        d = c.delta
        delta: dict[str, Any] = {"content": d.content}
        reasoning = getattr(d, "reasoning", None)
        if reasoning:
            delta["reasoning"] = reasoning
        if d.tool_calls:
            delta["tool_calls"] = [_json(tc) for tc in d.tool_calls]
        refusal = getattr(d, "refusal", None)
        if refusal:
            delta["refusal"] = refusal
        choice: dict[str, Any] = {"delta": delta, "finish_reason": c.finish_reason}
        if c.logprobs is not None:
            choice["logprobs"] = _json(c.logprobs)
        stop = getattr(c, "stop_reason", None)
        if stop is not None:
            choice["stop_reason"] = stop
        out["choices"] = [choice]
    u = chunk.usage
    if u is not None:
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
        for k in USAGE_DETAILS:
            v = getattr(u, k, None)
            if v is not None:
                usage[k] = _json(v)
        out["usage"] = usage
    return out


# -- errors ---------------------------------------------------------------------------------
def error_for_status(
    status: int, message: str, param: str | None = None, *, engine_dead: bool = False
) -> E.TokenbusError:
    """A typed error for an HTTP status vLLM's front end answered (``ErrorResponse``).

    4xx: the request's fault, not retried elsewhere (404: a model or LoRA adapter this
    replica does not serve; 501: a feature the model or server lacks). 503: vLLM refused
    it for load (queue full): another replica may take it. Anything else: an engine failure,
    retryable.
    """
    message = (message or "vLLM rejected the request")[:500]
    if engine_dead:
        return E.EngineError("the vLLM engine process died; the replica must be restarted")
    if status == 404:
        return E.ModelNotFound(message, param=param or "model")
    if status == 503:
        return E.ReplicaBusy(f"vLLM is overloaded: {message}")
    if 400 <= status < 500 or status == 501:
        return E.InvalidRequest(message, param=param)
    return E.EngineError(f"vLLM failed the request: {message}")
