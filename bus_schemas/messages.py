"""Message models at the edges of the bus (pydantic v2), each with a type tag and descriptions.

The hot path (stream frames) uses plain dicts built by :mod:`bus_schemas.frames`; these
models define and document them and export JSON Schemas (``bus_schemas/schemas``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from bus_schemas import errors

# The longest heartbeat or report interval a member may announce (its expiry is a few of
# them): a longer one is held to it, so nothing outlives its silence by more than half an
# hour (an idle worker beats every 2 s by default).
MAX_INTERVAL_S = 600.0


def announced_interval(v: object) -> float:
    """An announced ``interval_s`` (a heartbeat's, a queue report's): a positive finite
    number (ValueError otherwise; a bool is not one), at most :data:`MAX_INTERVAL_S`."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"interval_s {v!r}")
    s = float(v)
    if not 0 < s < math.inf:
        raise ValueError(f"interval_s {v!r}")
    return min(s, MAX_INTERVAL_S)


MAX_STOP_SEQUENCES = 4
# The most prompts one ``/v1/completions`` request may hold (one choice each, as OpenAI's
# ``n`` is bounded): the bridge opens one generation per prompt.
MAX_PROMPTS = 128
MAX_CHOICES = 128  # ``n``, as OpenAI's API bounds it; prompts x choices at most MAX_PROMPTS
# What ``/v1/completions`` generates when the request names no ``max_tokens``: OpenAI's
# documented default, and vLLM's.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The ``max_tokens`` of a chat request that sets none while the gateway's default is the
# context (``ingress.default_max_tokens = 0``, as OpenAI and ``vllm serve`` do): more than
# any context holds. The engine lowers it to the room the prompt leaves (the sim, vLLM), or
# an upstream is sent no ``max_tokens`` at all; a key's TPM lowers it first (auth.ratelimit).
FILL_CONTEXT = 1 << 20
# Version 2: envelopes carry the client's messages as sent and its other fields in
# ``extra``; chunk frames may carry tool calls, logprobs, refusal, reasoning and embeddings.
SCHEMA_VERSION = 2


class _Edge(BaseModel):
    """Models that accept OpenAI-style input: unknown fields are ignored, not rejected."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Carried(BaseModel):
    """OpenAI-shaped objects tokenbus checks but does not own: fields it does not know are
    kept (and carried to the engine as sent)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _Wire(BaseModel):
    """Models defined by tokenbus itself: unknown fields from newer senders are kept."""

    model_config = ConfigDict(extra="allow")


def message_text(content: Any) -> str:
    """The text of a message's ``content``: the string, or its ``text`` (and ``refusal``)
    parts joined; images, audio and files have none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                t = part.get(kind) if kind in ("text", "refusal") else None
                if isinstance(t, str):
                    out.append(t)
        return "".join(out)
    return ""


def render_prompt(messages: Any, prompt: Any = None) -> str:
    """A plain-text rendering of a request's prompt, the one the simulator tokenises (and
    so the one its prefix cache and a router's KV index hash): each message as
    ``<|role|>text\n`` (text parts joined; images and audio left out; an assistant's tool
    calls as ``name(arguments)``), or the completion prompt as it is."""
    if messages is not None:
        out: list[str] = []
        for m in messages if isinstance(messages, list) else ():
            if not isinstance(m, dict):
                continue
            text = message_text(m.get("content"))
            calls = m.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                fn = (call.get("function") if isinstance(call, dict) else None) or {}
                if isinstance(fn, dict):
                    text += f"{fn.get('name')}({fn.get('arguments')})"
            role = m.get("role")  # a NATS client's value: not always a string
            out.append(f"<|{role if isinstance(role, str) else ''}|>{text}\n")
        return "".join(out)
    if is_token_ids(prompt):
        return token_ids_text(prompt)
    return prompt if isinstance(prompt, str) else ""


def is_token_ids(value: Any) -> bool:
    """Whether ``value`` is a token id prompt: a list of integers (none a bool), from 0."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def token_ids_text(ids: list[int]) -> str:
    """A token id prompt as text, for what reads prompts as text (the simulator, which takes
    this for its detokenization, and a router's KV index): each id as four or more hex
    digits, so the simulator counts one token per id below 65 536."""
    return "".join(f"{t:04x}" for t in ids)


def tool_call_text(call: Any) -> str:
    """What a tool call in the history says: a function call's ``arguments``, a custom
    tool call's ``input`` (both rendered into the prompt by chat templates)."""
    if not isinstance(call, dict):
        return ""
    fn, custom = call.get("function"), call.get("custom")
    if isinstance(fn, dict):
        return str(fn.get("arguments") or "")
    if isinstance(custom, dict):
        return str(custom.get("input") or "")
    return ""


# A claim-checked envelope (services/bodies.py): its ``CLAIMED`` parts travel as an object in
# JetStream, and ``claim`` names it: owner, id, size, sha256, chunks, and the text's
# characters as the gateway (ingress or bridge) counted them when it resolved it.
CLAIM = "claim"
CLAIMED = ("messages", "prompt", "input")


def envelope_chars(env: dict[str, Any]) -> int:
    """Characters of text an envelope carries (prompt, message texts, tool-call arguments
    and custom tool-call inputs, embedding inputs); images, audio and files are not text and
    count only as body size. A claim-checked envelope not resolved here: the gateway's count."""
    claim = env.get(CLAIM)
    if isinstance(claim, dict) and not any(k in env for k in CLAIMED):
        chars = claim.get("chars")
        return chars if isinstance(chars, int) and chars >= 0 else 0
    prompt: Any = env.get("prompt")
    n = len(token_ids_text(prompt)) if is_token_ids(prompt) else len(prompt or "")
    for m in env.get("messages") or ():
        if isinstance(m, dict):
            n += len(message_text(m.get("content")))
            n += sum(len(tool_call_text(call)) for call in _list(m.get("tool_calls")))
    for item in env.get("input") or ():
        n += len(item) if isinstance(item, str | list) else 1
    return n


def _list(value: Any) -> list[Any]:
    """``value`` if it is a list, else nothing (a client-shaped field of the wrong type)."""
    return value if isinstance(value, list) else []


class ImageURL(_Carried):
    url: str = Field(min_length=1, description="An http(s) URL or a data: URL.")


class InputAudio(_Carried):
    data: str = Field(description="Base64 audio.")
    format: str = Field(description="Audio format, e.g. wav or mp3.")


class ContentPart(_Carried):
    """One part of a multi-part message content: ``text``, ``image_url``, ``input_audio``,
    ``file``, ``refusal``, or a type an engine knows (``video_url``, ...), carried as sent.

    Only the payload of the part's own type is checked (a ``text`` part's ``text``, an
    ``image_url`` part's ``image_url``): OpenAI's parts allow other fields, so another
    type's payload field on a part is carried as sent and never read."""

    type: str = Field(min_length=1, description="Content part type.")
    text: StrictStr | Any = Field(
        default=None, union_mode="left_to_right", description="The text of a text part."
    )
    image_url: ImageURL | Any = Field(
        default=None, union_mode="left_to_right", description="The image of an image_url part."
    )
    input_audio: InputAudio | Any = Field(
        default=None, union_mode="left_to_right", description="An input_audio part's audio."
    )
    file: dict[str, Any] | Any = Field(
        default=None, union_mode="left_to_right", description="A file part's file."
    )
    refusal: StrictStr | Any = Field(
        default=None, union_mode="left_to_right", description="A refusal part's text."
    )

    @model_validator(mode="after")
    def _has_payload(self) -> ContentPart:
        own: dict[str, type[Any]] = {
            "text": str,
            "image_url": ImageURL,
            "input_audio": InputAudio,
            "file": dict,
            "refusal": str,
        }
        kind = own.get(self.type)
        if kind is None:
            return self
        value = getattr(self, self.type)
        if value is None:
            raise ValueError(f"a {self.type!r} content part needs a {self.type!r} field")
        if isinstance(value, kind):
            return self
        if issubclass(kind, BaseModel):
            try:  # the model's own message names the field that is wrong
                kind.model_validate(value)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in (self.type, *err["loc"]))
                raise ValueError(f"{where}: {err['msg']}") from None
        what = "a string" if kind is str else "an object"
        raise ValueError(f"a {self.type!r} content part's {self.type!r} must be {what}")

    @property
    def own_text(self) -> str:
        """The part's text: a ``text`` part's text or a ``refusal`` part's refusal."""
        if self.type in ("text", "refusal"):
            value = getattr(self, self.type)
            return value if isinstance(value, str) else ""
        return ""


class FunctionCall(_Carried):
    name: str = Field(description="The function called.")
    arguments: StrictStr = Field(description="Its arguments, a JSON string.")


class CustomCall(_Carried):
    name: str = Field(description="The custom tool called.")
    input: StrictStr = Field(description="Its input, free text.")


class ToolCall(_Carried):
    """A tool call in an assistant message of the history: a ``function`` call or a
    ``custom`` tool's call (other types are carried)."""

    id: str = Field(description="The call's id, answered by a tool message's tool_call_id.")
    type: str = Field(default="function", description="Tool type.")
    function: FunctionCall | None = Field(default=None, description="A function call's call.")
    custom: CustomCall | None = Field(default=None, description="A custom tool call's call.")

    @model_validator(mode="after")
    def _call(self) -> ToolCall:
        if self.type in ("function", "custom") and getattr(self, self.type) is None:
            raise ValueError(f"a {self.type} tool call needs a {self.type!r} object")
        return self

    @property
    def text(self) -> str:
        """What the call says (:func:`tool_call_text`)."""
        if self.function is not None:
            return self.function.arguments
        return self.custom.input if self.custom is not None else ""


class ChatMessage(_Carried):
    """One chat message, as in OpenAI's chat completions API (other fields are carried)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="Who wrote the message."
    )
    content: StrictStr | list[ContentPart] | None = Field(
        default=None, description="Message text, or a list of content parts."
    )
    name: StrictStr | None = Field(default=None, description="Optional author name.")
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="An assistant message's tool calls."
    )
    tool_call_id: StrictStr | None = Field(
        default=None, description="A tool message: the call it answers."
    )

    def text(self) -> str:
        """The message's text (parts joined) and its tool calls' arguments."""
        text = (
            message_text(self.content)
            if not isinstance(self.content, list)
            else "".join(p.own_text for p in self.content)
        )
        for call in self.tool_calls or ():
            text += call.text
        return text


class StreamOptions(_Edge):
    """OpenAI's ``stream_options``."""

    include_usage: StrictBool = Field(
        default=False, description="Send a last chunk with usage and no choices."
    )


class FunctionDef(_Carried):
    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$", description="Function name."
    )
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="The arguments' JSON Schema."
    )
    strict: bool | None = None


class Tool(_Carried):
    """A tool the model may call (``type: function``; other types are carried)."""

    type: str = Field(default="function", description="Tool type.")
    function: FunctionDef | None = None

    @model_validator(mode="after")
    def _function(self) -> Tool:
        if self.type == "function" and self.function is None:
            raise ValueError("a function tool needs a 'function' object")
        return self


class NamedToolChoice(_Carried):
    """A ``tool_choice`` object: a named ``function`` or ``custom`` tool, or
    ``allowed_tools`` (``{mode, tools}``, carried to the engine as sent)."""

    type: str = Field(default="function")
    function: dict[str, Any] | None = Field(default=None, description="{name} of the function.")
    custom: dict[str, Any] | None = Field(default=None, description="{name} of the custom tool.")
    allowed_tools: dict[str, Any] | None = Field(
        default=None, description="{mode, tools}: the tools the model may pick from."
    )

    @model_validator(mode="after")
    def _named(self) -> NamedToolChoice:
        if (
            self.type in ("function", "custom", "allowed_tools")
            and getattr(self, self.type) is None
        ):
            raise ValueError(f"a tool_choice of type {self.type} needs a {self.type!r} object")
        return self


class JSONSchemaFormat(_Carried):
    name: str = Field(min_length=1, max_length=64, description="Schema name.")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Carried):
    """``response_format``: text, JSON mode, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a 'json_schema' object")
        return self


class SamplingParams(_Wire):
    """Generation parameters tokenbus acts on, carried to the engine (the others travel in
    the envelope's ``extra``)."""

    type: Literal["sampling_params"] = "sampling_params"
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    max_tokens_set: bool = Field(
        default=True,
        description="False: the client sent no max_tokens and max_tokens is the gateway's "
        "default, which an engine that knows its context length lowers to what fits.",
    )
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="Sampling temperature; None: the engine's."
    )
    top_p: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Nucleus sampling mass; None: the engine's."
    )
    seed: int | None = Field(default=None, description="Seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, description="Stop sequences (at most 4).")


def _normalise_stop(v: Any) -> Any:
    """``stop`` as a list: one string is one sequence; an empty string stops at nothing, as
    OpenAI takes it, so it is dropped (an engine would stop before the first token)."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list):
        return [s for s in v if s != ""]
    return v


# Integer fields a request may write as JSON numbers with a zero fraction (``2.0``), which
# JSON Schema's ``integer`` (OpenAI's document) takes: read as the integer, and carried so.
WHOLE_NUMBER_FIELDS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "max_tool_calls",
        "n",
        "best_of",
        "seed",
        "logprobs",
        "top_logprobs",
        "dimensions",
    }
)


def whole_numbers(body: dict[str, Any]) -> None:
    """Rewrite, in place, a :data:`WHOLE_NUMBER_FIELDS` value written ``2.0`` as ``2``; any
    other value is left for validation to judge."""
    for name in WHOLE_NUMBER_FIELDS & body.keys():
        v = body[name]
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            body[name] = int(v)


class Resume(_Edge):
    """Where a response that was cut off continues (request migration)."""

    text: str = Field(description="The response text already delivered to the caller.")
    tokens: int = Field(ge=0, description="How many tokens that text was.")
    since: int = Field(
        default=0,
        ge=0,
        description="How many of those the attempt moved from had been given (resumed) "
        "when it started: it delivered tokens - since (what its supersede charges).",
    )


# Request fields tokenbus acts on: they travel as the envelope's own fields (params,
# messages, prompt, input, resume). Every other field of the body travels in ``extra``.
OWNED_FIELDS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "input",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "resume",
    }
)


def carried(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of a request body that tokenbus carries to the engine unchanged."""
    return {k: v for k, v in body.items() if k not in OWNED_FIELDS}


class _GenerationRequest(_Edge):
    """Fields shared by chat and text completion requests."""

    model: str = Field(min_length=1, max_length=256, description="Model to serve the request.")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Most tokens to generate (legacy name)."
    )
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Most tokens to generate."
    )
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None)
    resume: Resume | None = Field(
        default=None,
        description="tokenbus extension: continue a response cut off after `text` "
        "(clients set it when they move a request from a failed replica to another).",
    )
    stop: list[str] | None = Field(default=None, description="Stop sequence or sequences.")
    n: StrictInt | None = Field(
        default=1,
        description="Number of choices (the HTTP bridge sends one request per choice: a "
        "request on the bus holds one).",
    )
    stream: StrictBool | None = Field(
        default=False, description="Stream chunks as server-sent events."
    )
    stream_options: StreamOptions | None = Field(default=None)
    user: str | None = Field(default=None, description="End-user id (carried to the engine).")
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = Field(
        default=None
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return _normalise_stop(v)

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"the number of choices: from 1 to {MAX_CHOICES}")
        return v

    @property
    def choices(self) -> int:
        """How many choices to answer (``n``; 1 when not set)."""
        return self.n or 1

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and not all(k.isascii() and k.isdigit() for k in v):
            raise ValueError("logit_bias keys must be token ids")
        return v

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The engine-side parameters of this request."""
        asked = self.max_completion_tokens or self.max_tokens
        return SamplingParams(
            max_tokens=asked or default_max_tokens or FILL_CONTEXT,
            max_tokens_set=bool(asked),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=list(self.stop or []),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    """A chat completion request (OpenAI ``POST /v1/chat/completions``; NATS ``req.chat``).

    Fields not listed are carried to the engine unchanged."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    tools: list[Tool] | None = Field(default=None, description="Tools the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="Whether and which tool to call."
    )
    parallel_tool_calls: StrictBool | None = Field(default=None)
    response_format: ResponseFormat | None = Field(default=None)
    logprobs: StrictBool | None = Field(default=None, description="Return token log probabilities.")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    reasoning_effort: str | None = Field(default=None)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.type in ("function", "custom"):
            named = getattr(choice, choice.type) or {}
            name = named.get("name")
            if name not in self._tool_names(choice.type):
                raise ValueError(f"tool_choice: names {name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return self

    def _tool_names(self, kind: str) -> set[Any]:
        """The names of the request's tools of type ``kind`` (function or custom)."""
        if kind == "function":
            return {t.function.name for t in self.tools or () if t.function is not None}
        customs = [(t.model_extra or {}).get("custom") for t in self.tools or () if t.type == kind]
        return {c.get("name") for c in customs if isinstance(c, dict)}


class CompletionRequest(_GenerationRequest):
    """A text completion request (OpenAI ``POST /v1/completions``; NATS ``req.completions``).

    Fields not listed are carried to the engine unchanged. Over HTTP a list of prompts gets
    one choice per prompt and ``max_tokens: 0`` the prompt only (``echo``) or nothing; on
    the bus an envelope holds one prompt and at least one token to make
    (:func:`gateway.validation.envelope`)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = Field(
        description="The prompt, or a list of prompts (one choice each): text, or token ids "
        "(a list of integers, or a list of such lists); null: the empty prompt."
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="Most tokens to generate (16 when not set); 0: none (with echo, the "
        "prompt only).",
    )
    logprobs: StrictInt | None = Field(
        default=None, ge=0, le=20, description="Top logprobs per token."
    )
    echo: StrictBool | None = Field(
        default=None, description="The answer starts with the prompt (carried to the engine)."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v or is_token_ids(v):  # text, or one id prompt
            return v
        if all(is_token_ids(p) for p in v):  # a list of token id prompts
            if not all(p for p in v):
                raise ValueError("a token id prompt holds at least one token")
            return v
        ints = [t for p in v for t in (p if isinstance(p, list) else [p])]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ints):
            bad = min(ints)  # only a negative one fails is_token_ids
            raise ValueError(f"token id {bad} is not in the model's vocabulary (ids count from 0)")
        if any(isinstance(p, list) for p in v) or (
            any(isinstance(p, int) for p in v) and not is_token_ids(v)
        ):
            raise ValueError(
                "a list of prompts is all text, or all token ids (lists of integers); a "
                "token id prompt is a list of integers from 0"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("the list holds no prompt: send one or more")
        if isinstance(v, list) and not is_token_ids(v) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: one (text or token ids), or each of a list (null is the empty
        prompt)."""
        if is_token_ids(self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        if isinstance(self.prompt, list):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt or ""]

    @property
    def prompt_value(self) -> str | list[int]:
        """The (first) prompt, as sent: its text, or its token ids."""
        return self.prompts[0]

    @property
    def prompt_text(self) -> str:
        """The (first) prompt's text (token ids as :func:`render_prompt` writes them)."""
        return render_prompt(None, self.prompt_value)

    @property
    def generates(self) -> bool:
        """Whether the request asks for any token (``max_tokens: 0`` asks for none)."""
        return (self.max_completion_tokens or self.max_tokens) != 0

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """As a chat request's, but ``max_tokens`` defaults to OpenAI's 16, whatever
        ``default_max_tokens`` (chat's default) is."""
        return super().sampling(COMPLETIONS_DEFAULT_MAX_TOKENS)


MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Edge):
    """An embeddings request (OpenAI ``POST /v1/embeddings``; NATS ``req.embeddings``).

    Fields not listed (``dimensions``, ``encoding_format``, ``user``, an engine's own) are
    carried to the engine; ``encoding_format`` is also applied by the HTTP bridge."""

    model: str = Field(min_length=1, max_length=256, description="Embedding model.")
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="Text, texts, or token id lists to embed."
    )
    encoding_format: Literal["float", "base64"] | None = Field(default=None)
    dimensions: int | None = Field(default=None, ge=1, le=65536)
    user: str | None = None
    resume: Resume | None = None  # unused: embeddings are never resumed

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if not items:
            raise ValueError("input must not be empty")
        if isinstance(items[0], int):
            return v
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        if any(isinstance(s, str) and not s for s in items) or any(
            isinstance(s, list) and not s for s in items
        ):
            raise ValueError("inputs must not be empty")
        return v

    @property
    def inputs(self) -> list[Any]:
        """The inputs as a list (one string, or one token id list, is one input)."""
        v = self.input
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)

    @property
    def stream(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return False


class BodyClaim(_Wire):
    """Where a claim-checked envelope's ``messages``/``prompt``/``input`` are
    (services/bodies.py, docs/large-requests.md): one object in JetStream, or (``pull``) held
    by the caller, which sends it to the replica that asks."""

    owner: str = Field(description="The uploader's inbox root: tb.<process> or tbk.<key id>.")
    id: str = Field(description="The object's id: 32 random hex digits.")
    size: int = Field(ge=1, description="The object's bytes (msgpack of the claimed fields).")
    sha256: str | None = Field(
        default=None,
        description="The object's sha256, hex (absent on a claim by pull: it comes with the "
        "body's last chunk).",
    )
    pull: bool | None = Field(
        default=None,
        description="True: the caller holds the body and sends it to the replica that asks "
        "for it (a frame with header Tb-Body-Pull), on tb.v1.engine.~body.<replica>.<id>.<n>.",
    )
    chunks: int = Field(ge=1, description="Its chunks, of 256 KiB but the last.")
    chars: int = Field(default=0, ge=0, description="Characters of text it holds (limits).")


class Envelope(_Wire):
    """The request as it travels ingress -> stages -> router -> worker (msgpack body)."""

    type: Literal["envelope"] = "envelope"
    v: int = Field(default=SCHEMA_VERSION, description="Envelope version.")
    request_id: str = Field(description="Request id, also in the Tb-Request-Id header.")
    kind: Literal["chat", "completions", "embeddings"] = Field(
        description="Which OpenAI endpoint shape."
    )
    model: str = Field(description="Requested model.")
    messages: list[dict[str, Any]] | None = Field(
        default=None,
        description="Chat messages as the client sent them (chat only): content strings or "
        "part lists, assistant tool_calls, tool messages with tool_call_id.",
    )
    prompt: str | list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="Prompt text, or token ids (completions only)."
    )
    input: list[Any] | None = Field(
        default=None, description="Inputs to embed: strings or token id lists (embeddings only)."
    )
    params: SamplingParams = Field(description="Generation parameters tokenbus acts on.")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Every other field of the client's request (tools, tool_choice, "
        "response_format, logprobs, penalties, logit_bias, engine extensions...), carried to "
        "the engine unchanged.",
    )
    claim: BodyClaim | None = Field(
        default=None,
        description="Set when messages, prompt and input travel as an object in JetStream "
        "(a request over half of max_payload); they are absent from the envelope then.",
    )
    deadline_ms: int | None = Field(default=None, description="Absolute deadline, epoch ms.")
    principal: str | None = Field(default=None, description="Authenticated principal id.")
    filter_policy: dict[str, Any] | None = Field(
        default=None,
        description="Content filter policy the worker applies to the output stream "
        "(set by the filter stage; absent means no output scanning).",
    )
    resume: dict[str, Any] | None = Field(
        default=None,
        description="Continue after {text, tokens} already delivered (request migration): "
        "the engine generates what follows, max_tokens counting the tokens already sent.",
    )


def check_envelope(env: dict[str, Any]) -> None:
    """Raise :class:`errors.InvalidRequest` unless each field of ``env`` has its
    :class:`Envelope` type: what a stage checks before it acts on a decoded envelope."""
    try:
        Envelope.model_validate(env)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "envelope"
        raise errors.InvalidRequest(f"malformed envelope: {where}: {first['msg']}") from None


class Heartbeat(_Wire):
    """A replica's periodic announcement of itself and its load."""

    type: Literal["heartbeat"] = "heartbeat"
    replica: str = Field(description="Replica id (unique on the bus).")
    model: str = Field(description="Model served.")
    backend: str = Field(description="Backend kind: sim, openai or vllm.")
    in_flight: int = Field(description="Requests accepted and not finished.")
    running: int = Field(default=0, description="Sequences running in the engine.")
    waiting: int = Field(default=0, description="Sequences queued in the engine.")
    max_concurrency: int = Field(description="Most requests the replica takes at once.")
    kv_usage: float = Field(default=0.0, description="KV cache use, 0..1, where known.")
    tp: int = Field(default=1, description="Tensor parallel degree.")
    pool: str = Field(default="default", description="Pool tag for tiered routing.")
    site: str = Field(
        default="",
        description="The site the replica runs at (its leaf node, docs/deploy.md 'Sites'): "
        "a router prefers replicas at its own site while they have room. Empty: not said.",
    )
    host: str = Field(
        default="",
        max_length=255,
        description="The host the replica runs on, for operators (the console's Replicas "
        "page): the worker's `worker.host`, else its GPU host's bus login name, else the "
        "machine's host name. Empty: not said (a worker older than this field).",
    )
    pd_role: Literal["both", "prefill", "decode"] = Field(
        default="both",
        description="Prefill/decode disaggregation: `prefill` computes prompts and hands "
        "their KV cache on, `decode` generates (from a handed-over prompt or its own), "
        "`both` serves whole requests.",
    )
    draining: bool = Field(default=False, description="Takes no new requests.")
    endpoints: list[str] = Field(
        default_factory=lambda: ["chat", "completions"],
        description="Request kinds served: chat, completions, embeddings.",
    )
    aliases: list[str] = Field(
        default_factory=list,
        description="Other model names the replica answers to (a vllm worker's LoRA "
        "adapters, extra served names): requests for them are routed to it too.",
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at run time (docs/adapters.md), name -> the path "
        "it was loaded from; each is in `aliases` too while it takes requests (not while it "
        "drains to be unloaded).",
    )
    interval_s: float = Field(
        description="Seconds until the next heartbeat (longer while the replica is idle)."
    )
    max_model_len: int = Field(
        default=0, ge=0, description="The model's context length in tokens (0: not known)."
    )
    seq: int = Field(description="Increments with every heartbeat.")
    boot: str = Field(default="", description="Changes when the replica process restarts.")
    upstream: dict[str, Any] | None = Field(
        default=None,
        description="What the upstream of an openai worker can do, as probed or set: probed, "
        "stream_usage, continue_message, logprobs (true/false/null: not known), tokenize "
        "(its tokenize endpoint's form, or null), overridden (the fields set in config).",
    )
    kv_hashing: dict[str, Any] | None = Field(
        default=None,
        description="What makes its KV block hashes comparable (docs/routing.md): kind "
        "(`text`: the sim's, `vllm`), block_size, seed, algo and tokenizer (vllm), model and "
        "revision where known. A router that computes hashes otherwise refuses its KV events. "
        "Absent: no KV events.",
    )
    kv_check: dict[str, int] | None = Field(
        default=None,
        description="The closed loop on KV-cache hits since the replica started: requests "
        "that carried a router's prediction and got the engine's report, the predicted "
        "cached prompt tokens and the reported ones (`requests`, `predicted`, `reported`).",
    )
    perf: dict[str, float] | None = Field(
        default=None,
        description="Its engine's speed as learned from its own requests (the "
        "predicted_latency policy's inputs, docs/routing.md): samples, ttft_base_ms, "
        "prefill_ms_per_token, queue_ms_per_waiting, tpot_base_ms, tpot_ms_per_running. "
        "Absent until it served enough requests.",
    )
    ts_ms: int = Field(description="Send time, epoch ms.")


class AcceptFrame(_Wire):
    """First frame of a stream: who serves it (so the caller can cancel)."""

    t: Literal["a"] = Field(default="a", description="Frame type tag: accept.")
    replica: str = Field(description="Replica id.")
    request_id: str
    heartbeat_s: float = Field(
        default=1.0,
        description="The replica's heartbeat interval: a caller that hears no heartbeat for "
        "a few intervals may give the stream up as lost.",
    )
    rl: str | None = Field(
        default=None,
        description="x-ratelimit-* values for the response, name=value pairs joined by ';'.",
    )
    tp: str | None = Field(
        default=None,
        description="W3C traceparent of the replica's span for this request (when the replica "
        "traces): a caller that migrates the request sends it on in Tb-Trace-Link, and the "
        "next replica's span links to it.",
    )
    nr: int | None = Field(
        default=None,
        description="1: this replica's engine cannot continue this answer exactly once cut "
        "off (an upstream that starts over instead of continuing a final assistant "
        "message): a caller that already has text from it ends the stream with its error "
        "instead of migrating it.",
    )


class ChunkFrame(_Wire):
    """Generated text. Several tokens may be coalesced when the consumer is behind."""

    t: Literal["c"] = Field(default="c", description="Frame type tag: chunk.")
    d: str = Field(description="Delta text (may be empty when the chunk carries other output).")
    n: int = Field(description="Tokens in this chunk.")
    i: int = Field(description="Sequence number of the chunk, from 0.")
    tc: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tool-call deltas as OpenAI streams them: index, and id/type/function.name "
        "when a call starts, function.arguments fragments.",
    )
    lp: dict[str, Any] | None = Field(
        default=None,
        description="The choice's logprobs object for this chunk's tokens ({content: [...]} "
        "for chat, {tokens, token_logprobs, top_logprobs, text_offset} for completions).",
    )
    rf: str | None = Field(default=None, description="Refusal text delta.")
    rs: str | None = Field(default=None, description="Reasoning content delta.")
    em: dict[str, Any] | None = Field(
        default=None,
        description="Embeddings: {index, embedding} of one input (a list of floats).",
    )


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class FinalFrame(_Wire):
    """Last frame of a successful stream."""

    t: Literal["f"] = Field(default="f", description="Frame type tag: final.")
    finish_reason: Literal["stop", "length", "content_filter", "tool_calls"]
    usage: Usage
    stop_sequence: str | None = Field(
        default=None,
        description="The stop string that ended the answer (finish_reason stop): absent when "
        "the model stopped on its own, or the engine does not say which one matched.",
    )
    timings: dict[str, int] = Field(
        default_factory=dict, description="Stage marks, epoch ns (t0 client send ... t3)."
    )
    usage_source: Literal["upstream", "tokenized", "estimate"] | None = Field(
        default=None,
        description="Where usage.prompt_tokens came from when the engine did not count them "
        "(the openai backend): the upstream's usage, its tokenizer, or an estimate. Absent: "
        "the engine counted.",
    )
    kvt: dict[str, Any] | None = Field(
        default=None,
        description="A prefill's hand-over (prefill/decode disaggregation): vLLM's "
        "`kv_transfer_params` as the engine returned them (`do_remote_prefill`, "
        "`remote_engine_id`, `remote_block_ids`, ...), for the decode replica's request.",
    )


class ErrorBody(_Wire):
    code: str
    status: int
    message: str
    retryable: bool
    param: str | None = None
    headers: dict[str, str] | None = Field(
        default=None, description="HTTP headers for this error (Retry-After, x-ratelimit-*)."
    )


class ErrorFrame(_Wire):
    """Last frame of a failed request (from any stage or the worker)."""

    t: Literal["e"] = Field(default="e", description="Frame type tag: error.")
    error: ErrorBody


class WorkerAck(_Wire):
    """The worker's reply to the router's dispatch: taken, or refused with an error."""

    type: Literal["ack"] = "ack"
    ok: bool
    replica: str
    in_flight: int = 0
    error: ErrorBody | None = None


class CancelRequest(_Wire):
    """Abort a request on the replica serving it."""

    type: Literal["cancel"] = "cancel"
    request_id: str = Field(description="The request, for logs.")
    reply: str = Field(description="The caller's inbox of the stream: what names it.")


ADAPTER_NAME_MAX = 256  # as a request's model
ADAPTER_OPS = ("load", "unload", "list")


class AdapterCommand(_Wire):
    """A change of the LoRA adapters one replica serves (``subjects.worker_adapters``),
    answered with an :class:`AdapterReply`."""

    type: Literal["adapters"] = "adapters"
    op: Literal["load", "unload", "list"] = Field(description="What to do.")
    name: str = Field(
        default="",
        max_length=ADAPTER_NAME_MAX,
        description="The adapter's name: the model requests ask for (load, unload).",
    )
    path: str = Field(
        default="",
        max_length=4096,
        description="Where the replica's engine reads the adapter from (load): a folder on "
        "its host, or what the engine accepts (vLLM: a Hugging Face repository id too).",
    )
    drain_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Unload: how long requests already on the adapter may run before it "
        "goes; new ones go to other replicas at once.",
    )


class AdapterReply(_Wire):
    """A replica's answer to an :class:`AdapterCommand`."""

    type: Literal["adapters"] = "adapters"
    ok: bool
    replica: str
    model: str = Field(description="The base model the replica serves.")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="The run-time adapters loaded now, name -> path."
    )
    load_ms: float | None = Field(default=None, description="Load: how long it took.")
    drained: int | None = Field(
        default=None, description="Unload: requests on the adapter it waited for."
    )
    cut: int | None = Field(
        default=None,
        description="Unload: requests still on the adapter when drain_s ran out (they end "
        "with an error the caller may retry; another replica may hold the adapter).",
    )
    error: ErrorBody | None = None


EXPORTED: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": ChatCompletionRequest,
    "CompletionRequest": CompletionRequest,
    "EmbeddingRequest": EmbeddingRequest,
    "Envelope": Envelope,
    "Heartbeat": Heartbeat,
    "AcceptFrame": AcceptFrame,
    "ChunkFrame": ChunkFrame,
    "FinalFrame": FinalFrame,
    "ErrorFrame": ErrorFrame,
    "WorkerAck": WorkerAck,
    "CancelRequest": CancelRequest,
    "AdapterCommand": AdapterCommand,
    "AdapterReply": AdapterReply,
}
