"""The operator's console, served by the bridge at ``/console`` (docs/console.md).

GET    /console                        the page (static HTML, JS modules and CSS of the
                                       package's ``console_static`` folder, no CDN)
POST   /console/api/session            log in: {"key": "<API key>"}; sets the session cookie
GET    /console/api/session            who is logged in, and the CSRF token of the session
DELETE /console/api/session            log out
GET    /console/api/keys               keys, paged and searched: ?q=&offset=&limit=
POST   /console/api/keys               create; PATCH / DELETE /console/api/keys/{id},
                                       POST /console/api/keys/{id}/rotate, GET
                                       /console/api/owners (the owners with a budget), GET /
                                       PUT /console/api/owners/{owner}/budget: the keys admin
                                       API (gateway/admin_keys.py) for the session's key
GET    /console/api/usage              the Spend page: a page of requests, tokens and cost
                                       per key and model (the costliest first), the totals
                                       and the chart's top keys and others per hour or day
                                       (?since=24h&bucket=hour|day&measure=&key=&offset=
                                       &limit=); with ?group=owner the same per owner (every
                                       key of it summed; &owner= one owner, with its owner
                                       budget); GET /console/api/usage/export (or
                                       ?format=csv): every row per bucket, key and model, CSV
GET    /console/api/replicas           the replicas this bridge hears, with their load, their
                                       LoRA adapters, the KV check's predicted and reported
                                       cached tokens (``kv_check``), their site and accepts'
                                       round trip (``ack_ms``); ``placements``: this bridge's
                                       router's requests kept at its site or spilled
GET    /console/api/routing            the routing admin API's listing and the aliases;
                                       PUT / DELETE /console/api/routing/{model}, PUT / DELETE
                                       /console/api/routing/aliases/{name}: its changes
                                       (gateway/admin_routing.py) for the session's key
GET    /console/api/adapters           the LoRA adapters wanted or loaded; POST loads one,
                                       DELETE /console/api/adapters/{name}?drain_s= unloads
                                       it: the adapters admin API (gateway/admin_adapters.py)
                                       for the session's key
GET    /console/api/audit              the newest audit events (?limit=100)
GET    /console/api/jobs               batches; POST /console/api/jobs/{id}/cancel
GET    /console/api/responses          background responses, newest first, paged
                                       (?limit=&after=<id>): their status and progress
GET    /console/api/responses/{id}     a background response looked up by id (its status);
                                       POST /console/api/responses/{id}/cancel cancels it
GET    /console/api/files/{id}/content a file's bytes, as an attachment (a batch's input,
                                       output and error files; an owner session: its own)
GET    /console/api/bus                the NATS servers, JetStream streams and their consumers'
                                       lag, and the alerts the console evaluates itself
GET    /console/api/events             one server-sent-events feed per open page: the
                                       replicas when they change, the key count, the end of
                                       the session; with ?page=bus (the page shows the Bus
                                       page) the bus read when it changes, from one read per
                                       bridge process every few seconds (console_bus.Latest)

Who: an admin key's session sees and changes everything; any other key's session (an
"owner" session) sees only the keys of its own owner (itself when it has none), their usage,
their batches and background responses, and may change nothing (403). Every write needs the
session's CSRF token in ``X-CSRF-Token`` and, where the browser sends one, an ``Origin`` of
this host. Nothing here is on the request path of the OpenAI API.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from nats.js.errors import (
    BadRequestError,
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
)

from auth import budgets
from auth.keys import KeyRecord, parse_duration
from auth.store import KeyStore
from bus_schemas import errors as E
from dialects.responses import RESPONSE_ID
from gateway import console_bus, console_spend, console_usage
from gateway.admin_adapters import PREFIX as ADAPTERS_PREFIX
from gateway.admin_keys import CALLER, AdminAPI, read_json
from gateway.admin_keys import PREFIX as KEYS_PREFIX
from gateway.admin_routing import PREFIX as ROUTING_PREFIX
from gateway.asgi import (
    Headers,
    Receive,
    Scope,
    Send,
    header,
    list_page,
    query_of,
    send_json,
)
from gateway.console_session import Session, Sessions, token_of
from jobs.batches import BatchStore
from jobs.files import FileStore
from jobs.files import not_found as file_not_found
from jobs.response_store import not_found as response_not_found
from router.dispatch import SITE_PLACEMENTS
from router.kv_check import KVCheck
from router.registry import Registry, Replica
from services import audit
from services.config import Settings

if TYPE_CHECKING:
    from gateway.responses_api import ResponsesAPI

PREFIX = "/console"
API = PREFIX + "/api"
STATIC = PREFIX + "/static"
_STATIC_NAME = re.compile(r"[a-z0-9_-]{1,64}\.(js|css|svg|png)")
_TYPES = {
    "js": b"text/javascript; charset=utf-8",
    "css": b"text/css; charset=utf-8",
    "svg": b"image/svg+xml",
    "png": b"image/png",
    "html": b"text/html; charset=utf-8",
}
# Every console response: no framing, no inline script, nothing from elsewhere, no sniffing.
SECURITY: Headers = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
NO_STORE: Headers = [(b"cache-control", b"no-store")]
WRITES = frozenset(("POST", "PUT", "PATCH", "DELETE"))
MAX_PAGE = 500
MAX_FEEDS = 64  # open event feeds per bridge process; more get 503
FEED_PAGES = frozenset(("", "bus"))  # ?page= of a feed: the pages with live parts of their own
FEED_TICK_S = 1.0
FEED_PING_S = 15.0
MAX_JOBS = 500
MAX_RESPONSES_PAGE = 100  # background responses a page; each open one is one stream read
FILE_CHUNK = 64 * 1024
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _secured(send: Send, extra: Headers = NO_STORE) -> Send:
    """``send`` with the console's security headers added to the response head."""

    async def wrapped(msg: Any) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", []), *SECURITY, *extra]}
        await send(msg)

    return wrapped


async def _error(send: Send, err: E.TokenbusError, hdrs: Headers | None = None) -> None:
    out = [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    if err.retryable and b"retry-after" not in {k for k, _ in out}:
        out.append((b"retry-after", b"1"))
    await send_json(send, E.http_status(err), err.openai_body(), [*out, *(hdrs or [])])


def _int(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    text = query.get(name, str(default))
    if not text.isdigit() or not low <= int(text) <= high:
        raise E.InvalidRequest(f"{name}: an integer from {low} to {high}", param=name)
    return int(text)


class Console:
    """ASGI handler for ``/console`` (mount with :meth:`mount`)."""

    def __init__(
        self,
        admin: AdminAPI,
        routing: Callable[[Scope, Receive, Send], Awaitable[None]],
        registry: Registry,
        settings: Settings,
        kv: KVCheck | None = None,
        adapters: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None,
    ) -> None:
        self.admin = admin
        self.routing = routing
        self.adapters = adapters  # the adapters admin API; None where the bridge has none
        self.registry = registry
        self.settings = settings
        self.kv = kv  # the in-process router's KV check; None where the bridge does not route
        self.batches: BatchStore | None = None  # set when the bridge serves the Batch API
        self.files: FileStore | None = None  # set with batches
        self.responses: ResponsesAPI | None = None  # set with batches (background responses)
        self._sessions: Sessions | None = None
        self._feeds = 0
        self._spend = console_spend.Summaries()
        self._bus = console_bus.Latest(self._read_bus)  # the feeds' bus events, shared
        self._static = resources.files("gateway") / "console_static"

    def mount(self, app: Any) -> None:
        app.add_prefix(PREFIX, self)

    async def sessions(self) -> Sessions:
        if self._sessions is None:
            keys: KeyStore = await self.admin.store()
            self._sessions = Sessions(self.admin.nc, keys)
        return self._sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") or "/"
        secure = scope.get("scheme") == "https"
        try:
            if path == PREFIX or path.startswith(STATIC + "/"):
                await self._asset(scope, path, send)
            elif path == API + "/session":
                await self._session_call(scope, receive, _secured(send), secure)
            elif path.startswith(API + "/"):
                session = await self._check(scope)
                await self._api(scope, receive, send, session, path[len(API) + 1 :])
            else:
                raise E.NotFound(f"no route for {scope['method']} {path}")
        except E.TokenbusError as exc:
            await _error(_secured(send), exc)
        except ValueError as exc:
            await _error(_secured(send), E.InvalidRequest(str(exc)))

    # -- the page ----------------------------------------------------------------------
    async def _asset(self, scope: Scope, path: str, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            raise E.InvalidRequest(f"method {scope['method']} not allowed on {path}")
        name = "index.html" if path == PREFIX else path[len(STATIC) + 1 :]
        if name != "index.html" and not _STATIC_NAME.fullmatch(name):
            raise E.NotFound(f"no console file {name!r}")
        item = self._static / name
        if not item.is_file():
            raise E.NotFound(f"no console file {name!r}")
        body = item.read_bytes()
        kind = _TYPES[name.rsplit(".", 1)[1]]
        await _secured(send, [(b"cache-control", b"no-cache")])(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())],
            }
        )
        head = scope["method"] == "HEAD"
        await send({"type": "http.response.body", "body": b"" if head else body})

    # -- sessions ----------------------------------------------------------------------
    async def _check(self, scope: Scope) -> Session:
        """The request's session; for a write also its CSRF token and origin (403)."""
        sessions = await self.sessions()
        session = await sessions.check(token_of(header(scope, b"cookie")))
        if scope["method"] in WRITES:
            self._check_origin(scope)
            sent = header(scope, b"x-csrf-token") or ""
            if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise E.InsufficientPermissions(
                    "the CSRF token is missing or wrong: reload the console and try again"
                )
        return session

    @staticmethod
    def _check_origin(scope: Scope) -> None:
        origin = header(scope, b"origin")
        if origin is None:
            return  # not a browser's cross-site request (those send Origin on writes)
        host = header(scope, b"host") or ""
        if origin == "null" or urlsplit(origin).netloc != host:
            raise E.InsufficientPermissions("a console write must come from the console's own page")

    async def _session_call(self, scope: Scope, receive: Receive, send: Send, secure: bool) -> None:
        sessions = await self.sessions()
        method = scope["method"]
        if method == "POST":
            self._check_origin(scope)
            ctype = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise E.InvalidRequest('log in with a JSON body: {"key": "<API key>"}')
            body = await read_json(receive, 4096)
            key = body.get("key") if isinstance(body, dict) else None
            if not isinstance(key, str) or not key.strip():
                raise E.InvalidRequest("key: the API key to log in with", param="key")
            token, session = await sessions.login(key)
            cookie = sessions.cookie(token, session, secure)
            await send_json(send, 200, self._whoami(session), [(b"set-cookie", cookie)])
            return
        session = await self._check(scope)
        if method == "GET":
            await send_json(send, 200, self._whoami(session))
        elif method == "DELETE":
            sessions.logout(session)
            clear = sessions.clear_cookie(secure)
            await send_json(send, 200, {"logged_out": True}, [(b"set-cookie", clear)])
        else:
            raise E.InvalidRequest(f"method {method} not allowed on {API}/session")

    @staticmethod
    def _whoami(s: Session) -> dict[str, Any]:
        return {
            "key_id": s.key.id,
            "name": s.key.name,
            "owner": s.key.owner,
            "role": s.role,
            "expires_at": s.expires_at,
            "csrf_token": s.csrf,
        }

    # -- the API -----------------------------------------------------------------------
    async def _api(self, scope: Scope, receive: Receive, send: Send, s: Session, rest: str) -> None:
        method = scope["method"]
        if method in WRITES and not s.admin:
            raise E.InsufficientPermissions(
                f"the API key {s.key.id} is not an admin key: the console's changes need one"
            )
        part = rest.split("/", 1)[0]
        if part == "events" and method == "GET":
            page = query_of(scope).get("page", "")
            if page not in FEED_PAGES:
                raise E.InvalidRequest("page: bus, or none", param="page")
            cookie = token_of(header(scope, b"cookie"))
            await self._events(cookie, receive, send, s, bus=page == "bus")
            return
        out = _secured(send)
        if part == "keys" and method == "GET" and rest == "keys":
            await send_json(out, 200, self._keys(s, query_of(scope)))
        elif part == "keys" and method == "GET" and not s.admin:
            key_id = rest[len("keys/") :]
            rec = next((r for r in self._visible(s) if r.id == key_id), None)
            if rec is None:
                raise E.NotFound(f"no key with id {key_id!r}")
            await send_json(out, 200, rec.public())
        elif part in ("keys", "owners"):
            self._admin_only(s)
            sub = rest[len("keys") :] if part == "keys" else "/" + rest
            await self.admin({**scope, "path": KEYS_PREFIX + sub, CALLER: s.key}, receive, out)
        elif part == "routing":  # reads and changes: the routing admin API's own routes
            self._admin_only(s)
            sub = rest[len("routing") :]
            await self.routing({**scope, "path": ROUTING_PREFIX + sub, CALLER: s.key}, receive, out)
        elif part == "adapters":
            await self._adapters(scope, receive, out, s, rest)
        elif rest in ("usage", "usage/export") and method == "GET":
            await self._usage(scope, out, s, export=rest == "usage/export")
        elif rest == "replicas" and method == "GET":
            self._admin_only(s)
            body = {"object": "list", "data": self._replicas(), "placements": self._placements()}
            await send_json(out, 200, body)
        elif rest == "audit" and method == "GET":
            self._admin_only(s)
            limit = _int(query_of(scope), "limit", 100, 1, 1000)
            try:
                events = await audit.read(self.admin.nc, limit=limit)
            except Exception:
                raise E.ServiceUnavailable("the audit trail (JetStream) is not reachable") from None
            data = [e.model_dump() for e in reversed(events)]
            await send_json(out, 200, {"object": "list", "data": data})
        elif rest == "bus" and method == "GET":
            self._admin_only(s)
            read = await self._read_bus()  # Refresh reads now; the feeds get it too
            self._bus.put(read)
            await send_json(out, 200, read)
        elif part == "jobs":
            await self._jobs(method, rest, out, s)
        elif rest == "responses" and method == "GET":
            await self._responses_page(scope, out, s)
        elif part == "responses":
            await self._response(method, rest, out, s)
        elif part == "files" and method == "GET" and rest.endswith("/content"):
            await self._file_content(unquote(rest[len("files/") : -len("/content")]), out, s)
        else:
            raise E.NotFound(f"no route for {method} {API}/{rest}")

    async def _adapters(
        self, scope: Scope, receive: Receive, send: Send, s: Session, rest: str
    ) -> None:
        """LoRA adapters listed, loaded and unloaded: the adapters admin API's own routes,
        as the session's key (admin sessions only, as the admin API allows)."""
        self._admin_only(s)
        if self.adapters is None:
            raise E.ServiceUnavailable("this bridge does not serve the adapters admin API")
        sub = rest[len("adapters") :]
        await self.adapters({**scope, "path": ADAPTERS_PREFIX + sub, CALLER: s.key}, receive, send)

    @staticmethod
    def _admin_only(s: Session) -> None:
        if not s.admin:
            raise E.InsufficientPermissions(
                f"the API key {s.key.id} is not an admin key: this page needs one"
            )

    def _visible(self, s: Session) -> list[KeyRecord]:
        """The keys a session may see: all for an admin, else its owner's (or itself)."""
        every: list[KeyRecord] = []
        if self._sessions is not None:
            every = self._sessions.keys.records()
        if s.admin:
            return every
        if not s.key.owner:
            return [r for r in every if r.id == s.key.id]
        return [r for r in every if r.owner == s.key.owner]

    def _keys(self, s: Session, query: dict[str, str]) -> dict[str, Any]:
        """A page of keys, newest first, matching ``q`` in id, name or owner."""
        offset = _int(query, "offset", 0, 0, 10_000_000)
        limit = _int(query, "limit", 50, 1, MAX_PAGE)
        q = query.get("q", "").strip().lower()[:200]
        state = query.get("state", "all")
        if state not in ("all", "enabled", "revoked"):
            raise E.InvalidRequest("state: all, enabled or revoked", param="state")
        recs = list(reversed(self._visible(s)))
        if q:
            recs = [r for r in recs if q in r.id or q in r.name.lower() or q in r.owner.lower()]
        if state != "all":
            recs = [r for r in recs if r.enabled == (state == "enabled")]
        page = recs[offset : offset + limit]
        return {
            "object": "list",
            "data": [r.public() for r in page],
            "total": len(recs),
            "offset": offset,
            "has_more": offset + len(page) < len(recs),
        }

    async def _usage(self, scope: Scope, send: Send, s: Session, export: bool) -> None:
        """The Spend page's view (console_spend.py), or every row as CSV (``export``)."""
        query = query_of(scope)
        try:
            span = parse_duration(query.get("since", "24h"))
        except ValueError as exc:
            raise E.InvalidRequest(f"since: {exc}", param="since") from None
        if not 0 < span <= console_usage.MAX_SPAN_S:
            raise E.InvalidRequest("since: from 1s to 31d", param="since")
        bucket = query.get("bucket", "hour")
        if bucket not in console_usage.BUCKETS:
            raise E.InvalidRequest("bucket: hour or day", param="bucket")
        fmt = query.get("format", "csv" if export else "json")
        if fmt not in ("json", "csv") or (export and fmt != "csv"):
            raise E.InvalidRequest("format: json or csv", param="format")
        measure = query.get("measure", "cost_usd")
        if measure not in console_spend.MEASURES:
            raise E.InvalidRequest("measure: cost_usd, tokens or requests", param="measure")
        offset = _int(query, "offset", 0, 0, 10_000_000)
        limit = _int(query, "limit", 50, 1, MAX_PAGE)
        key = query.get("key", "").strip()[:64] or None
        group = query.get("group", "key")
        if group not in console_spend.GROUPS:
            raise E.InvalidRequest("group: key or owner", param="group")
        owner = query.get("owner", "").strip()[:200] or None
        if owner is not None and not s.admin and owner != s.key.owner:
            raise E.NotFound(f"no owner {owner!r} among this session's keys")
        visible = self._visible(s)
        mine = None if s.admin else frozenset(r.id for r in visible)
        summary = await self._spend.get(
            (span, bucket, mine), lambda: self._summarize(span, bucket, mine)
        )
        owners = {r.id: r.owner for r in visible}  # keys' owners now, from the followed cache

        def owner_of(key_id: str) -> str:
            return owners.get(key_id, console_spend.NO_OWNER)

        if fmt == "json" and group == "owner":
            view = summary.by_owner(owner_of, owner, measure, offset, limit)
            view.update(owner=owner, budget=await self._owner_budget(owner))
            await send_json(send, 200, view)
            return
        if fmt == "json":
            await send_json(send, 200, summary.view(key, measure, offset, limit))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/csv; charset=utf-8"),
                    (b"content-disposition", b'attachment; filename="tokenbus-usage.csv"'),
                ],
            }
        )
        for chunk in summary.usage.csv_chunks(owner_of):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)  # other requests between chunks
        await send({"type": "http.response.body", "body": b""})

    async def _owner_budget(self, owner: str | None) -> dict[str, Any] | None:
        """An owner's budget as the admin API shows it, without its spend (the page draws
        its lines over the period's running total); None for no owner or no budget."""
        if owner is None:
            return None
        try:
            book = await budgets.SpendBook(self.admin.nc).open()
            b = await book.owner_budget(owner)
        except Exception:
            raise E.ServiceUnavailable("the spend budgets (JetStream) are not reachable") from None
        if b is None:
            return None
        return {
            "period": b.period,
            "budget_usd": None if b.hard is None else b.hard / 1e6,
            "soft_budget_usd": None if b.soft is None else b.soft / 1e6,
        }

    async def _summarize(
        self, span: float, bucket: str, mine: frozenset[str] | None
    ) -> console_spend.Summary:
        """Read the usage stream over the last ``span`` seconds and sum it, off the loop."""
        since = time.time() - span
        messages, truncated = await console_usage.read_messages(self.admin.nc, since)
        router = self.settings.router

        def work() -> console_spend.Summary:
            usage = console_usage.summarize(
                console_usage.records_of(messages),
                since,
                console_usage.BUCKETS[bucket],
                lambda m: router.routing_for(m).price if m else None,
                None if mine is None else mine.__contains__,
            )
            usage.truncated = truncated
            return console_spend.Summary.of(usage)

        return await asyncio.to_thread(work)

    async def _read_bus(self) -> dict[str, Any]:
        urls = list(self.settings.telemetry.nats_monitor_urls)
        return await console_bus.read(self.admin.nc, urls)

    def _replicas(self) -> list[dict[str, Any]]:
        """The replicas this bridge hears, as the replicas page shows them (each with its
        ``site`` and, where this bridge's router measured it, ``ack_ms``)."""
        now = time.monotonic()
        out = []
        for r in sorted(self.registry.all_live(), key=lambda r: (r.model, r.replica)):
            d = r.to_dict()
            d["health"] = "draining" if r.draining else "ok"
            d["load"] = round(r.load / max(1, r.max_concurrency), 3)
            d["seen_s_ago"] = round(max(0.0, now - r.last_seen), 1)
            d["adapters"] = sorted(r.adapters)
            d["kv_check"] = self._kv_check(r)
            out.append(d)
        return out

    def _placements(self) -> dict[str, Any]:
        """What this process's router did with requests at its own site (``TOKENBUS_SITE``):
        ``kept`` there, ``spilled`` to each other site (router/dispatch.py's
        ``tokenbus_router_site_placements_total``, since the process started)."""
        out: dict[str, Any] = {"site": self.settings.site or None, "kept": 0, "spilled": {}}
        for metric in SITE_PLACEMENTS.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                n, site = int(sample.value), sample.labels.get("site", "")
                if sample.labels.get("placement") == "local":
                    out["kept"] += n
                elif n:
                    out["spilled"][site] = out["spilled"].get(site, 0) + n
        return out

    def _kv_check(self, r: Replica) -> dict[str, Any] | None:
        """The closed loop on ``r``'s KV-cache hits (router/kv_check.py): its heartbeats'
        totals of predicted and reported cached prompt tokens, their ratio, and this bridge's
        verdict where it routes in-process; None when its heartbeats carry no totals."""
        totals = r.kv_check
        if totals is None:
            return None
        predicted, reported = totals.get("predicted", 0), totals.get("reported", 0)
        verdict: str | None = None
        if self.kv is not None:
            if r.replica in self.kv.incompatible:
                verdict = "incompatible"
            elif r.replica in self.kv.disagreeing:
                verdict = "distrusted"
            else:
                verdict = "trusted"
        return {
            "requests": totals.get("requests", 0),
            "predicted": predicted,
            "reported": reported,
            # What the engine read from its cache per token the router predicted it would.
            "ratio": round(reported / predicted, 3) if predicted else None,
            "verdict": verdict,
        }

    async def _jobs(self, method: str, rest: str, send: Send, s: Session) -> None:
        if self.batches is None:
            raise E.ServiceUnavailable("this bridge does not serve the Batch API")
        parts = rest.split("/")
        if method == "GET" and len(parts) == 1:
            try:
                found: list[dict[str, Any]]
                if s.admin:
                    recs = await self.batches.all()
                    found = [dict(r["batch"], owner=r.get("owner", "")) for r in recs]
                else:
                    found = []
                    for r in self._visible(s):
                        found += [dict(b, owner=r.id) for b in await self.batches.owned(r.id)]
            except E.TokenbusError:
                raise
            except Exception:
                raise E.ServiceUnavailable("the batch store (JetStream) is not reachable") from None
            found.sort(key=lambda b: -int(b.get("created_at") or 0))
            data = found[:MAX_JOBS]
            await send_json(send, 200, {"object": "list", "data": data, "total": len(found)})
        elif method == "POST" and len(parts) == 3 and parts[2] == "cancel":
            batch_id = unquote(parts[1])
            loaded = await self.batches.load(batch_id)
            if loaded is None:
                raise E.NotFound(f"no batch {batch_id!r}")
            await send_json(send, 200, await self.batches.cancel(batch_id, loaded[0]["owner"]))
        else:
            raise E.NotFound(f"no route for {method} {API}/{rest}")

    async def _response(self, method: str, rest: str, send: Send, s: Session) -> None:
        """One background response by id (the listing is :meth:`_responses_page`). An owner
        session sees its owner's keys' responses only (404 otherwise); a cancel is the
        Responses API's."""
        api = self.responses
        if api is None or api.store is None:
            raise E.ServiceUnavailable("this bridge does not serve background responses")
        parts = rest.split("/")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "cancel"):
            raise E.NotFound(f"no route for {method} {API}/{rest}")
        rid = unquote(parts[1])
        if not RESPONSE_ID.match(rid):
            raise response_not_found(rid)
        try:
            # One read says whose it is (a large record's pointer names its owner too).
            entry = await (await api.store.opened()).get(rid)
            owner = str(json.loads(entry.value or b"{}").get("owner", ""))
        except E.TokenbusError:
            raise
        except (KeyNotFoundError, KeyDeletedError, ValueError, AttributeError):
            raise response_not_found(rid) from None
        except Exception:
            raise E.ServiceUnavailable("the response store (JetStream) did not answer") from None
        if not s.admin and owner not in {r.id for r in self._visible(s)}:
            raise response_not_found(rid)
        rec = await api.store.get(rid, owner)
        if not rec.get("background"):
            raise response_not_found(rid)  # a stored response, not a job
        resp: dict[str, Any] = rec["response"]
        if len(parts) == 3 and method == "POST":
            if api.background is None:
                raise E.ServiceUnavailable("this bridge does not run background responses")
            resp = await api.background.cancel(rid, rec)
        elif method != "GET" or len(parts) != 2:
            raise E.NotFound(f"no route for {method} {API}/{rest}")
        keep = ("id", "status", "model", "created_at")
        await send_json(send, 200, {**{k: resp.get(k) for k in keep}, "owner": owner})

    async def _responses_page(self, scope: Scope, send: Send, s: Session) -> None:
        """A page of background responses, newest first (jobs/background_index.py): every
        owner's for an admin session, else only those of the session's visible keys (an
        ``after`` naming another's is refused as one that does not exist). Each open one
        says how many of its events are kept so far (``events``)."""
        api = self.responses
        index = api.store.index if api is not None and api.store is not None else None
        if api is None or index is None:
            raise E.ServiceUnavailable("this bridge does not serve background responses")
        query = query_of(scope)
        after = query.get("after") or None
        if after is not None and not RESPONSE_ID.match(after):
            raise E.InvalidRequest("after: a response id (resp_...)", param="after")
        owners = None if s.admin else [r.id for r in self._visible(s)]
        listed = await index.newest_first(owners)
        page = list_page(listed, query, default=50, most=MAX_RESPONSES_PAGE)
        rows: list[dict[str, Any]] = [dict(e) for e in page["data"]]
        bg = api.background
        if bg is not None:
            still = [r for r in rows if r.get("status") in ("queued", "in_progress")]

            async def progress(row: dict[str, Any]) -> None:
                with contextlib.suppress(Exception):  # a row without it, not a failed page
                    row["events"] = await bg.events_kept(str(row["id"]))

            await asyncio.gather(*(progress(r) for r in still))
        await send_json(send, 200, {**page, "data": rows, "total": len(listed)})

    async def _file_content(self, file_id: str, send: Send, s: Session) -> None:
        """A file's bytes as an attachment: any file for an admin session, else only a file
        of the session's visible keys; 404 for every other file, as for one that is not."""
        if self.files is None or self.files.obs is None:
            raise E.ServiceUnavailable("this bridge does not serve the Files API")
        if not file_id or "/" in file_id:
            raise file_not_found(file_id)
        try:
            # One read of the object's description says whose it is (jobs/files.py).
            info = await self.files.obs.get_info(file_id)
        except (ObjectNotFoundError, NotFoundError, BadRequestError):
            raise file_not_found(file_id) from None
        except Exception:
            raise E.ServiceUnavailable("the file store (JetStream) did not answer; retry") from None
        try:
            rec = json.loads(info.description or "")
            owner = str(rec["owner"])
            name = str(rec["file"].get("filename") or file_id)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise file_not_found(file_id) from None
        if info.deleted:
            raise file_not_found(file_id)
        if not s.admin and owner not in {r.id for r in self._visible(s)}:
            raise file_not_found(file_id)
        data = await self.files.content(file_id, owner)
        safe = _SAFE_NAME.sub("_", name)[:128] or file_id
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    # Never rendered: bytes to save, whatever they hold (nosniff is on).
                    (b"content-type", b"application/octet-stream"),
                    (b"content-disposition", f'attachment; filename="{safe}"'.encode()),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        for at in range(0, len(data), FILE_CHUNK):
            body = data[at : at + FILE_CHUNK]
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    # -- the live feed -------------------------------------------------------------------
    async def _events(
        self, cookie: str | None, receive: Receive, send: Send, s: Session, bus: bool = False
    ) -> None:
        """Server-sent events until the client leaves or the session ends: ``replicas``
        (admin sessions) when they change, ``keys`` (the number visible) when it changes,
        ``bus`` (admin sessions whose page shows the Bus page: ``bus``) when the shared bus
        read changes, ``end`` when the session is over. One feed holds its last snapshot of
        each, nothing more; the bus read is one per bridge process (console_bus.Latest)."""
        if self._feeds >= MAX_FEEDS:
            raise E.ServiceUnavailable("too many console pages open on this bridge; retry")
        self._feeds += 1
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await _secured(send)(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            last: dict[str, str] = {}
            pinged = time.monotonic()
            seen_changes, visible = -1, 0
            sessions = await self.sessions()
            while not gone.is_set():
                try:
                    s = await sessions.check(cookie)
                except E.TokenbusError as exc:
                    await self._event(send, "end", json.dumps({"reason": exc.message}))
                    break
                # The keys seen are counted again only when the store changed: a feed costs
                # no walk over 10 000 keys a second.
                changes = self._sessions.keys.changes if self._sessions is not None else 0
                if changes != seen_changes:
                    seen_changes = changes
                    visible = len(self._visible(s))
                keys: dict[str, int] = {"count": visible}
                if s.admin:  # an edit changes no count: the keys page reloads on this too
                    keys["changes"] = changes
                snap = {"keys": json.dumps(keys)}
                if s.admin:
                    snap["replicas"] = json.dumps(self._replicas())
                    shared = self._bus.get() if bus else None
                    if shared is not None:
                        snap["bus"] = shared
                sent = False
                for name, data in snap.items():
                    if last.get(name) != data:
                        await self._event(send, name, data)
                        last[name] = data
                        sent = True
                now = time.monotonic()
                if not sent and now - pinged >= FEED_PING_S:
                    ping = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}
                    await send(ping)
                if sent or now - pinged >= FEED_PING_S:
                    pinged = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gone.wait(), FEED_TICK_S)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._feeds -= 1
            watcher.cancel()

    @staticmethod
    async def _event(send: Send, name: str, data: str) -> None:
        body = f"event: {name}\ndata: {data}\n\n".encode()
        await send({"type": "http.response.body", "body": body, "more_body": True})
