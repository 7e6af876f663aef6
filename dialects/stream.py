"""What the NATS client's streams of the dialects share (:class:`dialects.anthropic.MessageStream`,
:class:`dialects.responses.ResponseStream`): an async iterator of one answer's events, read
whole by :meth:`ClientStream.collect` and stopped by :meth:`ClientStream.aclose`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from typing import Any

from services.caller import Stream


class ClientStream(ABC):
    """One answer over NATS as its events: ``submit`` sends the translated chat request and
    gives its chat stream (``stream`` once sent); a subclass makes the events
    (:meth:`_events`) and says what the whole answer is once they end (:meth:`_whole`)."""

    def __init__(self, submit: Callable[[dict[str, Any]], Stream]) -> None:
        self.stream: Stream | None = None
        self._submit = submit
        self._gen = self._events()

    def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        return self._gen

    @abstractmethod
    def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The events, in order (an async generator: nothing is sent before the first)."""

    @abstractmethod
    def _whole(self) -> dict[str, Any] | None:
        """The whole answer once the events have ended (None before)."""

    async def collect(self) -> dict[str, Any]:
        """The whole answer (the events read and dropped)."""
        async for _ in self:
            pass
        whole = self._whole()
        assert whole is not None
        return whole

    async def aclose(self) -> None:
        """Stop the request."""
        await self._gen.aclose()
        if self.stream is not None:
            await self.stream.aclose()
