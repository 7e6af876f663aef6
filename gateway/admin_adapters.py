"""The adapters admin API on the bridge (``/v1/admin/adapters``), for holders of an admin
key: LoRA adapters loaded at run time (docs/adapters.md).

GET    /v1/admin/adapters          every adapter wanted or loaded: {"adapters": [{"name",
                                   "model", "path", "replicas", "wanted", "loaded_on"}]}
POST   /v1/admin/adapters          {"name", "model", "path", "replicas"?: 1}: load it on that
                                   many replicas of ``model``; 200 {"adapter", "loaded":
                                   [{"replica", "load_ms"}], "failed": [...]}, or the error
                                   of the first replica when none loaded it (it names it)
DELETE /v1/admin/adapters/{name}   ?drain_s=30: unload it everywhere, each replica after the
                                   requests on it end; 404 when no adapter has the name

Changes are in the audit trail (``adapter.loaded``, ``adapter.unloaded``, the admin key's id
as the actor); the wanted adapters are in the KV bucket every router follows
(:mod:`router.adapters`).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import parse_qs, unquote

from nats.aio.client import Client as NATS
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bus_schemas import errors as E
from bus_schemas.messages import ADAPTER_NAME_MAX
from gateway.admin_keys import AdminAPI, answer_errors, audit_context, invalid, read_json
from gateway.asgi import Receive, Scope, Send, send_json
from router import adapters as A
from router.registry import Registry

PREFIX = "/v1/admin/adapters"
MAX_REPLICAS = 1024
MAX_DRAIN_S = 3600.0


class LoadBody(BaseModel):
    """What POST takes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=ADAPTER_NAME_MAX)
    model: str = Field(min_length=1, max_length=ADAPTER_NAME_MAX)
    path: str = Field(min_length=1, max_length=4096)
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)


class AdaptersAdmin:
    """ASGI handler for ``/v1/admin/adapters``."""

    def __init__(self, nc: NATS, admin: AdminAPI, registry: Registry) -> None:
        self.nc = nc
        self.admin = admin
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer_errors(self._handle, scope, receive, send)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = await self.admin.authorize(scope)
        who, hdrs = audit_context(scope, caller)
        method = scope["method"]
        name = unquote(scope["path"].rstrip("/")[len(PREFIX) :].strip("/"))
        if not name and method == "GET":
            rows = await A.listing(self.nc, self.registry)
            await send_json(send, 200, {"adapters": rows})
            return
        if not name and method == "POST":
            body = await read_json(receive, 65536)
            if not isinstance(body, dict):
                raise E.InvalidRequest("the body must be a JSON object: name, model, path")
            try:
                b = LoadBody.model_validate(body)
            except ValidationError as exc:
                raise invalid(exc) from None
            want = A.Wanted(b.name, b.model, b.path, b.replicas)
            out = await A.load(
                self.nc,
                self.registry,
                want,
                served=self.registry.models(),
                actor=who["actor"],
                request_id=who["request_id"],
            )
            await send_json(send, 200, out, hdrs)
            return
        if name and method == "DELETE":
            drain_s = _drain(scope)
            out = await A.unload(
                self.nc,
                self.registry,
                name,
                drain_s=drain_s,
                actor=who["actor"],
                request_id=who["request_id"],
            )
            await send_json(send, 200, out, hdrs)
            return
        raise E.NotFound(f"no route for {method} {scope['path']}")


def _drain(scope: Scope) -> float:
    """``?drain_s=`` of a DELETE (30 s when absent)."""
    query: dict[str, Any] = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    raw = (query.get("drain_s") or ["30"])[0]
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or not 0 <= value <= MAX_DRAIN_S:
        raise E.InvalidRequest(
            f"drain_s: seconds from 0 to {MAX_DRAIN_S:g}, got {raw[:40]!r}", param="drain_s"
        )
    return value
