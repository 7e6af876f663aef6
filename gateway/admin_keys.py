"""The keys admin API on the bridge (``/v1/admin/keys``), for holders of an admin key.

GET    /v1/admin/keys            list (never the keys themselves)
POST   /v1/admin/keys            create: {"name", "models", "aliases", "rpm", "tpm",
                                  "max_concurrent", "max_body_bytes", "filter_policy",
                                  "expires_in", "admin"};
                                  the key is in the answer once
GET    /v1/admin/keys/{id}       show
GET    /v1/admin/keys/owners     every owner that has a spend budget, with it and its spend
                                  this period (as the budget's GET answers it), by name
GET    /v1/admin/keys/owners/{owner}/budget
PUT    /v1/admin/keys/owners/{owner}/budget   an owner's spend budget: {"budget_usd",
                                  "soft_budget_usd", "period"} (neither: removed)
PATCH  /v1/admin/keys/{id}       update the same fields, or {"enabled": true}
DELETE /v1/admin/keys/{id}       revoke
POST   /v1/admin/keys/{id}/rotate  a new secret for the key: {"overlap_s"} (default 3600) is
                                  how long the key before keeps working; the new key is in
                                  the answer once

Each change is recorded in the audit trail (:mod:`services.audit`) with the admin key's id
as the actor and the request id (``X-Request-Id``, or a fresh one, sent back in the
response); when the trail cannot be written the change is refused (503).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from nats.aio.client import Client as NATS
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from auth import budgets
from auth.keys import KeyRecord, parse_duration
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import headers as H
from gateway.asgi import Headers, Receive, Scope, Send, api_key, header, send_error, send_json
from gateway.validation import clean_request_id
from services import audit

PREFIX = "/v1/admin/keys"
# The scope key holding the admin :class:`KeyRecord` that code in this process already
# checked (the console's session, gateway/console.py); an HTTP client cannot set scope keys.
CALLER = "tokenbus.admin_caller"


class KeyFields(BaseModel):
    """Fields an admin may set on a key."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=200)
    owner: str | None = None
    models: list[str] | None = None
    aliases: dict[str, str] | None = Field(
        default=None, description="The key's model aliases, name -> served model."
    )
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    max_body_bytes: int | None = Field(default=None, ge=0, le=1 << 40)
    filter_policy: str | None = None
    expires_in: str | None = Field(default=None, description="e.g. 30d, 12h")
    admin: bool | None = None
    enabled: bool | None = None
    service_tier: Literal["priority", "default", "flex"] | None = None
    max_service_tier: Literal["priority", "default", "flex"] | None = None
    weight: float | None = Field(default=None, gt=0, le=1e6)
    fair_by: Literal["key", "owner"] | None = None
    budget_usd: float | None = Field(default=None, ge=0)
    soft_budget_usd: float | None = Field(default=None, ge=0)
    budget_period: Literal["day", "month", "total"] | None = None

    @field_validator("expires_in")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v:  # refused here, so that the error names the field
            parse_duration(v)
        return v

    def updates(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True, exclude={"expires_in"})
        if self.expires_in:
            d["expires_at"] = time.time() + parse_duration(self.expires_in)
        return d


class OwnerBudget(BaseModel):
    """An owner's spend budget (``PUT /v1/admin/keys/owners/{owner}/budget``); neither
    threshold removes it."""

    model_config = ConfigDict(extra="forbid")

    budget_usd: float | None = Field(default=None, ge=0, lt=1e12)
    soft_budget_usd: float | None = Field(default=None, ge=0, lt=1e12)
    period: Literal["day", "month", "total"] = "month"


class Rotation(BaseModel):
    """``POST /v1/admin/keys/{id}/rotate``: how long the key before keeps working."""

    model_config = ConfigDict(extra="forbid")

    overlap_s: float = Field(default=3600.0, ge=0, le=90 * 86400.0)


async def read_json(receive: Receive, max_body: int) -> Any:
    """The request body as JSON (``{}`` when empty); 413 / 400 otherwise."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if size > max_body:
            raise E.PayloadTooLarge("the admin request body is too large")
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except json.JSONDecodeError as exc:
        raise E.InvalidJSON(f"the request body is not valid JSON: {exc}") from None


async def answer_errors(
    handler: Callable[[Scope, Receive, Send], Awaitable[None]],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """Run an admin handler; its errors become OpenAI-shaped error responses."""
    try:
        await handler(scope, receive, send)
    except E.TokenbusError as exc:
        await send_error(send, exc)
    except ValueError as exc:
        await send_error(send, E.InvalidRequest(str(exc)))


def audit_context(scope: Scope, caller: KeyRecord) -> tuple[dict[str, str], Headers]:
    """The audit keywords of a change by ``caller`` (actor and request id) and the response
    header that tells the request id."""
    rid = clean_request_id(header(scope, b"x-request-id"))
    return {"actor": audit.key_actor(caller.id), "request_id": rid}, [
        (b"x-request-id", rid.encode())
    ]


def invalid(exc: ValidationError) -> E.InvalidRequest:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return E.InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None)


class AdminAPI:
    """ASGI handler for ``/v1/admin/keys`` (the key store opens on first use)."""

    def __init__(
        self,
        nc: NATS,
        max_body: int = 65536,
        store: KeyStore | None = None,
        check_aliases: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        self.nc = nc
        # Refuses a key's aliases that chain or hide a served model (400 naming the field).
        self.check_aliases = check_aliases
        self.max_body = max_body
        self._store: KeyStore | None = store
        self._owns_store = store is None
        self._lock = asyncio.Lock()

    async def store(self) -> KeyStore:
        async with self._lock:
            if self._store is None:
                try:
                    self._store = await KeyStore(self.nc).open()
                except Exception:
                    raise E.ServiceUnavailable(
                        "the key store (JetStream KV) is not reachable; retry"
                    ) from None
            return self._store

    async def close(self) -> None:
        if self._store is not None and self._owns_store:
            await self._store.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer_errors(self._handle, scope, receive, send)

    async def _body(self, receive: Receive) -> KeyFields:
        data = await read_json(receive, self.max_body)
        try:
            fields = KeyFields.model_validate(data)
        except ValidationError as exc:
            raise invalid(exc) from None
        if fields.aliases and self.check_aliases is not None:
            self.check_aliases(fields.aliases)
        return fields

    async def _owner_budget(
        self,
        owner: str,
        method: str,
        receive: Receive,
        send: Send,
        who: dict[str, str],
        hdrs: Headers,
    ) -> None:
        """Show (GET) or set (PUT) an owner's spend budget, with its spend this period."""
        book = await budgets.SpendBook(self.nc).open()
        if method == "PUT":
            try:
                body = OwnerBudget.model_validate(await read_json(receive, self.max_body))
            except ValidationError as exc:
                raise invalid(exc) from None
            await book.set_owner_budget(
                owner,
                hard_usd=body.budget_usd,
                soft_usd=body.soft_budget_usd,
                period=body.period,
                actor=who["actor"],
                request_id=who["request_id"],
            )
        view = await _budget_view(book, owner, await book.owner_budget(owner))
        await send_json(send, 200, view, hdrs)

    async def _owner_budgets(self, send: Send) -> None:
        """Every owner that has a budget (the console's list of them)."""
        book = await budgets.SpendBook(self.nc).open()
        data = [await _budget_view(book, o, b) for o, b in await book.owner_budgets()]
        await send_json(send, 200, {"object": "list", "data": data})

    async def authorize(self, scope: Scope) -> KeyRecord:
        """The caller's key record, if it is an admin key; 401/403 otherwise."""
        checked = scope.get(CALLER)
        if isinstance(checked, KeyRecord) and checked.admin:
            return checked
        store = await self.store()
        caller = store.lookup(api_key(scope).get(H.API_KEY))
        if not caller.admin:
            raise E.InsufficientPermissions(
                f"the API key {caller.id} is not an admin key: the admin API needs one "
                "(`tokenbus keys create --admin`)"
            )
        return caller

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = await self.authorize(scope)
        store = await self.store()
        method = scope["method"]
        rest = scope["path"].rstrip("/")[len(PREFIX) :].strip("/")
        who, hdrs = audit_context(scope, caller)
        if not rest:
            if method == "GET":
                await send_json(
                    send, 200, {"object": "list", "data": [r.public() for r in await store.list()]}
                )
                return
            if method == "POST":
                f = await self._body(receive)
                if not f.name:
                    raise E.InvalidRequest("name: a new key needs a name", param="name")
                upd = f.updates()
                name = upd.pop("name")
                upd.pop("enabled", None)
                key, rec = await store.create(name, **who, **upd)
                await send_json(send, 201, {**rec.public(), "key": key}, hdrs)
                return
        elif rest == "owners" and method == "GET":
            await self._owner_budgets(send)
            return
        elif rest.startswith("owners/") and rest.endswith("/budget"):
            owner = rest[len("owners/") : -len("/budget")]
            if owner and method in ("GET", "PUT"):
                await self._owner_budget(owner, method, receive, send, who, hdrs)
                return
        elif rest.endswith("/rotate") and "/" not in rest[: -len("/rotate")]:
            if method == "POST":
                try:
                    body = Rotation.model_validate(await read_json(receive, self.max_body))
                except ValidationError as exc:
                    raise invalid(exc) from None
                key_id = rest[: -len("/rotate")]
                key, rec = await store.rotate(key_id, overlap_s=body.overlap_s, **who)
                await send_json(send, 200, {**rec.public(), "key": key}, hdrs)
                return
        elif "/" not in rest:
            if method == "GET":
                await send_json(send, 200, (await store.get(rest)).public())
                return
            if method == "PATCH":
                rec = await store.update(rest, **who, **(await self._body(receive)).updates())
                await send_json(send, 200, rec.public(), hdrs)
                return
            if method == "DELETE":
                await send_json(send, 200, (await store.revoke(rest, **who)).public(), hdrs)
                return
        raise E.NotFound(f"no route for {method} {scope['path']}")


async def _budget_view(
    book: budgets.SpendBook, owner: str, b: budgets.Budget | None
) -> dict[str, Any]:
    """An owner's budget ``b`` (None: it has none) as the admin API answers it, with what
    was spent and is held in its current period."""
    out: dict[str, Any] = {"owner": owner, "budget_usd": None, "soft_budget_usd": None}
    if b is not None:
        spent, held = await book.spent(b)
        out.update(
            period=b.period,
            budget_usd=None if b.hard is None else b.hard / 1e6,
            soft_budget_usd=None if b.soft is None else b.soft / 1e6,
            spend_period=budgets.period_id(b.period),
            spent_usd=spent / 1e6,
            held_usd=held / 1e6,
        )
    return out
