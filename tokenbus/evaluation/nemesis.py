"""``tokenbus bench --nemesis``: mixed traffic on a locked NATS cluster while a scheduler
injects one fault every few seconds, then a check of the invariants that must hold whatever
failed (docs/nemesis.md).

Traffic: streamed chat completions over HTTP (the bridges) and over NATS
(:class:`tokenbus.Client`) from several API keys with budgets and limits, a batch and a
background response. Faults, one at a time, chosen by a seeded random generator (the seed is
printed) and healed before the next: ``kill`` (kill -9 of any tokenbus process, then a
restart), ``pause`` (SIGSTOP, then SIGCONT), ``nats_kill``, ``nats_pause``, ``nats_partition``
(a node's host cut off: its network namespace's link down; only where namespaces can be
made: root and ``ip``) and ``host_crash`` (every process of one host killed, its node's
JetStream store put back to the copy taken at the last sync point, as a lost page cache
would leave it, then everything restarted).

Invariants checked afterwards: every request ended (an answer or one clear error) within
its deadline; no streamed text has a gap or a repeat (the simulator's text is known:
:func:`engine_worker.backends.sim.expected_text`); every batch line answered exactly once;
each key's spend equals its settled usage and no hold is left; every usage record stored
once (the telemetry store, by request id); every key created and acknowledged still exists.

The harness here (the cluster, the processes, the namespaces) is the bench's own: the
package does not import the tests' helpers (tests/lockedbus.py, tests/netns.py), which this
follows.

Its parts, one role each: ``nemesis_config`` (what a run is given), ``nemesis_cluster`` (the
nats-server nodes), ``nemesis_stack`` (the tokenbus processes), ``nemesis_state`` (the run's
windows and outcomes), ``nemesis_load`` (the traffic), ``nemesis_faults`` (the faults and
their schedule), ``nemesis_checks`` (the invariants), ``nemesis_report`` (the table); this
module runs them in order."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenbus.evaluation.balancer import Balancer
from tokenbus.evaluation.nemesis_checks import invariants, served_by
from tokenbus.evaluation.nemesis_config import Config
from tokenbus.evaluation.nemesis_faults import scheduler
from tokenbus.evaluation.nemesis_load import (
    background_job,
    batch_job,
    http_client_loop,
    key_creator,
    nats_client_loop,
)
from tokenbus.evaluation.nemesis_report import per_kind, print_table
from tokenbus.evaluation.nemesis_stack import Stack, create_key, until_ready, until_routed
from tokenbus.evaluation.nemesis_state import Run
from tokenbus.evaluation.netns import Hosts, available
from tokenbus.evaluation.options import KINDS, SITE_KINDS


async def spend_tap(run: Run) -> Any:
    """An admin connection that notes every spend report and supersede on the bus in
    ``run.spend_reports`` (the spend check names, from them, an answered attempt whose
    report never came); closed by the caller."""
    from bus_schemas import codec, subjects

    async def on_down() -> None:
        run.tap_disconnects += 1

    nc = await run.stack.cluster.admin(0, disconnected_cb=on_down)

    async def on_report(msg: Any) -> None:
        try:
            u = codec.decode_map(msg.data)
        except Exception:
            return
        keep = ("request_id", "attempt", "prompt", "completion", "resumed", "dup", "counted")
        rid = str(u.get("request_id", ""))
        run.spend_reports.setdefault(rid, []).append({k: u[k] for k in keep if k in u})

    await nc.subscribe(subjects.usage_spend_wildcard(), cb=on_report)
    await nc.flush()
    return nc


async def run_nemesis(cfg: Config) -> dict[str, Any]:
    """The whole run: start, load and faults, invariants; the report (also written to
    ``cfg.out`` when set)."""
    seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
    rng = random.Random(seed)
    # Why a kind cannot be injected in this run.
    why_not: dict[str, str] = {}
    if "nats_partition" in cfg.kinds and not available():
        why_not["nats_partition"] = "no network namespaces here (needs root and ip)"
    if cfg.nodes < 2:
        why_not["host_crash"] = "one node: a reverted store has no peer to catch up from"
    if cfg.sites < 1:
        why_not |= dict.fromkeys(SITE_KINDS, "no site (--nemesis-sites 0)")
    skipped = {k: why_not[k] for k in cfg.kinds if k in why_not}
    kinds = [k for k in cfg.kinds if k not in why_not]
    if not kinds:
        raise ValueError("no fault kind left to inject")
    folder = Path(cfg.run_dir or tempfile.mkdtemp(prefix="tokenbus-nemesis-"))
    folder.mkdir(parents=True, exist_ok=True)
    if not cfg.quiet:
        print(f"nemesis: seed {seed}, kinds {kinds}, skipped {skipped or 'none'}, logs {folder}")
    hosts = Hosts().start() if "nats_partition" in kinds else None
    stack: Stack | None = None
    lb: Balancer | None = None
    tap: Any = None  # the spend reports' tap (spend_tap)
    try:
        stack = Stack(cfg, folder, hosts)
        await stack.cluster.start_links()  # before the sites' nodes dial them
        stack.start()
        await until_routed(stack.cluster)
        # The key store replicated on every node before anything opens it.
        from auth.store import BUCKET as KEYS
        from services import buckets

        nc = await stack.cluster.admin(0)
        try:
            # Through the moment a just-routed cluster has no JetStream leader yet (more
            # than a request's 5 s on a loaded machine: CI run tt).
            await buckets.open_kv(
                nc.jetstream(), KEYS, history=1, replicas=min(3, cfg.nodes), stall_s=60.0
            )
        finally:
            await nc.close()
        run = Run(cfg, stack, rng)
        limits = {"rpm": 10**6, "tpm": 10**9, "max_concurrent": 1000}
        budget = {"budget_usd": 1000.0, "budget_period": "total"}
        for name in ("alpha", "beta", "gamma", "jobs"):
            run.keys[name] = await create_key(stack.cluster, name, **limits, **budget)
        # The readiness probes' own key: what they are charged is no load key's (the spend
        # check holds each load key to its answered requests; probes under alpha's key made
        # it 6 µ$ over per probe in every run, finding 14).
        ready_key, _ = await create_key(stack.cluster, "ready", **limits, **budget)
        stack.start_procs()
        exits: list[dict[str, Any]] = []
        supervisor = asyncio.create_task(stack.supervise(exits, time.monotonic()))
        await until_ready(stack, ready_key)
        tap = await spend_tap(run)
        if cfg.balancer and len(stack.bridge_ports) > 1:
            lb = Balancer.of(stack.bridge_ports, check_every_s=0.5)
            run.http_bases = [f"http://127.0.0.1:{await lb.start()}"]
        start_exits = len(exits)
        run.t_start = time.monotonic()
        run.stop_at = time.monotonic() + cfg.duration_s
        run.say(f"stack ready: {len(stack.procs)} processes on {cfg.nodes} nodes")
        loaders = [
            nats_client_loop(run, ("alpha", "beta", "gamma")[i % 3], i % cfg.nodes)
            for i in range(cfg.nats_clients)
        ] + [
            http_client_loop(run, ("beta", "gamma", "alpha")[i % 3], i)
            for i in range(cfg.http_clients)
        ]
        tasks = [asyncio.create_task(x) for x in loaders]
        tasks.append(asyncio.create_task(key_creator(run)))
        batch_t = asyncio.create_task(batch_job(run, "jobs"))
        bg_t = asyncio.create_task(background_job(run, "jobs"))
        await scheduler(run, kinds)
        await asyncio.gather(*tasks, return_exceptions=True)
        batch, background = await batch_t, await bg_t
        run.say("load over; checking invariants")
        await asyncio.sleep(2.0)  # the last usage reports and records land
        supervisor.cancel()
        invs = await invariants(run, batch, background)
        errors = Counter(o.error.split(":")[0] for o in run.outcomes if o.status == "error")
        report: dict[str, Any] = {
            "tool": "tokenbus bench --nemesis",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "seed": seed,
            "config": {k: v for k, v in asdict(cfg).items() if k != "extra_env"},
            "kinds": kinds,
            "skipped_kinds": skipped,
            "faults": run.windows[1:],
            "per_kind": per_kind(run),
            "requests": {
                "sent": sum(o.via in ("http", "nats") for o in run.outcomes),
                "completed": sum(
                    o.via in ("http", "nats") and o.status == "ok" for o in run.outcomes
                ),
            },
            "errors": dict(errors.most_common()),
            # Requests each replica answered (the sites' workers: theirs crossed a link).
            "served_by": served_by(run),
            # Bytes over each site's link, both ways (tokenbus/evaluation/wanlink.py).
            "site_links": {
                s: {"up": ln.up, "down": ln.down} for s, ln in stack.cluster.links.items()
            },
            # Processes that ended without a fault and were restarted (during the start, then
            # during the run): not an invariant, a finding each.
            "unplanned_exits": {"start": exits[:start_exits], "run": exits[start_exits:]},
            "invariants": invs,
            "violations": sum(i["violations"] for i in invs),
            "hung": sum(o.status in ("hung", "open") for o in run.outcomes),
            # HTTP clients' connections the balancer tried on another bridge (refused by a
            # crashed or restarting one), and those no bridge took.
            "balancer": None if lb is None else {"retried": lb.retried, "refused": lb.refused},
            "logs": str(folder),
        }
        if cfg.out:
            Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out).write_text(json.dumps(report, indent=2))
        if not cfg.quiet:
            print_table(report)
        return report
    finally:
        if tap is not None:
            with contextlib.suppress(Exception):
                await tap.close()
        if lb is not None:
            await lb.stop()
        if stack is not None:
            stack.stop()
            await stack.cluster.close_links()
        if hosts is not None:
            hosts.stop()


async def run_from_args(a: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in a.nemesis_faults.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: unknown fault kinds {unknown}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    out = a.out or f"bench-results/nemesis-{time.strftime('%Y%m%d-%H%M%S')}.json"
    cfg = Config(
        duration_s=a.nemesis_duration,
        fault_every_s=a.fault_every,
        nodes=a.nemesis_nodes,
        sites=a.nemesis_sites,
        seed=a.nemesis_seed,
        kinds=kinds,
        model=a.model,
        out=out,
        lost_cache=a.nemesis_lost_cache,
        balancer=not a.nemesis_no_balancer,
    )
    report = await run_nemesis(cfg)
    print(f"results: {out}")
    return 0 if report["violations"] == 0 and report["hung"] == 0 else 1
