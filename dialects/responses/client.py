"""The NATS client's Responses answer (:class:`ResponseStream`, for
:meth:`tokenbus.Client.responses`): the request translated, sent on the chat path, its events
built as they come, and the finished response kept where the caller's are
(:class:`StoredResponses`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from bus_schemas import errors as E
from dialects.responses.events import ResponseBuilder, record
from dialects.responses.request import ResponsesRequest, _bad
from dialects.responses.translation import translate
from dialects.stream import ClientStream
from services.caller import Stream


class StoredResponses(Protocol):
    """Where a caller's stored responses are (the NATS client asks ingress)."""

    async def get(self, response_id: str) -> dict[str, Any]:
        """The stored record (404 when it is not the caller's)."""
        ...

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Keep a record; False when it could not be kept."""
        ...


class ResponseStream(ClientStream):
    """A Responses answer over NATS: an async iterator of the streaming events (dicts with
    ``type`` and ``sequence_number``, as the HTTP API sends them); ``response`` is the final
    response object once the events end. :meth:`collect` reads it whole.

    ``submit`` sends the translated chat request; ``stored`` reads the conversation of a
    ``previous_response_id`` and keeps the finished response (None: nothing is stored)."""

    def __init__(
        self,
        req: ResponsesRequest,
        body: dict[str, Any],
        submit: Callable[[dict[str, Any]], Stream],
        stored: StoredResponses | None = None,
    ) -> None:
        if req.previous_response_id is not None and stored is None:
            raise _bad(
                "previous_response_id",
                "this client keeps no responses; send the whole conversation as input",
            )
        self.req = req
        self.body = body
        # Translated now, so that a bad field is refused at the call, before any event.
        self.turn = translate(req, body)
        if stored is None:
            self.turn.echo["store"] = False
        self.builder = ResponseBuilder(self.turn, events=True)
        self.response: dict[str, Any] | None = None
        self._stored = stored
        super().__init__(submit)

    @property
    def id(self) -> str:
        """The response's id."""
        return self.turn.response_id

    async def _start(self) -> Stream:
        req, stored = self.req, self._stored
        if req.previous_response_id is not None and stored is not None:
            rec = await stored.get(req.previous_response_id)
            self.turn = translate(
                req, self.body, list(rec.get("messages") or []), response_id=self.turn.response_id
            )
            self.builder = ResponseBuilder(self.turn, events=True)
        self.stream = self._submit(self.turn.chat)
        return self.stream

    async def _events(self) -> AsyncGenerator[dict[str, Any], None]:
        stream = await self._start()
        b = self.builder
        try:
            for ev in b.opening():
                yield ev
            try:
                async for c in stream:
                    for ev in b.add(c):
                        yield ev
            except E.TokenbusError as exc:
                self.response, events = b.fail(exc)
                await self._keep(self.response)  # a failed response is kept too
                for ev in events:
                    yield ev
                return
            resp, events = b.finish(stream.finish_reason, stream.usage, stream.service_tier)
            await self._keep(resp)
            self.response = resp
            for ev in events:
                yield ev
        finally:
            await stream.aclose()

    async def _keep(self, resp: dict[str, Any]) -> None:
        """Store the response when asked to; one that cannot be kept says ``store: false``."""
        if not self.turn.echo.get("store") or self._stored is None:
            return
        rec = record(self.turn, self.builder, resp, "")  # the owner is the key's: ingress says
        try:
            kept = await self._stored.put(self.id, rec)
        except E.TokenbusError:
            kept = False
        if not kept:
            resp["store"] = False

    def _whole(self) -> dict[str, Any] | None:
        return self.response
