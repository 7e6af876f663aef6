"""The nemesis run's faults: one at a time, chosen by the run's seeded generator, injected
and healed (``kill``, ``pause``, ``nats_kill``, ``nats_pause``, ``nats_partition``,
``host_crash``, and a site's link ``site_cut``, ``site_stall``, ``site_slow``); the
scheduler that paces them."""

from __future__ import annotations

import asyncio
import signal
import time

from tokenbus.evaluation.nemesis_stack import Proc
from tokenbus.evaluation.nemesis_state import Run
from tokenbus.evaluation.options import SITE_KINDS


def choose(run: Run, kinds: list[str]) -> tuple[str, Proc | int]:
    """The next fault: its kind and its target (a process, or a node's index)."""
    kind = run.fault_rng.choice(kinds)
    if kind in ("kill", "pause"):
        return kind, run.fault_rng.choice(run.stack.procs)
    if kind in SITE_KINDS:
        return kind, run.fault_rng.randrange(len(run.stack.cluster.sites))
    return kind, run.fault_rng.randrange(run.cfg.nodes)


async def site_fault(run: Run, kind: str, i: int) -> str:
    """Site ``i``'s link cut (connections closed, new ones refused), stalled (nothing
    crosses, the connections stay open: held bytes cross once healed) or slowed
    (``site_delay_s`` each way) for ``partition_s``, then healed."""
    cfg, cl = run.cfg, run.stack.cluster
    site = cl.sites[i]
    link = cl.links[site]
    target = f"site-{site}"
    run.windows.append({"kind": kind, "target": target, "t": run.now()})
    run.say(f"fault {kind} {target}")
    if kind == "site_cut":
        link.cut()
    elif kind == "site_stall":
        link.stall()
    else:
        link.delay_s = cfg.site_delay_s
    await asyncio.sleep(cfg.partition_s)
    link.delay_s = 0.0
    link.heal()
    return target


async def inject(run: Run, kind: str, what: Proc | int) -> str:
    """Inject one fault of ``kind`` on ``what`` and heal it; what it hit."""
    cfg, st = run.cfg, run.stack
    cl = st.cluster
    if isinstance(what, Proc):
        p = what
        target = p.name
        run.windows.append({"kind": kind, "target": target, "t": run.now()})
        run.say(f"fault {kind} {target} (host {p.host})")
        if kind == "kill":
            p.held = True
            p.kill()
            await asyncio.sleep(0.3)
            p.start_in(st.log_dir)
            p.held = False
        else:
            p.signal(signal.SIGSTOP)
            await asyncio.sleep(cfg.pause_s)
            p.signal(signal.SIGCONT)
        return target
    if kind in SITE_KINDS:
        return await site_fault(run, kind, what)
    i = what
    target = f"node{i}"
    run.windows.append({"kind": kind, "target": target, "t": run.now()})
    run.say(f"fault {kind} {target}")
    if kind == "nats_kill":
        cl.kill(i)
        await asyncio.sleep(cfg.down_s)
        cl.start_node(i)
    elif kind == "nats_pause":
        cl.signal(i, signal.SIGSTOP)
        await asyncio.sleep(cfg.pause_s)
        cl.signal(i, signal.SIGCONT)
    elif kind == "nats_partition":
        assert cl.hostset is not None
        cl.hostset.cut(cl.hosts[i])
        await asyncio.sleep(cfg.partition_s)
        cl.hostset.heal(cl.hosts[i])
    elif kind == "host_crash":
        victims = [p for p in st.procs if p.host == i]
        for p in victims:
            p.held = True
            p.kill()
        cl.kill(i)
        if cfg.lost_cache:
            reverted = cl.revert_store(i)
            kept = "reverted to the last sync point" if reverted else "emptied (no sync point)"
        else:  # every acknowledged write was synced: the disk holds what the node had
            kept = "as synced (sync_interval: always)"
        run.say(f"  host {i} crashed: {', '.join(p.name for p in victims)} and node{i}; {kept}")
        await asyncio.sleep(cfg.down_s)
        cl.start_node(i)
        for p in victims:
            p.start_in(st.log_dir)
            p.held = False
    else:
        raise ValueError(kind)
    return target


async def scheduler(run: Run, kinds: list[str]) -> None:
    cfg = run.cfg
    await asyncio.sleep(cfg.warmup_s)
    next_at = time.monotonic()
    upcoming = choose(run, kinds)
    while True:
        if next_at + cfg.fault_every_s > run.stop_at:
            return
        await inject(run, *upcoming)
        # The next fault is chosen now; a host to crash gets its sync point now, a fault
        # interval before its crash (the node pauses while its store is copied aside; only
        # the node about to crash is copied, the others' copies would never be used).
        upcoming = choose(run, kinds)
        kind, node = upcoming
        if kind == "host_crash" and isinstance(node, int) and cfg.lost_cache:
            took = await asyncio.to_thread(run.stack.cluster.sync_point, node)
            run.say(f"  sync point of node{node}'s store ({took:.2f} s paused for the copy)")
        next_at += cfg.fault_every_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
