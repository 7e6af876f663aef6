"""``tokenbus keys create|list|show|revoke|update``: operator access to the key store.

It talks to JetStream KV directly (whoever may reach the bus as admin may manage keys);
``create`` prints the new key alone on its last line so scripts can capture it. Each change
is recorded in the audit trail as ``cli:<os user>@<host>`` (``tokenbus audit``); when the
trail cannot be written the change is refused (or, if it was made, the error says so).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from auth import budgets
from auth.keys import KeyRecord, parse_duration
from auth.store import KeyStore
from bus_schemas import errors as E
from services import audit
from services.aliases import check_key_aliases, list_aliases, served_models
from tokenbus.cli import bus


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def add_parser(sub: Any) -> None:
    k = sub.add_parser("keys", help="manage API keys (JetStream KV)")
    ks = k.add_subparsers(dest="keys_cmd", required=True)

    def fields(p: argparse.ArgumentParser) -> None:
        p.add_argument("--owner")
        p.add_argument("--models", help="comma separated allowed models (default: all)")
        p.add_argument(
            "--alias",
            action="append",
            default=[],
            metavar="NAME=MODEL",
            help="the key's own model alias, over a global one (repeatable; update: NAME= drops)",
        )
        p.add_argument("--rpm", type=int, help="requests per minute")
        p.add_argument("--tpm", type=int, help="tokens per minute")
        p.add_argument("--max-concurrent", type=int, help="requests at once")
        p.add_argument(
            "--max-body-bytes",
            type=int,
            help="what its large request bodies may hold in the store at once (0: no bound; "
            "default: bodies.max_bytes_per_key)",
        )
        p.add_argument("--filter-policy", help="content filter policy name")
        p.add_argument("--expires-in", help="e.g. 30d, 12h, 15m")
        tiers = ["priority", "default", "flex"]
        p.add_argument("--service-tier", choices=tiers, help="class of its requests (docs/flow.md)")
        p.add_argument("--max-service-tier", choices=tiers, help="highest class it may ask for")
        p.add_argument("--weight", type=float, help="its weight in fair shares (default 1)")
        p.add_argument("--fair-by", choices=["key", "owner"], help="whose share it counts in")
        p.add_argument("--budget-usd", type=float, help="hard spend budget per period ($)")
        p.add_argument("--soft-budget-usd", type=float, help="soft threshold: an alert ($)")
        p.add_argument("--budget-period", choices=["day", "month", "total"])
        p.add_argument("--json", action="store_true")

    c = ks.add_parser("create", help="create a key; the key is printed once, on the last line")
    c.add_argument("--name", required=True)
    c.add_argument("--admin", action="store_true", help="the key may manage keys")
    fields(c)
    ls = ks.add_parser("list", help="every key (never the key itself)")
    ls.add_argument("--json", action="store_true")
    for name in ("show", "revoke"):
        p = ks.add_parser(name, help=f"{name} one key")
        p.add_argument("key_id")
        p.add_argument("--json", action="store_true")
    rot = ks.add_parser(
        "rotate",
        help="a new secret for a key: same id, limits, budget and spend; the new key is "
        "printed once, on the last line",
    )
    rot.add_argument("key_id")
    rot.add_argument(
        "--overlap",
        default="1h",
        help="how long the key before keeps working, e.g. 15m, 24h, 0 (default 1h)",
    )
    rot.add_argument("--json", action="store_true")
    ob = ks.add_parser(
        "owner-budget",
        help="show or set the spend budget every key of an owner shares (with its spend)",
    )
    ob.add_argument("owner")
    ob.add_argument("--usd", type=float, help="hard budget per period ($)")
    ob.add_argument("--soft-usd", type=float, help="soft threshold: an alert ($)")
    ob.add_argument("--period", choices=["day", "month", "total"], default="month")
    ob.add_argument("--clear", action="store_true", help="remove the owner's budget")
    ob.add_argument("--json", action="store_true")
    u = ks.add_parser("update", help="change a key's limits, models, expiry or name")
    u.add_argument("key_id")
    u.add_argument("--name")
    u.add_argument("--enable", action="store_true")
    fields(u)


def _fields(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "owner": a.owner,
        "models": _csv(a.models),
        "aliases": getattr(a, "aliases", None),
        "rpm": a.rpm,
        "tpm": a.tpm,
        "max_concurrent": a.max_concurrent,
        "max_body_bytes": a.max_body_bytes,
        "filter_policy": a.filter_policy,
        "service_tier": a.service_tier,
        "max_service_tier": a.max_service_tier,
        "weight": a.weight,
        "fair_by": a.fair_by,
        "budget_usd": a.budget_usd,
        "soft_budget_usd": a.soft_budget_usd,
        "budget_period": a.budget_period,
    }
    if a.expires_in:
        out["expires_at"] = time.time() + parse_duration(a.expires_in)
    return {k: v for k, v in out.items() if v is not None}


async def _spend(nc: Any, rec: KeyRecord) -> dict[str, Any]:
    """The key's spend in its budget's current period (when it has a budget)."""
    if rec.budget_usd is None and rec.soft_budget_usd is None:
        return {}
    book = await budgets.SpendBook(nc).open()
    b = budgets.Budget(f"k.{rec.id}", rec.budget_period, None, None)
    spent, held = await book.spent(b)
    return {
        "spend_period": budgets.period_id(rec.budget_period),
        "spent_usd": spent / 1e6,
        "held_usd": held / 1e6,
    }


async def _owner_budget(nc: Any, a: argparse.Namespace) -> None:
    """``tokenbus keys owner-budget``: set (or clear) it when asked, then show it."""
    book = await budgets.SpendBook(nc).open()
    if a.clear or a.usd is not None or a.soft_usd is not None:
        await book.set_owner_budget(
            a.owner,
            hard_usd=None if a.clear else a.usd,
            soft_usd=None if a.clear else a.soft_usd,
            period=a.period,
            actor=audit.cli_actor(),
        )
    b = await book.owner_budget(a.owner)
    out: dict[str, Any] = {"owner": a.owner, "budget": None}
    if b is not None:
        spent, held = await book.spent(b)
        out = {
            "owner": a.owner,
            "period": b.period,
            "budget_usd": None if b.hard is None else b.hard / 1e6,
            "soft_budget_usd": None if b.soft is None else b.soft / 1e6,
            "spend_period": budgets.period_id(b.period),
            "spent_usd": spent / 1e6,
            "held_usd": held / 1e6,
        }
    if a.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>15}: {v}")


def _show(rec: KeyRecord, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    d = {**rec.public(), **(extra or {})}
    if as_json:
        print(json.dumps(d))
        return
    for k, v in d.items():
        if k.endswith("_at") and isinstance(v, int | float):  # Unix times, for a person
            v = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v))
        print(f"{k:>15}: {v}")


def _alias_pairs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, model = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--alias wants NAME=MODEL, got {pair!r}")
        out[name] = model
    return out


async def _aliases(
    nc: Any, a: argparse.Namespace, store: KeyStore, static: dict[str, str]
) -> dict[str, str] | None:
    """The key's aliases after ``--alias`` (None: not changed), checked as the admin API
    checks them (no chain, no served model hidden)."""
    given = _alias_pairs(getattr(a, "alias", None) or [])
    if not given:
        return None
    own = dict((await store.get(a.key_id)).aliases) if a.keys_cmd == "update" else {}
    own.update(given)
    own = {n: m for n, m in own.items() if m}
    global_aliases = {**static, **await list_aliases(nc)}
    check_key_aliases(own, global_aliases, await served_models(nc))
    return own


async def main(
    a: argparse.Namespace,
    url: str,
    auth: dict[str, str] | None = None,
    static_aliases: dict[str, str] | None = None,
) -> int:
    nc = await bus.connect(url, auth)
    if nc is None:
        return 1
    store = await KeyStore(nc).open(watch=False)
    actor = audit.cli_actor()
    try:
        if a.keys_cmd in ("create", "update"):
            own = await _aliases(nc, a, store, static_aliases or {})
            if own is not None:
                a.aliases = own
        if a.keys_cmd == "create":
            key, rec = await store.create(a.name, actor=actor, admin=a.admin, **_fields(a))
            if a.json:
                print(json.dumps(rec.public()))
            else:
                print(f"created key {rec.id} ({rec.name}); it is shown once, keep it now:")
            print(key)
        elif a.keys_cmd == "list":
            recs = await store.list()
            if a.json:
                print(json.dumps([r.public() for r in recs]))
            else:
                for r in recs:
                    state = "enabled" if r.enabled and not r.expired() else "disabled"
                    print(
                        f"{r.id}  {r.name:<20} {state:<9} models={','.join(r.models) or '*'}"
                        f" rpm={r.rpm} tpm={r.tpm} concurrent={r.max_concurrent}"
                    )
        elif a.keys_cmd == "show":
            rec = await store.get(a.key_id)
            _show(rec, a.json, await _spend(nc, rec))
        elif a.keys_cmd == "owner-budget":
            await _owner_budget(nc, a)
        elif a.keys_cmd == "revoke":
            _show(await store.revoke(a.key_id, actor=actor), a.json)
        elif a.keys_cmd == "rotate":
            overlap = 0.0 if a.overlap.strip() in ("0", "0s") else parse_duration(a.overlap)
            key, rec = await store.rotate(a.key_id, overlap_s=overlap, actor=actor)
            if a.json:
                print(json.dumps(rec.public()))
            else:
                until = (
                    time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec.previous_until))
                    if rec.previous_until
                    else "now (no overlap)"
                )
                print(
                    f"rotated key {rec.id} ({rec.name}): the key before works until {until}; "
                    "the new one is shown once, keep it now:"
                )
            print(key)
        elif a.keys_cmd == "update":
            f = _fields(a)
            if a.name:
                f["name"] = a.name
            if a.enable:
                f["enabled"] = True
            _show(await store.update(a.key_id, actor=actor, **f), a.json)
    except E.TokenbusError as exc:
        print(f"error: {exc.message}")
        return 1
    finally:
        await nc.drain()
    return 0
