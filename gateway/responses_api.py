"""The Responses API over HTTP: ``POST /v1/responses`` (whole or streamed),
``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A request is translated onto the chat path (:mod:`dialects.responses`) and opened on the
app's :class:`~gateway.openai_api.Source` exactly as a chat completion is, so keys, limits,
the content filter, routing, migration and telemetry are the chat path's. What differs is
only what goes back: a ``response`` object, or the Responses streaming events. Stored
responses live in the :class:`~jobs.response_store.ResponseStore`, owned by the key that
made them (docs/responses.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.subjects import KIND_CHAT
from dialects import responses as R
from gateway import validation
from gateway.asgi import (
    BodyNow,
    Receive,
    Scope,
    Send,
    api_key,
    list_page,
    query_of,
    send_error,
    send_json,
)
from gateway.openai_api import Call, OpenAIApp
from gateway.sse import (
    Progress,
    StreamLike,
    builder_events,
    builder_sink,
    first_chunk,
    latency_headers,
    limit_headers,
    named,
    pump,
    start_sse,
)
from jobs.response_store import ResponseStore, conversation, not_found
from services import logging as tlog
from services import tracing
from services.caller import Stream

if TYPE_CHECKING:
    from jobs.background import Background

log = tlog.get("bridge")
PREFIX = "/v1/responses"
KIND = "responses"  # the kind in the bridge's metrics and request log

Owner = Callable[[str | None], str]


def key_owner(keys: KeyStore | None) -> Owner:
    """Who owns what a request stores: its API key's id where keys are checked (401 for a
    key that is not valid), else nobody in particular (``""``: one open deployment)."""
    if keys is None:
        return lambda key: ""
    return lambda key: keys.lookup(key).id


class ResponsesAPI:
    """The Responses API's handlers on an :class:`OpenAIApp` (``mount`` adds its routes);
    ``store`` None: nothing is kept (``store`` comes back false, and ids are not found)."""

    def __init__(self, app: OpenAIApp, store: ResponseStore | None, owner: Owner | None = None):
        self.app = app
        self.store = store
        self.owner: Owner = owner or key_owner(None)
        # Background responses' queue and events (jobs/background.py); None: refused.
        self.background: Background | None = None

    def mount(self) -> None:
        """``POST /v1/responses`` and everything below ``/v1/responses/``."""
        self.app.add_route("POST", PREFIX, self.create)
        self.app.add_prefix(PREFIX, self.by_id)

    # -- create ---------------------------------------------------------------------------
    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``: one request, through the chat path's scaffold
        (:meth:`OpenAIApp.handle`: errors, disconnects, telemetry and its trace span)."""
        await self.app.handle(scope, receive, send, KIND, self._create)

    async def _create(self, call: Call, send: Send) -> None:
        app = self.app
        who = app.owner_of(call, self.owner)
        await app.files.responses(call.body, who)
        req = R.parse(call.body)
        owner = who()
        if req.background and call.background is None:
            await self._queue(call, send, req, owner)
            return
        previous = await self._previous(req.previous_response_id, owner)
        turn = R.translate(req, call.body, previous, response_id=call.background)
        if self.store is None:
            turn.echo["store"] = False
        call.session_from(turn.session)
        chat = validation.parse(KIND_CHAT, turn.chat)
        if call.span is not None:
            call.span.set_attribute(tracing.MODEL, chat.model)
        call.watch()
        call.whole(bool(req.stream))
        stream = call.stream = app.source.open(
            KIND_CHAT,
            chat,
            turn.chat,
            request_id=call.rid,
            timeout=call.timeout or app.timeout,
            headers=call.hdrs,
            principal=call.principal,
        )
        if call.rerun is not None and isinstance(stream, Stream):
            stream.rerun_of(call.rerun)
        if req.stream:
            await self._write_sse(send, turn, stream, call.rid, call.progress, owner, call.now)
        else:
            await self._write_whole(send, turn, stream, call.rid, call.progress, owner)

    async def _queue(self, call: Call, send: Send, req: R.ResponsesRequest, owner: str) -> None:
        """``background: true``: checked now, kept ``queued``, run by a batch runner; the
        queued response at once, or with ``stream`` its events as they come."""
        bg, store = self.background, self.store
        if bg is None or store is None:
            raise E.InvalidRequest(
                "background responses are not served here (they need JetStream and "
                "batches.enabled); send the request without background",
                param="background",
            )
        served = (
            []
            if call.principal is not None
            else self.app.source.models_for(call.hdrs.get(H.API_KEY))
        )
        if served and req.model not in served:
            raise E.ModelNotFound(
                f"the model {req.model!r} does not exist or is not served now", param="model"
            )
        previous = await self._previous(req.previous_response_id, owner)
        queued = await bg.queue(req, call.body, owner, previous)
        if req.stream:
            await self._follow(send, bg, queued["id"], owner, -1, call.rid)
        else:
            await send_json(send, 200, queued, [(b"x-request-id", call.rid.encode())])

    async def _follow(
        self, send: Send, bg: Background, response_id: str, owner: str, after: int, rid: str
    ) -> None:
        """A background response's events numbered after ``after`` as server-sent events,
        replayed, then live, until one that ends it."""
        await start_sse(send, rid)
        async with contextlib.aclosing(bg.follow(response_id, owner, after)) as events:
            async for ev in events:
                piece = named(ev).encode()
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _previous(self, response_id: str | None, owner: str) -> list[dict[str, Any]] | None:
        return await conversation(self.store, response_id, owner)

    async def _save(
        self, turn: R.Turn, b: R.ResponseBuilder, resp: dict[str, Any], owner: str
    ) -> None:
        """Keep a finished response when asked to; one that cannot be kept says
        ``store: false`` (and the store logged why)."""
        if not turn.echo.get("store") or self.store is None:
            return
        rec = R.record(turn, b, resp, owner)
        if turn.echo.get("background"):  # over its queued record (jobs/background.py)
            rec["background"] = True
            if not await self.store.replace(turn.response_id, rec):
                resp["store"] = False
        elif not await self.store.put(turn.response_id, rec):
            resp["store"] = False

    async def _write_whole(
        self,
        send: Send,
        turn: R.Turn,
        stream: StreamLike,
        rid: str,
        progress: Progress,
        owner: str,
    ) -> None:
        b = R.ResponseBuilder(turn, events=False)
        async for c in stream:
            b.add(c)
        resp, _ = b.finish(stream.finish_reason, stream.usage, stream.service_tier)
        await self._save(turn, b, resp, owner)
        progress.finished = True
        progress.t5_ns = time.time_ns()
        await send_json(
            send,
            200,
            resp,
            [
                (b"x-request-id", rid.encode()),
                *limit_headers(stream),
                *latency_headers(stream, progress.t1_ns),
            ],
        )

    async def _write_sse(
        self,
        send: Send,
        turn: R.Turn,
        stream: StreamLike,
        rid: str,
        progress: Progress,
        owner: str,
        now: BodyNow | None,
    ) -> None:
        # The first frame before the headers, so that errors before generation (unknown
        # model, no replica, a refused key) still get their own HTTP status.
        first = await first_chunk(stream)
        b = R.ResponseBuilder(turn, events=True)
        progress.started = True
        await start_sse(send, rid, stream)
        buf = [named(ev) for ev in b.opening()]
        body = "http.response.body"
        try:
            if first is not None:
                sink = None if now is None else builder_sink(b, now)
                await pump(send, stream, first, builder_events(b), buf, progress, sink)
            resp, events = b.finish(stream.finish_reason, stream.usage, stream.service_tier)
            # Kept before response.completed goes out: a client that continues the
            # conversation right after it finds it.
            await self._save(turn, b, resp, owner)
            buf.extend(named(ev) for ev in events)
        except E.TokenbusError as exc:
            # The headers are gone: the failure is an `error` and a `response.failed` event,
            # and the failed response is kept as OpenAI keeps one (GET shows what failed).
            failed, events = b.fail(exc)
            await self._save(turn, b, failed, owner)
            buf.extend(named(ev) for ev in events)
            progress.error = exc.code
        progress.finished = True
        await send({"type": body, "body": "".join(buf).encode(), "more_body": False})

    # -- stored responses -----------------------------------------------------------------
    async def by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``."""
        method = scope["method"]
        path = scope["path"].rstrip("/")
        parts = path[len(PREFIX) + 1 :].split("/") if path != PREFIX else []
        try:
            owner = self.owner(api_key(scope).get(H.API_KEY))
            if len(parts) == 1 and parts[0] and method in ("GET", "DELETE"):
                rid = parts[0]
                if method == "DELETE":
                    await self._store(rid).delete(rid, owner)
                    await send_json(send, 200, {"id": rid, "object": "response", "deleted": True})
                    return
                query = query_of(scope)
                rec = await self._store(rid).get(rid, owner)
                if query.get("stream") in ("true", "1"):
                    if not rec.get("background") or self.background is None:
                        raise E.InvalidRequest(
                            "stream: only a background response's events are kept to replay; "
                            "GET it whole",
                            param="stream",
                        )
                    after = query.get("starting_after", "-1")
                    if not after.lstrip("-").isdigit():
                        raise E.InvalidRequest(
                            "starting_after: a sequence number", param="starting_after"
                        )
                    await self._follow(send, self.background, rid, owner, int(after), rid)
                    return
                await send_json(send, 200, rec["response"])
                return
            if len(parts) == 2 and parts[1] == "input_items" and method == "GET":
                rec = await self._store(parts[0]).get(parts[0], owner)
                await send_json(
                    send,
                    200,
                    list_page(list(reversed(rec.get("input_items") or [])), query_of(scope)),
                )
                return
            if len(parts) == 2 and parts[1] == "cancel" and method == "POST":
                rec = await self._store(parts[0]).get(parts[0], owner)
                if not rec.get("background") or self.background is None:
                    raise E.InvalidRequest(
                        "only background responses can be cancelled (a streamed response "
                        "stops when its client disconnects)",
                        param="response_id",
                    )
                await send_json(send, 200, await self.background.cancel(parts[0], rec))
                return
            if len(parts) in (1, 2) and parts[0]:
                raise MethodNotAllowed(f"method {method} not allowed on {path}")
            raise E.NotFound(f"no route for {method} {path}")
        except E.TokenbusError as exc:
            await send_error(send, exc)

    def _store(self, response_id: str) -> ResponseStore:
        if self.store is None:
            raise not_found(response_id)
        return self.store


class MethodNotAllowed(E.InvalidRequest):
    """A known path asked with a method it does not serve (405)."""

    status = 405
