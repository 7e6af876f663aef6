"""What a caller's stream gives: its chunks (:class:`Chunk`), the usage of its end, a whole
completion or embeddings answer, and the rerun of a request lost with its process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bus_schemas.side_outputs import GENERATION, WIRE_KEYS, carries

_carries_side = carries(GENERATION)


@dataclass(slots=True)
class Chunk:
    """Output from one stream frame: text (one or more tokens) and, when the engine sends
    them, tool-call deltas (OpenAI's streaming shape), the logprobs object of these tokens,
    refusal or reasoning text, or one embedding (``{"index", "embedding"}``): the side
    outputs of :mod:`bus_schemas.side_outputs`, in its order."""

    text: str
    tokens: int
    index: int
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: dict[str, Any] | None = None
    refusal: str | None = None
    reasoning: str | None = None
    embedding: dict[str, Any] | None = None

    @property
    def has_side(self) -> bool:
        """Whether the chunk carries output beside its text (an embedding aside)."""
        return _carries_side(self)


def side_chunk(frame: dict[str, Any], text: str, n: int, i: int) -> Chunk:
    """A chunk frame that carries more than text."""
    return Chunk(text, n, i, *map(frame.get, WIRE_KEYS))


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object."""
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.prompt_tokens_details is not None:
            out["prompt_tokens_details"] = self.prompt_tokens_details
        if self.completion_tokens_details is not None:
            out["completion_tokens_details"] = self.completion_tokens_details
        return out


@dataclass(slots=True)
class Completion:
    """A whole (non-streamed) result."""

    request_id: str
    model: str
    text: str
    finish_reason: str
    usage: Usage
    replica: str | None
    timings: dict[str, int] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: dict[str, Any] | None = None
    refusal: str | None = None
    reasoning: str | None = None
    # The stop string that ended the answer (finish ``stop``); None when the model stopped on
    # its own or the engine does not say.
    stop_sequence: str | None = None
    # The class that served it (``service_tier``: priority, default, flex).
    service_tier: str | None = None


@dataclass(slots=True)
class EmbeddingResult:
    """The answer to an embeddings request: one vector per input, in order."""

    request_id: str
    model: str
    embeddings: list[list[float]]
    usage: Usage
    replica: str | None


@dataclass(slots=True)
class Rerun:
    """A request run again from the start in another process because the one running it
    died (a background response whose runner was lost before its end was kept). Its attempts
    are numbered from ``first``; ``ticket``, the admission of the lost run's last attempt,
    proves that attempt was admitted, so the limiter charges it what its caller got from it:
    nothing, since the new run starts over and only its answer is given. ``on_accept(attempt,
    ticket)`` hears each admission of this run, for the one that may run it next to keep."""

    first: int = 0
    ticket: str = ""
    on_accept: Callable[[int, str], None] | None = None
