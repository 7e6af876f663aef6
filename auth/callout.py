"""One identity per API key on NATS: the auth service's answer to nats-server's auth callout.

On the locked bus of ``tokenbus up`` a NATS client logs in with its tokenbus API key as the
connect token. nats-server hands each such connection to this responder
(``$SYS.REQ.USER.AUTH``, on the callout account's own connection), which checks the key in
the same watched key store as the auth stage and answers with a user JWT placing the
connection in the tokenbus account with that key's permissions only:

* publish requests (``tb.v1.req.*``) and cancels (``tb.v1.worker.*.cancel``; a cancel names
  its stream by the caller's inbox, which no other key can see);
* its files and batches (``tb.v1.req.batches.*``, answered by ingress);
* its own claim-checked request bodies (``tb.v1.body.tbk.<key id>.>``), written only; what
  they hold is bounded per key, and those it marks done are deleted, by
  :mod:`auth.bodyquota` in this same service;
* subscribe under the key's own inbox root (``_INBOX.tbk.<key id>.>``) and to its own
  finished batches (``tb.v1.batch.done.<key id>``), nothing else: the client's watchdog
  follows its replicas by keepalive frames on its own streams (``Tb-Keepalive``), not by
  heartbeats.

Not another key's inboxes, not ``_INBOX.>`` or ``>``, not the heartbeat, worker, stage,
usage, telemetry or admin subjects. The services log in as their roles, bypassing the
callout. A revoked, disabled or expired key's live connections are closed within about a
second (the system account's ``KICK`` request for each connection of that key).

Sessions follow the secret they logged in with (issue 64): the user JWT's name is
``key-<id>.<fingerprint of the secret presented>``, so the sessions of a secret that stopped
working (revoked, disabled, expired, or the secret before a rotation once its overlap
ended) are found on every server from its connection list (``$SYS.REQ.SERVER.PING.CONNZ``)
and closed, every :data:`RECONCILE_S`: also those opened before this auth instance started,
which its own memory of logins does not hold.

Not per-key bus limits: nats-server (2.15, accounts in its config file) does not apply the
``subs`` and ``payload`` limits of a user JWT the callout answers with (tried: a connection
whose JWT said 2 subscriptions held 3; one whose JWT said 1 KiB sent 4 KiB). That needs the
operator mode's account JWTs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from auth.keys import KeyRecord, hash_key
from auth.store import KeyStore
from bus_schemas import errors as E
from bus_schemas import subjects
from services import natsjwt
from services.runtime import connect, flush

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
QUEUE = "tokenbus-callout"
# The account tokenbus' services and clients share on the locked bus.
ACCOUNT = "TB"
# How often live connections are checked against the key store (revocation latency).
CHECK_INTERVAL_S = 0.25
# How often every server's connections of keys are checked against the key store: the
# sessions this instance did not see log in (made before it started) and rotated secrets.
RECONCILE_S = 2.0
# The user JWT's name: ``key-<key id>.<fingerprint of the secret the session presented>``.
JWT_NAME_PREFIX = "key-"


def fingerprint(secret_hash: str) -> str:
    """What names a secret in a session's JWT: the head of its stored SHA-256 (a 256-bit
    random secret's hash: nothing of the secret can be had from it)."""
    return secret_hash[:16]


def session_name(key_id: str, secret_hash: str) -> str:
    return f"{JWT_NAME_PREFIX}{key_id}.{fingerprint(secret_hash)}"


def parse_session_name(name: str) -> tuple[str, str] | None:
    """(key id, fingerprint) of a session's JWT name, or None for any other connection."""
    if not name.startswith(JWT_NAME_PREFIX):
        return None
    key_id, _, fp = name[len(JWT_NAME_PREFIX) :].partition(".")
    return (key_id, fp) if key_id else None


def secret_valid(rec: KeyRecord | None, fp: str, now: float) -> bool:
    """Whether the secret a session presented (its fingerprint ``fp``) still works."""
    if rec is None or not rec.enabled or rec.expired(now):
        return False
    if fp == fingerprint(rec.hash):
        return True
    return bool(
        rec.previous_hash
        and rec.previous_until is not None
        and now < rec.previous_until
        and fp == fingerprint(rec.previous_hash)
    )


def key_permissions(key_id: str) -> tuple[list[str], list[str]]:
    """(may publish, may subscribe) of a connection logged in with API key ``key_id``."""
    pub = [
        f"{subjects.PREFIX}.req.*",
        # A request to one ingress that beats (services/members.py): the same requests.
        subjects.to_any_member(subjects.requests_wildcard()),
        f"{subjects.PREFIX}.worker.*.cancel",
        # Its stored Responses API responses (ingress checks the key and the owner).
        subjects.responses_state_wildcard(),
        # Its files and batches (ingress checks the key and the owner; docs/batches.md).
        subjects.batches_state_wildcard(),
        # Its own claim-checked request bodies, written only (services/bodies.py).
        subjects.key_bodies(key_id),
    ]
    # Its own inboxes, and the announcements of its own finished batches.
    # Which ingress beats (services/members.py).
    sub = [
        f"{subjects.key_inbox_root(key_id)}.>",
        subjects.batch_done(key_id),
        subjects.members(subjects.QUEUE_INGRESS),
    ]
    return pub, sub


@dataclass(frozen=True, slots=True)
class CalloutCredentials:
    """What the responder needs, from ``callout.json`` of the generated bus config."""

    issuer_seed: str
    user: str
    password: str
    sys_user: str
    sys_password: str

    @classmethod
    def load(cls, path: str | Path) -> CalloutCredentials:
        data = json.loads(Path(path).read_text())
        return cls(
            issuer_seed=str(data["issuer_seed"]),
            user=str(data["user"]),
            password=str(data["password"]),
            sys_user=str(data["sys_user"]),
            sys_password=str(data["sys_password"]),
        )


class CalloutResponder:
    """Answers authorization requests with per-key user JWTs; kicks revoked keys."""

    def __init__(
        self,
        keys: KeyStore,
        url: str,
        creds: CalloutCredentials,
        log: Any,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.keys = keys
        self.url = url
        self.options = options or {}  # more connect options (the TLS context)
        self.creds = creds
        self.log = log
        self.signer = natsjwt.keypair(creds.issuer_seed)
        self._nc: NATS | None = None
        self._sys: NATS | None = None
        # key id -> {(server id, client id, fingerprint of its secret)} of its live connections
        self.connections: dict[str, set[tuple[str, int, str]]] = {}
        self._connected = asyncio.Event()  # set while some key has a connection to watch
        self._checker: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._nc = await connect(
            self.url,
            "tokenbus-callout",
            user=self.creds.user,
            password=self.creds.password,
            **self.options,
        )
        self._sys = await connect(
            self.url,
            "tokenbus-callout-sys",
            user=self.creds.sys_user,
            password=self.creds.sys_password,
            **self.options,
        )
        await self._nc.subscribe(AUTH_SUBJECT, queue=QUEUE, cb=self._on_request)
        await self._sys.subscribe("$SYS.ACCOUNT.*.DISCONNECT", cb=self._on_disconnect)
        await flush(self._nc, timeout=5)  # the server has the subscriptions
        loop = asyncio.get_running_loop()
        self._checker = loop.create_task(self._check_loop())
        self._reconciler = loop.create_task(self._reconcile_loop())

    async def stop(self) -> None:
        for task in (self._checker, self._reconciler):
            if task is not None:
                task.cancel()
        for nc in (self._nc, self._sys):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.drain()

    # -- connect ----------------------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        try:
            claims = natsjwt.decode(msg.data)
            req = claims["nats"]
            user_nkey = str(req["user_nkey"])
            server_id = str(req["server_id"]["id"])
        except (KeyError, TypeError, ValueError):
            self.log.warning("callout_malformed_request")
            return
        token = (req.get("connect_opts") or {}).get("auth_token")
        try:
            await self.keys.catch_up(token)
            rec = self.keys.lookup(token)
        except E.TokenbusError as exc:
            self.log.info("nats_login_refused", reason=exc.code)
            answer = natsjwt.authorization_response(
                user_nkey, server_id, self.signer, error=exc.message
            )
        else:
            presented = hash_key(str(token).strip())
            answer = natsjwt.authorization_response(
                user_nkey, server_id, self.signer, jwt=self._user_jwt(user_nkey, rec, presented)
            )
            cid = (req.get("client_info") or {}).get("id")
            if isinstance(cid, int):
                fp = fingerprint(presented)
                self.connections.setdefault(rec.id, set()).add((server_id, cid, fp))
                self._connected.set()
            self.log.info("nats_login", key_id=rec.id)
        if msg.reply:
            await msg.respond(answer.encode())

    def _user_jwt(self, user_nkey: str, rec: KeyRecord, presented: str) -> str:
        pub, sub = key_permissions(rec.id)
        expires = int(rec.expires_at) if rec.expires_at else None
        # A secret before a rotation: its session ends with the overlap at the latest.
        if presented != rec.hash and rec.previous_until:
            expires = min(expires or int(rec.previous_until), int(rec.previous_until))
        name = session_name(rec.id, presented)
        return natsjwt.user_jwt(user_nkey, ACCOUNT, name, pub, sub, self.signer, expires)

    # -- revocation -------------------------------------------------------------------------
    async def _on_disconnect(self, msg: Msg) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            event = json.loads(msg.data)
            client = event["client"]
            gone = (str(event["server"]["id"]), int(client["id"]))
            for conns in self.connections.values():
                for c in [c for c in conns if c[:2] == gone]:
                    conns.discard(c)

    async def _check_loop(self) -> None:
        while True:
            if not self.connections:
                self._connected.clear()
                await self._connected.wait()
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.time()
            for key_id in [k for k, c in self.connections.items() if c]:
                # Each session by the secret it presented: all of a key revoked, disabled or
                # expired, those of a rotated secret once its overlap ends.
                rec = self.keys.record(key_id)
                stale = {c for c in self.connections[key_id] if not secret_valid(rec, c[2], now)}
                if stale:
                    self.connections[key_id] -= stale
                    await self._kick_each(key_id, stale)
            for key_id in [k for k, c in self.connections.items() if not c]:
                del self.connections[key_id]

    async def _kick_each(self, key_id: str, conns: set[tuple[str, int, str]]) -> None:
        if self._sys is None:
            return
        for server_id, cid, _ in conns:
            with contextlib.suppress(Exception):
                await self._sys.request(
                    f"$SYS.REQ.SERVER.{server_id}.KICK",
                    json.dumps({"cid": cid}).encode(),
                    timeout=2,
                )
        if conns:
            self.log.info("nats_connections_closed", key_id=key_id, connections=len(conns))

    # -- every server's sessions, whoever saw them log in -----------------------------------
    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a server busy or away: the next round
                self.log.warning("callout_reconcile_failed", error=str(exc))

    async def reconcile(self) -> int:
        """Close, on every server, each key's session whose secret stopped working (its key
        revoked, disabled or expired, or a rotated secret past its overlap); how many."""
        if self._sys is None:
            return 0
        stale: dict[str, set[tuple[str, int, str]]] = {}
        now = time.time()
        for server_id, conn in await self._sessions():
            parsed = parse_session_name(str(conn.get("authorized_user") or ""))
            cid = conn.get("cid")
            if parsed is None or not isinstance(cid, int):
                continue
            key_id, fp = parsed
            if not secret_valid(self.keys.record(key_id), fp, now):
                stale.setdefault(key_id, set()).add((server_id, cid, fp))
        for key_id, conns in stale.items():
            self.connections.get(key_id, set()).difference_update(conns)
            await self._kick_each(key_id, conns)
        return sum(len(c) for c in stale.values())

    async def _sessions(self) -> list[tuple[str, dict[str, Any]]]:
        """(server id, connection) of every open connection in the tokenbus account, from
        every server that answers within a moment."""
        assert self._sys is not None
        inbox = self._sys.new_inbox()
        got: list[tuple[str, dict[str, Any]]] = []
        last = asyncio.Event()

        async def on_reply(msg: Msg) -> None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                body = json.loads(msg.data)
                if body.get("error"):
                    self.log.warning("callout_connz_refused", error=str(body["error"])[:200])
                server_id = str(body["server"]["id"])
                for conn in body["data"].get("connections") or []:
                    got.append((server_id, conn))
            last.set()

        sub = await self._sys.subscribe(inbox, cb=on_reply)
        try:
            query = {"acc": ACCOUNT, "auth": True, "limit": 100_000}
            await self._sys.publish(
                "$SYS.REQ.SERVER.PING.CONNZ", json.dumps(query).encode(), reply=inbox
            )
            # Every server answers at once; after the first, the others within a moment.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(last.wait(), 2)
                while True:
                    last.clear()
                    await asyncio.wait_for(last.wait(), 0.25)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return got
