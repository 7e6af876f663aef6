"""The routing admin API on the bridge (``/v1/admin/routing``), for holders of an admin key.

GET    /v1/admin/routing           the default routing and every model's run-time change
GET    /v1/admin/routing/{model}   the routing ``model`` gets now
PUT    /v1/admin/routing/{model}   change it: a partial routing, e.g.
                                   {"policy": "session_affinity"} or
                                   {"pool_policy": "concurrency_tiered",
                                    "tiered": {"threshold": 32}}
DELETE /v1/admin/routing/{model}   drop the change (back to the configuration)

Changes go to the KV bucket every router watches (see :mod:`router.routing`) and to the
audit trail (``routing.changed``, the admin key's id as the actor), or are refused (503)
when the trail cannot be written.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from nats.aio.client import Client as NATS
from pydantic import ValidationError

from bus_schemas import errors as E
from gateway.admin_keys import AdminAPI, answer_errors, audit_context, invalid, read_json
from gateway.asgi import Receive, Scope, Send, send_json
from router.routing import clear_override, list_overrides, set_override, validate_override
from services.config import RouterSettings

PREFIX = "/v1/admin/routing"


class RoutingAdmin:
    """ASGI handler for ``/v1/admin/routing``."""

    def __init__(self, nc: NATS, cfg: RouterSettings, admin: AdminAPI) -> None:
        self.nc = nc
        self.cfg = cfg
        self.admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer_errors(self._handle, scope, receive, send)

    def _view(self, model: str, override: dict[str, Any] | None) -> dict[str, Any]:
        spec = self.cfg.routing_for(model, override)
        return {"model": model, "routing": spec.model_dump(), "override": override or None}

    def _validate(self, model: str, body: dict[str, Any]) -> None:
        """``body`` as a change of ``model``'s routing, or a 400 whose ``param`` names the
        field at fault."""
        try:
            spec = self.cfg.routing_for(model, body)
        except ValidationError as exc:
            raise invalid(exc) from None
        try:
            validate_override(self.cfg, model, body)
        except (ValueError, OSError) as exc:
            # Valid fields that cannot be built: only the expert pool is built from more than
            # its fields (the classifier in expert.model_dir).
            param = "expert.model_dir" if spec.pool_policy == "expert" else "pool_policy"
            raise E.InvalidRequest(str(exc), param=param) from None

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = await self.admin.authorize(scope)
        who, hdrs = audit_context(scope, caller)
        method = scope["method"]
        model = unquote(scope["path"].rstrip("/")[len(PREFIX) :].strip("/"))
        try:
            overrides = await list_overrides(self.nc)
        except Exception:
            raise E.ServiceUnavailable(
                "the routing store (JetStream KV) is not reachable"
            ) from None
        if not model:
            if method == "GET":
                models = [self._view(m, o) for m, o in sorted(overrides.items())]
                default = self.cfg.routing_for("").model_dump()
                await send_json(send, 200, {"default": default, "models": models})
                return
        elif method == "GET":
            await send_json(send, 200, self._view(model, overrides.get(model)))
            return
        elif method == "PUT":
            body = await read_json(receive, 65536)
            if not isinstance(body, dict) or not body:
                raise E.InvalidRequest("the body must be a JSON object with the fields to change")
            self._validate(model, body)
            await set_override(self.nc, model, body, **who)
            await send_json(send, 200, self._view(model, body), hdrs)
            return
        elif method == "DELETE":
            await clear_override(self.nc, model, **who)
            await send_json(send, 200, self._view(model, None), hdrs)
            return
        raise E.NotFound(f"no route for {method} {scope['path']}")
