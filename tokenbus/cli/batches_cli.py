"""``tokenbus batches [list|show ID|cancel ID] [--json]``: every key's batches, for operators.

Reads the batch records the bridges keep in JetStream (jobs/batches.py, docs/batches.md);
on the locked bus it runs as the admin role, as ``tokenbus keys`` does.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from jobs.batches import BatchStore
from jobs.job_records import BatchObject
from services.config import Settings
from tokenbus.cli import bus


def add_parser(sub: Any) -> None:
    p = sub.add_parser("batches", help="batches of every key: list, show one, cancel one")
    p.add_argument("action", nargs="?", default="list", choices=("list", "show", "cancel"))
    p.add_argument("batch_id", nargs="?", help="show / cancel: the batch")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")


def row(b: BatchObject, owner: str) -> str:
    c = b["request_counts"]
    age = int(time.time() - b["created_at"])
    counts = f"{c['completed']}+{c['failed']}/{c['total']}"
    return (
        f"{b['id']:<32}  {b['status']:<11}  {counts:>15}  {b['endpoint']:<21}  "
        f"{owner or '-':<14}  {age}s"
    )


async def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.action != "list" and not args.batch_id:
        print(f"error: {args.action} needs a batch id")
        return 2
    nc = await bus.connect(settings.url(), settings.nats_auth())
    if nc is None:
        return 1
    try:
        store = await BatchStore(nc, settings.batches, settings.files.ttl_s).open()
        if args.action == "list":
            recs = sorted(await store.all(), key=lambda r: r["batch"]["created_at"])
            if args.json:
                print(json.dumps([{"owner": r["owner"], **r["batch"]} for r in recs]))
            elif not recs:
                print("no batches")
            else:
                print(
                    f"{'ID':<32}  {'STATUS':<11}  {'DONE+FAILED/ALL':>15}  {'ENDPOINT':<21}  "
                    f"{'KEY':<14}  AGE"
                )
                for r in recs:
                    print(row(r["batch"], r["owner"]))
            return 0
        found = await store.load(args.batch_id)
        if found is None:
            print(f"error: no batch {args.batch_id}")
            return 1
        owner = found[0]["owner"]
        if args.action == "cancel":
            b = await store.cancel(args.batch_id, owner)
        else:
            b = found[0]["batch"]
        print(json.dumps({"owner": owner, **b}, indent=None if args.json else 2))
        return 0
    except Exception as exc:
        print(f"error: {exc or type(exc).__name__}")
        return 1
    finally:
        await nc.drain()
