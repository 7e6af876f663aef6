"""The bridge's HTTP app while the bridge starts: it listens before it has a bus connection
or its stores, and holds requests until it can serve them.

A bridge opens its JetStream stores and watches (keys, spend, routing, aliases, responses,
files) before it can serve, and each open rides out a stream without a leader for up to
20 s. Listening only after them, a bridge restarted while the bus recovers refuses
connections meanwhile: with two bridges restarting at once (two host crashes in a row), a
load balancer has nowhere to send a client (docs/nemesis.md, finding 12). Listening first,
a request that arrives during the start waits (up to ``start_wait_s``, and never past its
own time limit, ``request_timeout_s``) and is served once the bridge is, in what is left of
its time limit; ``/health`` says the process is alive and ``/ready`` says 503 until then, so
a health-checking balancer still prefers a bridge that serves.
"""

from __future__ import annotations

import asyncio
import time

from bus_schemas import errors as E
from gateway.asgi import Receive, Route, Scope, Send, send_error, send_json
from jobs.inprocess import TIMEOUT


class StartGate:
    """An ASGI app that holds requests until :meth:`open` hands it the bridge's own app,
    then passes every request straight to it."""

    def __init__(self, wait_s: float, timeout_s: float | None = None) -> None:
        # A held request waits no longer than its own time limit: held past it, its client
        # had given up on it (seen in the nemesis: held 21 s against a 15 s limit).
        self.timeout_s = timeout_s
        self.wait_s = min(wait_s, timeout_s) if timeout_s else wait_s
        self.app: Route | None = None
        self.waiting = 0  # requests held now (the /ready body names it)
        self._opened = asyncio.Event()

    def open(self, app: Route) -> None:
        """Serve with ``app`` from now on; the held requests go to it."""
        self.app = app
        self._opened.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no lifespan: the server runs with it off
            return
        path = scope["path"].rstrip("/")
        if scope["method"] == "GET" and path == "/health":
            await send_json(send, 200, {"status": "starting"})
            return
        if scope["method"] == "GET" and path == "/ready":
            await send_json(send, 503, {"status": "starting", "waiting": self.waiting})
            return
        self.waiting += 1
        held = time.monotonic()
        try:
            await asyncio.wait_for(self._opened.wait(), self.wait_s)
        except TimeoutError:
            await send_error(
                send,
                E.ServiceUnavailable(
                    f"the bridge is still starting (connecting to the bus and opening its "
                    f"stores) after {self.wait_s:g} s; retry shortly"
                ),
            )
            return
        finally:
            self.waiting -= 1
        assert self.app is not None
        if self.timeout_s:  # its time limit counts from its arrival, the wait included
            left = self.timeout_s - (time.monotonic() - held)
            scope[TIMEOUT] = max(0.001, left)
        await self.app(scope, receive, send)
