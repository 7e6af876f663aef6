"""The routing admin API on the bridge (``/v1/admin/routing``), for holders of an admin key.

GET    /v1/admin/routing           the default routing and every model's run-time change
GET    /v1/admin/routing/{model}   the routing ``model`` gets now
PUT    /v1/admin/routing/{model}   change it: a partial routing, e.g.
                                   {"policy": "session_affinity"} or
                                   {"pool_policy": "concurrency_tiered",
                                    "tiered": {"threshold": 32}}
DELETE /v1/admin/routing/{model}   drop the change (back to the configuration)

GET    /v1/admin/routing/aliases          every global model alias: {"aliases": [{"name",
                                          "model", "source": "runtime"|"config"}]}
PUT    /v1/admin/routing/aliases/{name}   {"model": "<served model>"}: clients asking for
                                          ``name`` are served ``model`` (400 naming the
                                          field for a chain or a served model's name)
DELETE /v1/admin/routing/aliases/{name}   drop the run-time alias (a configured one stays)

Changes go to the KV bucket every router watches (see :mod:`router.routing`; aliases:
:mod:`services.aliases`) and to the audit trail (``routing.changed``, ``alias.changed``, the
admin key's id as the actor), or are refused (503) when the trail cannot be written. (A
model named ``aliases`` has its routing changed with the CLI, not here.)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from nats.aio.client import Client as NATS
from pydantic import ValidationError

from bus_schemas import errors as E
from gateway.admin_keys import AdminAPI, answer_errors, audit_context, invalid, read_json
from gateway.asgi import Headers, Receive, Scope, Send, send_json
from router.registry import Registry
from router.routing import clear_override, list_overrides, set_override, validate_override
from services import aliases as A
from services.config import RouterSettings

PREFIX = "/v1/admin/routing"
ALIASES = "aliases"


class RoutingAdmin:
    """ASGI handler for ``/v1/admin/routing``."""

    def __init__(
        self,
        nc: NATS,
        cfg: RouterSettings,
        admin: AdminAPI,
        registry: Registry | None = None,
        aliases: A.AliasTable | None = None,
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.admin = admin
        self.registry = registry or Registry()  # the models served now (shadowing)
        self.aliases = aliases or A.AliasTable(cfg.aliases)

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
        if model == ALIASES or model.startswith(ALIASES + "/"):
            await self._alias(model[len(ALIASES) + 1 :], method, receive, send, who, hdrs)
            return
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

    async def _alias(
        self,
        name: str,
        method: str,
        receive: Receive,
        send: Send,
        who: dict[str, str],
        hdrs: Headers,
    ) -> None:
        """``/v1/admin/routing/aliases[/{name}]``."""
        try:
            runtime = await A.list_aliases(self.nc)
        except Exception:
            raise E.ServiceUnavailable("the alias store (JetStream KV) is not reachable") from None
        if not name and method == "GET":
            await send_json(send, 200, {"aliases": A.rows(self.cfg.aliases, runtime)})
            return
        if name and method == "PUT":
            body = await read_json(receive, 65536)
            target = body.get("model") if isinstance(body, dict) else None
            if not isinstance(target, str):
                raise E.InvalidRequest("model: the served model the alias names", param="model")
            A.check_alias(name, target, {**self.cfg.aliases, **runtime}, self.registry.models())
            await A.set_alias(self.nc, name, target, **who)
            await send_json(send, 200, {"name": name, "model": target}, hdrs)
            return
        if name and method == "DELETE":
            previous = await A.remove_alias(self.nc, name, **who)
            await send_json(send, 200, {"name": name, "removed": previous}, hdrs)
            return
        raise E.NotFound(f"no route for {method} {PREFIX}/{ALIASES}/{name}")
