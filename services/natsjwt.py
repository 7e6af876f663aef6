"""NATS nkeys and JWTs, as far as the auth callout needs them.

The locked bus of ``tokenbus up`` lets NATS clients log in with their tokenbus API key: the
server hands every such connection to the auth service (nats-server's *auth callout*,
``$SYS.REQ.USER.AUTH``), which answers with a user JWT carrying that key's permissions,
signed by the callout's account key (``ed25519-nkey``, NATS's JWT flavour). The signing
uses the ``nkeys`` package (ed25519 through PyNaCl): no Go tooling is needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nkeys

_HEADER = base64.urlsafe_b64encode(
    json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}, separators=(",", ":")).encode()
).rstrip(b"=")


def new_account_seed() -> str:
    """A fresh account nkey seed (``SA...``): the callout's issuer."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    return seed.decode()


def keypair(seed: str) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(seed.encode()))


def public_key(seed: str) -> str:
    """The public key (``A...``) of an account seed."""
    key: bytes = keypair(seed).public_key
    return key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """``claims`` as a NATS JWT issued and signed by ``signer``."""
    body = {**claims, "iss": signer.public_key.decode(), "iat": int(time.time())}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signing_input = _HEADER.decode() + "." + payload
    return signing_input + "." + _b64(signer.sign(signing_input.encode()))


def decode(token: str | bytes) -> dict[str, Any]:
    """The claims of a JWT (the server's authorization request). Its signature is not
    checked: it arrives from the server over the callout account's own subscription, which
    only the server may publish to."""
    text = token.decode() if isinstance(token, bytes) else token
    parts = text.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    raw = parts[1] + "=" * (-len(parts[1]) % 4)
    claims = json.loads(base64.urlsafe_b64decode(raw))
    if not isinstance(claims, dict):
        raise ValueError("JWT claims are not an object")
    return claims


def user_jwt(
    user_nkey: str,
    account: str,
    name: str,
    pub: list[str],
    sub: list[str],
    signer: nkeys.KeyPair,
    expires: int | None = None,
) -> str:
    """A user JWT placing the connection in ``account`` with these permissions."""
    claims: dict[str, Any] = {
        "sub": user_nkey,
        "aud": account,
        "name": name,
        "nats": {
            "pub": {"allow": pub},
            "sub": {"allow": sub},
            "type": "user",
            "version": 2,
        },
    }
    if expires:
        claims["exp"] = int(expires)
    return encode(claims, signer)


def authorization_response(
    user_nkey: str, server_id: str, signer: nkeys.KeyPair, *, jwt: str = "", error: str = ""
) -> str:
    """The answer to one authorization request: the user JWT, or an error."""
    nats_claims: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if jwt:
        nats_claims["jwt"] = jwt
    else:
        nats_claims["error"] = error or "not authorized"
    return encode({"sub": user_nkey, "aud": server_id, "nats": nats_claims}, signer)
