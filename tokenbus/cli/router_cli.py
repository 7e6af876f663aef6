"""``tokenbus router train|set|show|reset|alias|aliases``: the expert classifier, run-time
routing and model aliases.

``set``, ``reset`` and ``alias`` are recorded in the audit trail as ``cli:<os user>@<host>``
(``tokenbus audit``); when the trail cannot be written the change is refused.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from bus_schemas import errors as E
from services import audit
from services.config import LoadPolicyName, Settings
from tokenbus.cli import bus


def add_parser(sub: Any) -> None:
    r = sub.add_parser("router", help="routing: train the expert classifier, change policies")
    rs = r.add_subparsers(dest="router_cmd", required=True)

    t = rs.add_parser("train", help="fit Expert Router's prompt classifier (no pickle)")
    t.add_argument("--data", required=True, help='JSONL of {"prompt", "label"?}, or text lines')
    t.add_argument("--clusters", type=int, required=True, help="k of k-means")
    t.add_argument("--out", default=".tokenbus/expert", help="folder for expert.npz/json")
    t.add_argument("--holdout", type=float, default=0.2, help="share kept out for purity")
    t.add_argument("--dims", type=int, default=100, help="truncated SVD dimensions")
    t.add_argument(
        "--scaling",
        choices=["l2", "zscore"],
        default="l2",
        help="standardisation of the SVD embedding before k-means",
    )
    t.add_argument("--seed", type=int, default=0)

    s = rs.add_parser("set", help="change a model's routing at run time (every router)")
    s.add_argument("model")
    s.add_argument(
        "--policy",
        choices=list(get_args(LoadPolicyName)),
    )
    s.add_argument("--pool-policy", choices=["none", "concurrency_tiered", "expert"])
    s.add_argument("--load-bound", type=float)
    s.add_argument("--threshold", type=int, help="concurrency_tiered: go wide at this in-flight")
    s.add_argument("--hysteresis", type=int)
    s.add_argument("--high-pool")
    s.add_argument("--wide-pool")
    s.add_argument("--expert-dir", help="expert: folder written by `router train`")
    s.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="CLUSTER=TARGET",
        help="expert: cluster index or label -> pool:<tag> or a model (repeatable)",
    )

    sh = rs.add_parser("show", help="the routing of each model with a run-time change")
    sh.add_argument("--json", action="store_true")
    rr = rs.add_parser("reset", help="drop a model's run-time change (back to the config)")
    rr.add_argument("model")

    al = rs.add_parser("alias", help="serve MODEL to clients that ask for NAME (every router)")
    al.add_argument("name", help="the model name clients ask for, e.g. claude-sonnet-4-5")
    al.add_argument("model", nargs="?", help="the served model it names")
    al.add_argument("--remove", action="store_true", help="drop the run-time alias NAME")
    al.add_argument(
        "--wait", type=float, default=1.5, help="seconds of heartbeats to learn the served models"
    )
    als = rs.add_parser("aliases", help="the global model aliases (run-time and configured)")
    als.add_argument("--json", action="store_true")


def override_from_args(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in ("policy", "pool_policy", "load_bound"):
        v = getattr(a, field)
        if v is not None:
            out[field] = v
    tiered = {
        k: getattr(a, k)
        for k in ("threshold", "hysteresis", "high_pool", "wide_pool")
        if getattr(a, k) is not None
    }
    if tiered:
        out["tiered"] = tiered
    expert: dict[str, Any] = {}
    if a.expert_dir:
        expert["model_dir"] = a.expert_dir
    if a.target:
        targets = {}
        for pair in a.target:
            k, sep, v = pair.partition("=")
            if not sep or not k or not v:
                raise SystemExit(f"--target wants CLUSTER=TARGET, got {pair!r}")
            targets[k] = v
        expert["targets"] = targets
    if expert:
        out["expert"] = expert
    return out


async def main(a: argparse.Namespace, s: Settings) -> int:
    if a.router_cmd == "train":
        from router.expert import train

        try:
            report = train(
                a.data,
                a.clusters,
                a.out,
                holdout=a.holdout,
                seed=a.seed,
                dims=a.dims,
                scaling=a.scaling,
            )
        except (OSError, ValueError) as exc:
            print(f"error: {exc}")
            return 1
        print(json.dumps(report, indent=1))
        return 0

    from router.routing import clear_override, list_overrides, set_override, validate_override

    nc = await bus.connect(s.url(), s.nats_auth())
    if nc is None:
        return 1
    try:
        if a.router_cmd in ("alias", "aliases"):
            return await _aliases(nc, a, s)
        if a.router_cmd == "set":
            override = override_from_args(a)
            if not override:
                print("error: nothing to change (see tokenbus router set --help)")
                return 2
            try:
                spec = validate_override(s.router, a.model, override)
            except (ValueError, OSError) as exc:
                print(f"error: {exc}")
                return 2
            await set_override(nc, a.model, override, actor=audit.cli_actor())
            print(json.dumps({"model": a.model, "routing": spec.model_dump()}))
        elif a.router_cmd == "reset":
            await clear_override(nc, a.model, actor=audit.cli_actor())
            print(f"{a.model}: back to the configured routing")
        elif a.router_cmd == "show":
            overrides = await list_overrides(nc)
            out = {
                m: s.router.routing_for(m, o).model_dump(exclude_defaults=True)
                for m, o in overrides.items()
            }
            if a.json:
                print(json.dumps({"default": s.router.routing_for("").model_dump(), **out}))
            else:
                # JSON, as `set` prints it, one model a line.
                default = s.router.routing_for("").model_dump(exclude_defaults=True)
                print(f"default: {json.dumps(default)}")
                for m, o in out.items():
                    print(f"{m}: {json.dumps(o)}")
    except E.TokenbusError as exc:
        print(f"error: {exc.message}")
        return 1
    finally:
        await nc.drain()
    return 0


async def _aliases(nc: Any, a: argparse.Namespace, s: Settings) -> int:
    """``router alias NAME MODEL``, ``router alias NAME --remove``, ``router aliases``."""
    from services import aliases as A

    if a.router_cmd == "aliases":
        rows = A.rows(s.router.aliases, await A.list_aliases(nc))
        if a.json:
            print(json.dumps({"aliases": rows}))
        for r in [] if a.json else rows:
            print(f"{r['name']} -> {r['model']}  ({r['source']})")
        return 0
    if a.remove:
        previous = await A.remove_alias(nc, a.name, actor=audit.cli_actor())
        print(f"{a.name}: removed" if previous else f"{a.name}: no run-time alias to remove")
        return 0
    if not a.model:
        print("error: name the served model (tokenbus router alias NAME MODEL), or --remove")
        return 2
    runtime = await A.list_aliases(nc)
    try:
        served = await A.served_models(nc, a.wait)
        A.check_alias(a.name, a.model, {**s.router.aliases, **runtime}, served)
    except E.InvalidRequest as exc:
        print(f"error: {exc.message}")
        return 2
    await A.set_alias(nc, a.name, a.model, actor=audit.cli_actor())
    print(json.dumps({"name": a.name, "model": a.model}))
    return 0
