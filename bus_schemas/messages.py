"""Message models at the edges of the bus (pydantic v2), each with a type tag and descriptions.

The hot path (stream frames) uses plain dicts built by :mod:`bus_schemas.frames`; these
models define and document them and export JSON Schemas (``bus_schemas/schemas``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 4


class _Edge(BaseModel):
    """Models that accept OpenAI-style input: unknown fields are ignored, not rejected."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Wire(BaseModel):
    """Models defined by tokenbus itself: unknown fields from newer senders are kept."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Edge):
    """One text part of a multi-part message content."""

    type: Literal["text"] = Field(description="Content part type; only text is served.")
    text: str = Field(description="The text.")


class ChatMessage(_Edge):
    """One chat message, as in OpenAI's chat completions API."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote the message."
    )
    content: str | list[TextPart] | None = Field(
        default=None, description="Message text, or a list of text parts."
    )
    name: str | None = Field(default=None, description="Optional author name.")

    def text(self) -> str:
        """The message's text with parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Edge):
    """OpenAI's ``stream_options``."""

    include_usage: bool = Field(
        default=False, description="Send a last chunk with usage and no choices."
    )


class SamplingParams(_Wire):
    """Generation parameters carried to the engine."""

    type: Literal["sampling_params"] = "sampling_params"
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, description="Stop sequences (at most 4).")


def _normalise_stop(v: Any) -> Any:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return v


class Resume(_Edge):
    """Where a response that was cut off continues (request migration)."""

    text: str = Field(description="The response text already delivered to the caller.")
    tokens: int = Field(ge=0, description="How many tokens that text was.")


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
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None)
    resume: Resume | None = Field(
        default=None,
        description="tokenbus extension: continue a response cut off after `text` "
        "(clients set it when they move a request from a failed replica to another).",
    )
    stop: list[str] | None = Field(default=None, description="Stop sequence or sequences.")
    n: int = Field(default=1, description="Number of choices; only 1 is served.")
    stream: bool = Field(default=False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None)
    user: str | None = Field(default=None, description="End-user id (not used for routing yet).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return _normalise_stop(v)

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The engine-side parameters of this request."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=list(self.stop or []),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    """A chat completion request (OpenAI ``POST /v1/chat/completions``; NATS ``req.chat``)."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")


class CompletionRequest(_GenerationRequest):
    """A text completion request (OpenAI ``POST /v1/completions``; NATS ``req.completions``)."""

    prompt: str | list[str] = Field(description="The prompt; a list must hold exactly one.")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ValueError("exactly one prompt is supported")
            self.prompt = self.prompt[0]
        return self

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class Envelope(_Wire):
    """The request as it travels ingress -> stages -> router -> worker (msgpack body)."""

    type: Literal["envelope"] = "envelope"
    v: int = Field(default=1, description="Envelope version.")
    request_id: str = Field(description="Request id, also in the Tb-Request-Id header.")
    kind: Literal["chat", "completions"] = Field(description="Which OpenAI endpoint shape.")
    model: str = Field(description="Requested model.")
    messages: list[dict[str, Any]] | None = Field(
        default=None, description="Chat messages as {role, content} (chat only)."
    )
    prompt: str | None = Field(default=None, description="Prompt text (completions only).")
    params: SamplingParams = Field(description="Generation parameters.")
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
    draining: bool = Field(default=False, description="Takes no new requests.")
    interval_s: float = Field(description="Seconds until the next heartbeat.")
    seq: int = Field(description="Increments with every heartbeat.")
    boot: str = Field(default="", description="Changes when the replica process restarts.")
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


class ChunkFrame(_Wire):
    """Generated text. Several tokens may be coalesced when the consumer is behind."""

    t: Literal["c"] = Field(default="c", description="Frame type tag: chunk.")
    d: str = Field(description="Delta text.")
    n: int = Field(description="Tokens in this chunk.")
    i: int = Field(description="Sequence number of the chunk, from 0.")


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FinalFrame(_Wire):
    """Last frame of a successful stream."""

    t: Literal["f"] = Field(default="f", description="Frame type tag: final.")
    finish_reason: Literal["stop", "length", "content_filter"]
    usage: Usage
    timings: dict[str, int] = Field(
        default_factory=dict, description="Stage marks, epoch ns (t0 client send ... t3)."
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


EXPORTED: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": ChatCompletionRequest,
    "CompletionRequest": CompletionRequest,
    "Envelope": Envelope,
    "Heartbeat": Heartbeat,
    "AcceptFrame": AcceptFrame,
    "ChunkFrame": ChunkFrame,
    "FinalFrame": FinalFrame,
    "ErrorFrame": ErrorFrame,
    "WorkerAck": WorkerAck,
    "CancelRequest": CancelRequest,
}
