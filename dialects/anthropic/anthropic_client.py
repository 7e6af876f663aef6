"""The NATS client's Messages answer (:class:`MessageStream`, for
:meth:`tokenbus.Client.messages`): the request translated, sent on the chat path and its
events built as they come (on :class:`dialects.stream.ClientStream`, as the Responses one is).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from dialects.anthropic.anthropic_events import MessageBuilder
from dialects.anthropic.anthropic_request import MessagesRequest
from dialects.anthropic.anthropic_translation import translate
from dialects.stream import ClientStream
from services.caller import Stream


class MessageStream(ClientStream):
    """A Messages answer over NATS: an async iterator of the streaming events (dicts with
    ``type``, as the HTTP API sends them); ``message`` is the whole message once they end.
    :meth:`collect` reads it whole. A failure raises its typed error (the ``error`` event of
    the HTTP stream), as Anthropic's SDK raises on one."""

    def __init__(
        self, req: MessagesRequest, body: dict[str, Any], submit: Callable[[dict[str, Any]], Stream]
    ) -> None:
        # Translated now, so that a bad field is refused at the call, before any event.
        self.chat = translate(req, body)
        self.builder = MessageBuilder(req.model, events=True, stop_sequences=req.stop_sequences)
        self.message: dict[str, Any] | None = None
        super().__init__(submit)

    @property
    def id(self) -> str:
        """The message's id."""
        return self.builder.id

    async def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        stream = self.stream = self._submit(self.chat)
        b = self.builder
        try:
            for ev in b.opening():
                yield ev
            async for c in stream:
                for ev in b.add(c):
                    yield ev
            self.message, events = b.finish(
                stream.finish_reason, stream.usage, stream.stop_sequence, stream.service_tier
            )
            for ev in events:
                yield ev
        finally:
            await stream.aclose()

    def _whole(self) -> dict[str, Any] | None:
        return self.message
