"""The console's sessions: an API key exchanged for a signed, expiring cookie.

A session is a token ``<payload>.<signature>`` (both base64url): the payload names the key
id, the role (``admin``, or ``owner`` for a key that is not an admin key), the expiry, a
random nonce and a fingerprint of the secret the key presented; the signature is an
HMAC-SHA256 under a secret every bridge of the bus shares (the entry ``console`` of the
``tokenbus_secrets`` bucket, made by the first bridge that needs it). So any bridge process
accepts a session another one made, and a bridge restart keeps them.

A session is checked against the live key record on every request (the key store follows
its bucket): revoking, disabling, expiring or rotating the key, or taking its admin flag
away, ends its sessions within the store's follow delay. The key itself is never in the
token, a URL, a log line or the browser's storage. The CSRF token of a session is derived
from its nonce (an HMAC too), so it needs no state either. Logout clears the cookie and
forgets the nonce in this process (:class:`Sessions` keeps those, bounded, until they
expire).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.js.errors import KeyWrongLastSequenceError

from auth.keys import KeyRecord, hash_key
from auth.limits import SECRETS_BUCKET
from auth.store import KeyStore
from bus_schemas import errors as E
from services import buckets

COOKIE = "tb_console"
COOKIE_PATH = "/console"
SECRET_ENTRY = "console"
SESSION_S = 8 * 3600.0  # how long a session lasts from its login
# Logged-out nonces kept in memory at most (each until its session would have expired).
MAX_LOGGED_OUT = 100_000

Role = Literal["admin", "owner"]


@dataclass(frozen=True, slots=True)
class Session:
    """One checked session: whose, in which role, until when, and its CSRF token."""

    key: KeyRecord
    role: Role
    expires_at: float
    nonce: str
    csrf: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Makes and checks console sessions over a key store (the secret opens on first use)."""

    def __init__(self, nc: NATS, keys: KeyStore, lifetime_s: float = SESSION_S) -> None:
        self.nc = nc
        self.keys = keys
        self.lifetime_s = lifetime_s
        self._secret = b""
        self._logged_out: dict[str, float] = {}  # nonce -> when its session expires

    async def secret(self) -> bytes:
        """The shared signing secret (made by the first bridge that needs one)."""
        if self._secret:
            return self._secret
        try:
            kv = await buckets.open_kv(self.nc.jetstream(), SECRETS_BUCKET)
            with contextlib.suppress(KeyWrongLastSequenceError):  # another bridge made it
                await buckets.create(kv, SECRET_ENTRY, secrets.token_bytes(32))
            entry = await buckets.through_stall(lambda: kv.get(SECRET_ENTRY), what=SECRETS_BUCKET)
        except Exception:
            raise E.ServiceUnavailable(
                "the console's session secret (JetStream KV) is not reachable; retry"
            ) from None
        self._secret = bytes(entry.value or b"")
        if len(self._secret) < 16:
            raise E.ServiceUnavailable("the console's session secret is not usable")
        return self._secret

    def _mac(self, secret: bytes, what: str) -> str:
        return hmac.new(secret, what.encode(), hashlib.sha256).hexdigest()

    async def login(self, key: str, now: float | None = None) -> tuple[str, Session]:
        """(token, session) for a presented API key; 401 for one that is not valid."""
        rec = self.keys.lookup(key)  # constant-time; 401 without saying which part was wrong
        secret = await self.secret()
        now = time.time() if now is None else now
        expires = now + self.lifetime_s
        if rec.expires_at is not None:
            expires = min(expires, rec.expires_at)
        role: Role = "admin" if rec.admin else "owner"
        nonce = secrets.token_hex(16)
        payload = {
            "k": rec.id,
            "r": role,
            "e": int(expires),
            "n": nonce,
            # Which of the key's secrets was presented (a rotation ends the session).
            "f": self._mac(secret, "fp:" + hash_key(key.strip()))[:32],
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        token = f"{body}.{_b64(hmac.new(secret, body.encode(), hashlib.sha256).digest())}"
        return token, self._session(rec, role, float(int(expires)), nonce, secret)

    def _session(
        self, rec: KeyRecord, role: Role, expires: float, nonce: str, secret: bytes
    ) -> Session:
        return Session(rec, role, expires, nonce, self._mac(secret, "csrf:" + nonce)[:32])

    async def check(self, token: str | None, now: float | None = None) -> Session:
        """The session of a cookie's token; 401 when there is none, it is forged, expired,
        logged out, or its key no longer valid (or no longer an admin key for an admin
        session)."""
        if not token:
            raise E.Unauthorized("no console session: log in with an API key")
        secret = await self.secret()
        now = time.time() if now is None else now
        try:
            body, sig = token.split(".", 1)
            good = hmac.new(secret, body.encode(), hashlib.sha256).digest()
            if not hmac.compare_digest(good, _unb64(sig)):
                raise ValueError("signature")
            p: dict[str, Any] = json.loads(_unb64(body))
            key_id, role, expires, nonce, fp = p["k"], p["r"], float(p["e"]), p["n"], p["f"]
        except (ValueError, KeyError, TypeError):
            raise E.Unauthorized("the console session is not valid: log in again") from None
        if expires <= now or nonce in self._logged_out:
            raise E.Unauthorized("the console session has ended: log in again")
        rec = self.keys.by_id(str(key_id))  # 401 once the key is revoked, expired or gone
        current = self._mac(secret, "fp:" + rec.hash)[:32]
        before = rec.previous_hash and (rec.previous_until or 0) > now
        old = self._mac(secret, "fp:" + rec.previous_hash)[:32] if before else ""
        if not (hmac.compare_digest(fp, current) or (old and hmac.compare_digest(fp, old))):
            raise E.Unauthorized("the key of this console session was rotated: log in again")
        if role not in ("admin", "owner") or (role == "admin" and not rec.admin):
            raise E.Unauthorized("the key of this console session is no longer an admin key")
        return self._session(rec, role, expires, str(nonce), secret)

    def logout(self, session: Session, now: float | None = None) -> None:
        """Forget ``session`` in this process (its cookie is cleared by the response)."""
        now = time.time() if now is None else now
        if len(self._logged_out) >= MAX_LOGGED_OUT:
            self._logged_out = {n: e for n, e in self._logged_out.items() if e > now}
            while len(self._logged_out) >= MAX_LOGGED_OUT:  # all live: the oldest go
                self._logged_out.pop(next(iter(self._logged_out)))
        self._logged_out[session.nonce] = session.expires_at

    def cookie(self, token: str, session: Session, secure: bool, now: float | None = None) -> bytes:
        """The ``Set-Cookie`` value of a new session."""
        now = time.time() if now is None else now
        age = max(0, int(session.expires_at - now))
        flags = f"; Path={COOKIE_PATH}; Max-Age={age}; HttpOnly; SameSite=Strict"
        return f"{COOKIE}={token}{flags}{'; Secure' if secure else ''}".encode()

    @staticmethod
    def clear_cookie(secure: bool) -> bytes:
        """The ``Set-Cookie`` value that ends the session in the browser."""
        flags = f"; Path={COOKIE_PATH}; Max-Age=0; HttpOnly; SameSite=Strict"
        return f"{COOKIE}={flags}{'; Secure' if secure else ''}".encode()


def token_of(cookie_header: str | None) -> str | None:
    """The session token in a ``Cookie`` request header, if any."""
    for part in (cookie_header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and value:
            return value
    return None
