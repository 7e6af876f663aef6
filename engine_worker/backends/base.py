"""The interface every engine backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class GenerationRequest:
    """What a backend needs to generate (decoded from the envelope)."""

    request_id: str
    kind: str
    model: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    # Request migration: the response so far (already delivered); generate what follows,
    # at most ``max_tokens - resume_tokens`` more.
    resume_text: str = ""
    resume_tokens: int = 0

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.resume_tokens)

    @classmethod
    def from_envelope(cls, env: dict[str, Any]) -> GenerationRequest:
        p = env.get("params") or {}
        return cls(
            request_id=str(env["request_id"]),
            kind=str(env.get("kind", "chat")),
            model=str(env.get("model", "")),
            max_tokens=int(p.get("max_tokens", 256)),
            temperature=float(p.get("temperature", 1.0)),
            top_p=float(p.get("top_p", 1.0)),
            seed=p.get("seed"),
            stop=list(p.get("stop") or []),
            messages=env.get("messages"),
            prompt=env.get("prompt"),
            resume_text=str((env.get("resume") or {}).get("text", "")),
            resume_tokens=max(0, int((env.get("resume") or {}).get("tokens", 0))),
        )

    def prompt_text(self) -> str:
        """A plain-text rendering of the prompt (backends with a tokenizer use templates)."""
        if self.messages is not None:
            return "".join(f"<|{m.get('role')}|>{m.get('content') or ''}\n" for m in self.messages)
        return self.prompt or ""


@dataclass(slots=True)
class Delta:
    """New output: text and how many tokens it holds. The last one has ``finish_reason``."""

    text: str
    tokens: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class DeltaStream(Protocol):
    """What ``generate`` returns: an async iterator of deltas that aborts when closed."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def __anext__(self) -> Delta: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    """An engine. ``generate`` aborts the request when its consumer closes it."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Load for heartbeats: running, waiting, kv_usage."""
        ...

    def generate(self, req: GenerationRequest) -> DeltaStream:
        """Start generating now; the stream aborts the request when closed early."""
        ...
