"""``tokenbus adapters load|unload|list``: LoRA adapters loaded at run time (docs/adapters.md).

The command learns the live replicas from their heartbeats (``--wait``), then does what the
admin API's ``/v1/admin/adapters`` does; ``load`` and ``unload`` are recorded in the audit
trail as ``cli:<os user>@<host>``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bus_schemas import errors as E
from router import adapters as A
from router.service import heard
from services import audit
from services.config import Settings
from tokenbus.cli import bus

# An idle replica beats every 2 s (worker.idle_heartbeat_factor): hear each one at least once.
WAIT_S = 2.5


def add_parser(sub: Any) -> None:
    p = sub.add_parser("adapters", help="LoRA adapters at run time: load, unload, list")
    ps = p.add_subparsers(dest="adapters_cmd", required=True)
    ld = ps.add_parser("load", help="load an adapter on replicas of a model (every router)")
    ld.add_argument("name", help="the adapter's name: the model requests ask for")
    ld.add_argument("--model", required=True, help="the base model whose replicas load it")
    ld.add_argument("--path", required=True, help="where the replicas' engines read it from")
    ld.add_argument("--replicas", type=int, default=1, help="on how many replicas (default 1)")
    ul = ps.add_parser("unload", help="unload an adapter everywhere, after its requests end")
    ul.add_argument("name")
    ul.add_argument(
        "--drain", type=float, default=30.0, help="seconds its running requests may take"
    )
    ls = ps.add_parser("list", help="the adapters wanted or loaded, and where")
    ls.add_argument("--json", action="store_true")
    for q in (ld, ul, ls):
        q.add_argument(
            "--wait", type=float, default=WAIT_S, help="seconds of heartbeats to find replicas"
        )


async def main(a: argparse.Namespace, s: Settings) -> int:
    if a.adapters_cmd == "load" and not 1 <= a.replicas <= 1024:
        print("error: --replicas: from 1 to 1024")
        return 2
    if a.adapters_cmd == "unload" and not 0 <= a.drain <= 3600:
        print("error: --drain: seconds from 0 to 3600")
        return 2
    nc = await bus.connect(s.url(), s.nats_auth())
    if nc is None:
        return 1
    try:
        registry = await heard(nc, a.wait, s.router.missed_heartbeats)
        if a.adapters_cmd == "list":
            rows = await A.listing(nc, registry)
            if a.json:
                print(json.dumps({"adapters": rows}))
            for r in [] if a.json else rows:
                on = ", ".join(r["loaded_on"]) or "no replica"
                wanted = "" if r["wanted"] else "  (not wanted: loaded before an unload)"
                print(f"{r['name']} on {r['model']} from {r['path']}: {on}{wanted}")
            return 0
        actor = audit.cli_actor()
        if a.adapters_cmd == "load":
            want = A.Wanted(a.name, a.model, a.path, a.replicas)
            out = await A.load(nc, registry, want, served=registry.models(), actor=actor)
        else:
            out = await A.unload(nc, registry, a.name, drain_s=a.drain, actor=actor)
        print(json.dumps(out))
        return 1 if out.get("failed") else 0
    except E.TokenbusError as exc:
        print(f"error: {exc.message}")
        return 2 if exc.status < 500 else 1
    finally:
        await nc.drain()
