"""API keys: random, recognisable, shown once, stored only as a hash, compared in constant time.

A key looks like ``tb-<id>_<secret>``: ``id`` is 12 hex characters that name the key in the
store and in logs (never secret); ``secret`` is 32 random bytes (256 bits) in URL-safe
base64. The store keeps SHA-256 of the whole key: with 256 bits of entropy a slow password
hash buys nothing, and a fast one keeps auth off the latency budget.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

PREFIX = "tb-"
_KEY = re.compile(r"tb-([0-9a-f]{12})_([A-Za-z0-9_\-]{43})")


Tier = Literal["priority", "default", "flex"]
TIER_RANK = {"priority": 0, "default": 1, "flex": 2}


class KeyRecord(BaseModel):
    """What the store keeps about one key (never the key itself)."""

    id: str = Field(description="Public key id (the 12 hex characters after tb-).")
    name: str = Field(description="Human name of the key.")
    owner: str = Field(default="", description="Who the key belongs to.")
    hash: str = Field(description="SHA-256 of the whole key, hex.")
    models: list[str] = Field(default_factory=list, description="Allowed models; empty = all.")
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="This key's model aliases, name -> served model; they win over the global "
        "ones (docs/routing.md).",
    )
    rpm: int | None = Field(default=None, description="Requests per minute; none = unlimited.")
    tpm: int | None = Field(default=None, description="Tokens per minute; none = unlimited.")
    max_concurrent: int | None = Field(default=None, description="Requests at once.")
    max_body_bytes: int | None = Field(
        default=None,
        ge=0,
        description="What the key's own large request bodies (uploaded by its NATS "
        "connections) may hold in the store at once; none = bodies.max_bytes_per_key, "
        "0 = no bound (docs/large-requests.md).",
    )
    filter_policy: str = Field(default="default", description="Content filter policy name.")
    service_tier: Tier = Field(
        default="default",
        description="The class of the key's requests that ask for none (or `auto`): "
        "priority, default or flex (docs/flow.md).",
    )
    max_service_tier: Tier = Field(
        default="default",
        description="The highest class the key may ask for; a request asking above it is "
        "served in this class (and its answer says so).",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1e6,
        description="The key's weight in fair shares: twice the weight, twice the tokens "
        "while the model is saturated.",
    )
    budget_usd: float | None = Field(
        default=None,
        ge=0,
        description="Hard spend budget in dollars per budget_period: a request that would "
        "pass it is refused (429 insufficient_quota). Spend is priced per model "
        "(router.models.<m>.price).",
    )
    soft_budget_usd: float | None = Field(
        default=None, ge=0, description="Soft threshold: crossing it raises an alert."
    )
    budget_period: Literal["day", "month", "total"] = Field(
        default="month", description="The period the budget is for (day and month in UTC)."
    )
    fair_by: Literal["key", "owner"] = Field(
        default="key",
        description="Whose share the key's requests count in: its own, or its owner's "
        "(every key of one owner shares one).",
    )
    expires_at: float | None = Field(default=None, description="Unix time; none = never.")
    enabled: bool = Field(default=True, description="False once revoked.")
    admin: bool = Field(default=False, description="May manage keys.")
    created_at: float = Field(default_factory=time.time)
    # After a rotation, the secret before it keeps working until previous_until.
    previous_hash: str = Field(default="", description="SHA-256 of the key before rotation.")
    previous_until: float | None = Field(
        default=None, description="Unix time until which the key before rotation still works."
    )
    rotated_at: float | None = Field(default=None, description="Unix time of the last rotation.")

    def public(self) -> dict[str, Any]:
        """Everything but the hashes, for listings."""
        return self.model_dump(exclude={"hash", "previous_hash"})

    def tier(self, asked: str | None) -> str:
        """The class a request of this key asking for ``asked`` is served in: the key's
        default for none or ``auto``, never above its ceiling."""
        tier = asked if asked in TIER_RANK else self.service_tier
        if TIER_RANK[tier] < TIER_RANK[self.max_service_tier]:
            return self.max_service_tier
        return tier

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(key_id: str | None = None) -> tuple[str, str]:
    """A fresh ``(key, key_id)``; with ``key_id``, a new secret for that id (a rotation)."""
    key_id = key_id or secrets.token_hex(6)
    return f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}", key_id


def key_id_of(key: str) -> str | None:
    """The id inside a well-formed key, or None."""
    m = _KEY.fullmatch(key.strip())
    return m.group(1) if m else None


def matches(key: str, record: KeyRecord, now: float | None = None) -> bool:
    """Constant-time comparison of a presented key with the stored hash, or, within a
    rotation's overlap, with the hash of the key before it."""
    h = hash_key(key.strip())
    if hmac.compare_digest(h, record.hash):
        return True
    if not record.previous_hash or record.previous_until is None:
        return False
    old = hmac.compare_digest(h, record.previous_hash)
    return old and (time.time() if now is None else now) < record.previous_until


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``12h``, ``30d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 12h, 30d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
