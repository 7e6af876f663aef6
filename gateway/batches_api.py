"""``/v1/batches`` over HTTP (OpenAI's Batch API): create, list, get and cancel. The state
and its store are :mod:`jobs.batches`; the runners that run the lines, :mod:`jobs.batch_runner`.
"""

from __future__ import annotations

from typing import Any

from bus_schemas import errors as E
from gateway.asgi import (
    Receive,
    Scope,
    Send,
    list_page,
    query_of,
    read_body,
    send_error,
    send_json,
)
from gateway.files_api import owner_of
from jobs.batches import BatchStore, create_batch, unavailable
from jobs.files import FileStore
from services.config import Settings

PREFIX = "/v1/batches"


class BatchAPI:
    """``/v1/batches`` on an ASGI route table (``mount``)."""

    def __init__(self, store: BatchStore, files: FileStore, owner: Any, settings: Settings) -> None:
        self.store = store
        self.files = files
        self.owner = owner
        self.settings = settings

    def mount(self, app: Any) -> None:
        app.add_route("POST", PREFIX, self.create)
        app.add_route("GET", PREFIX, self.listing)
        app.add_prefix(PREFIX, self.by_id)

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = owner_of(self.owner, scope)
            body = await read_body(scope, receive, 1 << 20)
            batch = await create_batch(self.store, self.files, owner, body)
            await send_json(send, 200, batch)
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))

    async def listing(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            owner = owner_of(self.owner, scope)
            mine = await self.store.owned(owner)
            await send_json(send, 200, list_page(mine, query_of(scope)))
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))

    async def by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``."""
        method = scope["method"]
        path = scope["path"].rstrip("/")
        parts = path[len(PREFIX) + 1 :].split("/")
        try:
            owner = owner_of(self.owner, scope)
            if len(parts) == 1 and parts[0] and method == "GET":
                await send_json(send, 200, (await self.store.get(parts[0], owner))["batch"])
            elif len(parts) == 2 and parts[1] == "cancel" and method == "POST":
                await send_json(send, 200, await self.store.cancel(parts[0], owner))
            else:
                raise E.NotFound(f"no route for {method} {path}")
        except E.TokenbusError as exc:
            await send_error(send, exc)
        except Exception as exc:  # JetStream did not answer
            await send_error(send, unavailable(exc))
