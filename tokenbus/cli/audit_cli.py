"""``tokenbus audit [--since DURATION] [--limit N] [--json]``: the audit trail.

Who created, updated or revoked which key and who changed which model's routing, and when,
oldest first, read from the JetStream stream ``TOKENBUS_AUDIT`` (see
:mod:`services.audit`). Reading it needs the admin role on the locked bus.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from auth.keys import parse_duration
from services import audit
from services.config import Settings
from tokenbus.cli import bus


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="the audit trail: key and routing changes, who and when")
    p.add_argument("--since", metavar="DURATION", help="only the last DURATION: 90s, 15m, 12h, 30d")
    p.add_argument(
        "--limit", type=int, default=100, help="the newest N events (default 100; 0: all)"
    )
    p.add_argument("--json", action="store_true", help="a JSON list of the events")


def line(ev: audit.AuditEvent) -> str:
    """One event as a line of text."""
    details = json.dumps(ev.details, separators=(",", ":"), sort_keys=True)
    rid = f"  request={ev.request_id}" if ev.request_id else ""
    return f"{ev.ts}  {ev.action:<15}  {ev.target:<14}  {ev.actor}  {details}{rid}"


async def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.limit < 0:
        print("error: --limit must be 0 (all) or more")
        return 2
    since = None
    if args.since:
        try:
            since = time.time() - parse_duration(args.since)
        except ValueError as exc:
            print(f"error: {exc}")
            return 2
    url = settings.url()
    nc = await bus.connect(url, settings.nats_auth())
    if nc is None:
        return 1
    try:
        events = await audit.read(nc, since=since, limit=args.limit or None)
    except Exception as exc:
        print(f"error: cannot read the audit trail ({audit.STREAM}): {exc or type(exc).__name__}")
        return 1
    finally:
        await nc.drain()
    if args.json:
        print(json.dumps([ev.model_dump() for ev in events]))
    elif not events:
        print("no audit events")
    else:
        for ev in events:
            print(line(ev))
    return 0
