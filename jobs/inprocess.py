"""One request to this process's own HTTP app, made in-process by a trusted caller: a
batch line (:mod:`jobs.batch_runner`) or a background response (:mod:`jobs.background`) runs
through the same handlers, limits, filter and routing as an HTTP client's request.

The app is any ASGI callable; the HTTP server and its route table are the gateway's
(:mod:`gateway.asgi`), which this layer does not import.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

# The ASGI shapes an in-process request speaks (the same as gateway.asgi's).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# An ASGI scope key only this process sets, never the HTTP server: the id of the API key a
# request is run for by a trusted caller here (a batch line: jobs/batch_runner.py). Such a
# request carries no key; auth checks the key by id (auth.service.authenticate).
PRINCIPAL = "tokenbus.principal"
# Another such key: the id of the background response this request runs (its runner sets it:
# the response keeps that id, and is written over its queued record).
BACKGROUND = "tokenbus.background"
# And how that run is numbered among the runs of the response (a ``services.caller.Rerun``):
# a rerun's limiter charges the lost run's last attempt nothing.
RERUN = "tokenbus.rerun"
# And its time limit (seconds), when it is not an interactive request's: a background
# response or a batch line runs for as long as batches.line_timeout_s allows.
TIMEOUT = "tokenbus.timeout"


class InProcess:
    """One request to this process's own app, as a trusted caller here makes it (a batch
    line, a background response): a POST of ``body`` to ``path`` for the key ``principal``
    (None: an open deployment), with more scope keys in ``extra``. :meth:`run` sends it;
    ``status`` and ``chunks`` are the answer, and ``on_body`` (when given) gets each piece
    of a 200 answer's body as it comes instead of ``chunks``."""

    def __init__(
        self,
        path: str,
        body: dict[str, Any],
        principal: str | None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        extra: dict[str, Any] | None = None,
        on_body: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), *headers],
            "client": None,
            "server": None,
            **(extra or {}),
        }
        if principal:
            self.scope[PRINCIPAL] = principal
        self.body = json.dumps(body).encode()
        self.on_body = on_body
        self.sent = False
        self.status = 0
        self.chunks: list[bytes] = []

    async def run(self, app: App) -> None:
        never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        async def receive() -> Message:
            if not self.sent:
                self.sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            return await never  # the caller never goes away

        async def send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                chunk = bytes(msg.get("body", b""))
                if self.on_body is not None and self.status == 200:
                    await self.on_body(chunk)
                else:
                    self.chunks.append(chunk)

        try:
            await app(self.scope, receive, send)
        finally:
            never.cancel()

    @property
    def answer(self) -> bytes:
        return b"".join(self.chunks)
