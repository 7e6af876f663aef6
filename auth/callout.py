"""One identity per API key on NATS: the auth service's answer to nats-server's auth callout.

On the locked bus of ``tokenbus up`` a NATS client logs in with its tokenbus API key as the
connect token. nats-server hands each such connection to this responder
(``$SYS.REQ.USER.AUTH``, on the callout account's own connection), which checks the key in
the same watched key store as the auth stage and answers with a user JWT placing the
connection in the tokenbus account with that key's permissions only:

* publish requests (``tb.v1.req.*``) and cancels (``tb.v1.worker.*.cancel``; a cancel names
  its stream by the caller's inbox, which no other key can see);
* its files and batches (``tb.v1.req.batches.*``, answered by ingress);
* subscribe under the key's own inbox root (``_INBOX.tbk.<key id>.>``) and to its own
  finished batches (``tb.v1.batch.done.<key id>``), nothing else: the client's watchdog
  follows its replicas by keepalive frames on its own streams (``Tb-Keepalive``), not by
  heartbeats.

Not another key's inboxes, not ``_INBOX.>`` or ``>``, not the heartbeat, worker, stage,
usage, telemetry or admin subjects. The services log in as their roles, bypassing the
callout. A revoked, disabled or expired key's live connections are closed within about a
second (the system account's ``KICK`` request for each connection of that key).
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

from auth.keys import KeyRecord
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
        # key id -> {(server id, client id)} of its live connections
        self.connections: dict[str, set[tuple[str, int]]] = {}
        self._connected = asyncio.Event()  # set while some key has a connection to watch
        self._checker: asyncio.Task[None] | None = None

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
        self._checker = asyncio.get_running_loop().create_task(self._check_loop())

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
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
            answer = natsjwt.authorization_response(
                user_nkey, server_id, self.signer, jwt=self._user_jwt(user_nkey, rec)
            )
            cid = (req.get("client_info") or {}).get("id")
            if isinstance(cid, int):
                self.connections.setdefault(rec.id, set()).add((server_id, cid))
                self._connected.set()
            self.log.info("nats_login", key_id=rec.id)
        if msg.reply:
            await msg.respond(answer.encode())

    def _user_jwt(self, user_nkey: str, rec: KeyRecord) -> str:
        pub, sub = key_permissions(rec.id)
        expires = int(rec.expires_at) if rec.expires_at else None
        return natsjwt.user_jwt(user_nkey, ACCOUNT, f"key-{rec.id}", pub, sub, self.signer, expires)

    # -- revocation -------------------------------------------------------------------------
    async def _on_disconnect(self, msg: Msg) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            event = json.loads(msg.data)
            client = event["client"]
            gone = (str(event["server"]["id"]), int(client["id"]))
            for conns in self.connections.values():
                conns.discard(gone)

    def _still_valid(self, key_id: str) -> bool:
        rec = self.keys.record(key_id)
        return rec is not None and rec.enabled and not rec.expired(time.time())

    async def _check_loop(self) -> None:
        while True:
            if not self.connections:
                self._connected.clear()
                await self._connected.wait()
            await asyncio.sleep(CHECK_INTERVAL_S)
            for key_id in [k for k, c in self.connections.items() if c]:
                if not self._still_valid(key_id):
                    await self.kick(key_id)
            for key_id in [k for k, c in self.connections.items() if not c]:
                del self.connections[key_id]

    async def kick(self, key_id: str) -> None:
        """Close every live connection of ``key_id`` (it was revoked or expired)."""
        conns = self.connections.pop(key_id, set())
        if self._sys is None:
            return
        for server_id, cid in conns:
            with contextlib.suppress(Exception):
                await self._sys.request(
                    f"$SYS.REQ.SERVER.{server_id}.KICK",
                    json.dumps({"cid": cid}).encode(),
                    timeout=2,
                )
        if conns:
            self.log.info("nats_connections_closed", key_id=key_id, connections=len(conns))
