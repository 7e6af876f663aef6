"""The nemesis run's invariants, checked after the load: every request ended within its
deadline, no gap or repeat in a text, every batch line answered once, spend equal to
settled usage with no hold left, every usage record stored once, every acknowledged key
still there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections import Counter
from typing import Any

from tokenbus.evaluation.nemesis_config import PRICE_IN, PRICE_OUT
from tokenbus.evaluation.nemesis_stack import retrying
from tokenbus.evaluation.nemesis_state import Run


async def check_spend(run: Run, since: float | None = None) -> dict[str, Any]:
    """Each key's spend against the usage of its answered requests; holds left: each one
    that had not expired at ``since`` (the wall time the checks began; now when None), so
    that a hold wrongly left cannot pass its deadline while the checks wait for streams."""
    from auth.budgets import BUCKET, Budget, SpendBook
    from auth.ratelimit import SUPERSEDE_FOR_S
    from bus_schemas import subjects

    out: dict[str, Any] = {"keys": {}, "violations": []}
    migrated = _migrated_by_key(run)
    labels = _records_by_label(run)
    stored: dict[str, list[tuple[Any, ...]]] | None = None  # read once, where a key is off
    nc = await run.stack.cluster.admin(0)
    try:
        # Reports kept for a limiter that died are settled by another within its ack wait.
        out["spend_reports_settled"] = await _consumer_settled(
            nc, subjects.SPEND_STREAM, subjects.SPEND_CONSUMER, 60.0
        )
        if not out["spend_reports_settled"]:
            out["violations"].append("spend reports still unsettled in their stream after 60 s")
        kv = await nc.jetstream().key_value(BUCKET)
        now = time.time() if since is None else since
        for name, (_, key_id) in run.keys.items():
            mine = [o for o in run.outcomes if o.key == name]
            settled = sum(
                o.prompt_tokens * PRICE_IN + o.completion_tokens * PRICE_OUT
                for o in mine
                if o.status == "ok"
            )
            slack = sum(o.max_cost for o in mine if o.status != "ok")
            # A NATS client's migrated request: its lost attempt is charged what its worker
            # produced, which may be more than its caller got (a client's count is never a
            # price, issue 64), at most the attempt's whole cost per migration.
            moved = sum(
                o.max_cost * max((m for _, m in labels.get(o.rid, ())), default=0)
                for o in mine
                if o.status == "ok" and o.via == "nats"
            )
            if name == "jobs":
                # Batch lines and the background response run in the bridges: a moved
                # attempt's lost part is charged what its worker produced (it may have gone
                # on to the end when the cancel was lost with a node), at most the job's
                # largest request's whole cost (the background response's) per migration
                # (seed 55: 576 µ$ over, 6 moved).
                moved += migrated.get(key_id, 0) * (64 * PRICE_IN + 200 * PRICE_OUT)
            slack += moved
            # A request admitted more than once (a NATS client that got no accept in time
            # sends it again, and ingress gives each admission an id of its own): each copy
            # its caller cancelled unread is charged what it ran, at most its whole cost.
            copies = sum(
                o.max_cost * max(0, len({rid for rid, _ in labels.get(o.rid, ())}) - 1)
                for o in mine
                if o.status == "ok"
            )
            slack += copies
            d = await _spend_entry(kv, key_id)
            spent = int(d.get("spent", 0))
            if spent < settled:
                # A limiter keeps a supersede it could not yet write (its spend book or stream
                # without a leader) in memory and tries it for up to SUPERSEDE_FOR_S: the spend
                # stream's consumer being settled does not cover it. Under after that long, it
                # is lost.
                waited = time.monotonic()
                give_up = waited + SUPERSEDE_FOR_S + 10
                while spent < settled and time.monotonic() < give_up:
                    await asyncio.sleep(1.0)
                    d = await _spend_entry(kv, key_id)
                    spent = int(d.get("spent", 0))
                out.setdefault("waited_for_supersedes_s", {})[name] = round(
                    time.monotonic() - waited, 1
                )
            held = {k: v for k, v in (d.get("held") or {}).items() if float(v[1]) > now}
            # A request that failed (its worker died with it, and it was not moved, or its
            # caller died too) leaves its attempt's hold until the request's deadline: no
            # report comes. Such a hold must stop counting then; an answered request's must
            # be settled by its report.
            # Holds are named by the gateway's request ids: those of each answered request's
            # records (and the harness's own id, where a record is missing).
            answered = {o.rid for o in mine if o.status == "ok"}
            answered |= {rid for o in answered for rid, _ in labels.get(o, ())}
            of_answered = {k: v for k, v in held.items() if k.partition("#")[0] in answered}
            expiring = {k: v for k, v in held.items() if k not in of_answered}
            row: dict[str, Any] = {
                "spent": spent,
                "answered_usage_cost": settled,
                "unanswered_max_cost": slack - moved,
                "migrated_nats_max_extra": moved,
                "holds_left": len(of_answered),
                "holds_of_failed_requests": len(expiring),
                "requests": len(mine),
                "answered": sum(o.status == "ok" for o in mine),
                # Requests moved to another replica mid-answer (telemetry's record).
                "migrated": migrated.get(key_id, 0),
            }
            out["keys"][name] = row
            if spent < settled or spent > settled + slack:
                # Where the gap is: answered requests whose records (every row stored under
                # their label: what the workers and the bridge reported) cost other than the
                # usage their callers were given.
                stored = stored if stored is not None else _stored_records(run)
                row["usage_differs"] = _usage_differs(mine, stored)
                # Answered attempts whose report the run's tap never saw (the tap may miss
                # what crossed while its node was down: ``tap_disconnects``).
                row["records_without_report"] = _without_report(run, mine, stored)
                row["tap_disconnects"] = run.tap_disconnects
            if spent < settled:
                out["violations"].append(
                    f"{name}: spent {spent} < the usage of its answered requests {settled} "
                    f"(undercharged by {settled - spent})"
                )
            elif spent > settled + slack:
                out["violations"].append(
                    f"{name}: spent {spent} > answered usage {settled} + the most its "
                    f"unanswered requests could cost {slack} (overcharged)"
                )
            if of_answered:
                out["violations"].append(
                    f"{name}: {len(of_answered)} holds of answered requests left after every "
                    f"request ended: {sorted(of_answered)[:5]}"
                )
            if expiring:
                # Past their deadlines they must not count against the budget any more
                # (checked for those due within a request's deadline from now).
                by_rid = {o.rid: o for o in mine}
                row["failed_holds"] = {
                    k: {
                        "due_in_s": round(float(v[1]) - now, 1),
                        "via": getattr(by_rid.get(k.partition("#")[0]), "via", ""),
                        "error": getattr(by_rid.get(k.partition("#")[0]), "error", ""),
                    }
                    for k, v in expiring.items()
                }
                due = [
                    float(v[1]) for v in expiring.values() if v[1] <= now + run.cfg.deadline_s + 5
                ]
                last = max(due, default=now)
                await asyncio.sleep(max(0.0, last - time.time()) + 0.5)
                book = await SpendBook(nc).open()
                _, in_flight = await book.spent(Budget(f"k.{key_id}", "total", None, None))
                row["held_after_their_deadlines"] = in_flight
                if in_flight:
                    out["violations"].append(
                        f"{name}: {in_flight} µ$ still held past every request's deadline"
                    )
    finally:
        await nc.close()
    return out


async def _spend_entry(kv: Any, key_id: str) -> dict[str, Any]:
    """Key ``key_id``'s spend entry of the whole run (its error, where it cannot be read)."""
    try:
        entry = await retrying("spend entry", lambda: kv.get(f"k.{key_id}.total"), 30)
        return dict(json.loads(entry.value or b"{}"))
    except Exception as exc:
        return {"error": repr(exc)}


async def _consumer_settled(nc: Any, stream: str, consumer: str, timeout: float) -> bool:
    """Until a durable consumer has nothing pending or unacknowledged (bounded): what a
    killed consumer had taken comes back within its ack wait, and is done then."""
    js = nc.jetstream(timeout=5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            info = await js.consumer_info(stream, consumer)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return True
        await asyncio.sleep(0.2)
    return False


def _store_rows(run: Run, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query of the run's telemetry store (read-only); none without a store."""
    db = run.stack.telemetry_db
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.Error:
        return []
    finally:
        con.close()


def served_by(run: Run) -> dict[str, int]:
    """Requests each replica answered, from the telemetry store (a site's worker's share:
    requests that crossed its link)."""
    sql = "SELECT replica, COUNT(*) FROM requests WHERE outcome = 'ok' GROUP BY replica"
    return {str(r or "-"): int(n) for r, n in _store_rows(run, sql)}


def _records_by_label(run: Run) -> dict[str, list[tuple[str, int]]]:
    """Each client request id (the label the harness gave its requests) -> the gateway's ids
    its records were stored under and the migrations each record saw (the gateway gives every
    request an id of its own; a migration it cannot prove by a ticket gets another)."""
    out: dict[str, list[tuple[str, int]]] = {}
    sql = "SELECT client_request_id, request_id, COALESCE(migrations, 0) FROM requests"
    for label, rid, migrations in _store_rows(run, sql):
        if label:
            out.setdefault(str(label), []).append((str(rid), int(migrations)))
    return out


def _stored_records(run: Run) -> dict[str, list[tuple[Any, ...]]]:
    """Each client label's stored records: (request id, source, prompt tokens, completion
    tokens, migrations, outcome)."""
    sql = (
        "SELECT client_request_id, request_id, source, prompt_tokens, completion_tokens, "
        "COALESCE(migrations, 0), outcome FROM requests"
    )
    rows: dict[str, list[tuple[Any, ...]]] = {}
    for label, *rest in _store_rows(run, sql):
        if label:
            rows.setdefault(str(label), []).append(tuple(rest))
    return rows


def _usage_differs(
    mine: list[Any], stored: dict[str, list[tuple[Any, ...]]]
) -> list[dict[str, Any]]:
    """The answered requests of ``mine`` whose stored records cost other than the usage
    their callers were given, each with both and its records (at most 20)."""
    out: list[dict[str, Any]] = []
    for o in mine:
        if o.status != "ok" or o.via not in ("http", "nats"):
            continue
        got = o.prompt_tokens * PRICE_IN + o.completion_tokens * PRICE_OUT
        recs = stored.get(o.rid, [])
        cost = sum(int(r[2] or 0) * PRICE_IN + int(r[3] or 0) * PRICE_OUT for r in recs)
        if cost != got:
            out.append(
                {
                    "rid": o.rid,
                    "via": o.via,
                    "usage": [o.prompt_tokens, o.completion_tokens],
                    "usage_cost": got,
                    "records_cost": cost,
                    "records": [list(r) for r in recs],
                }
            )
    return out[:20]


def _without_report(
    run: Run, mine: list[Any], stored: dict[str, list[tuple[Any, ...]]]
) -> list[list[Any]]:
    """The stored records of ``mine``'s answered requests whose attempt (``migrations``) no
    spend report seen on the bus names (at most 20)."""
    out = []
    for o in mine:
        if o.status != "ok":
            continue
        for rid, source, p, c, m, outcome in stored.get(o.rid, []):
            seen = run.spend_reports.get(str(rid), [])
            if not any(int(r.get("attempt", 0)) == int(m) and "resumed" not in r for r in seen):
                out.append([o.rid, rid, source, p, c, m, outcome, len(seen)])
    return out[:20]


def _migrated_by_key(run: Run) -> dict[str, int]:
    """Requests of the run that moved to another replica mid-answer, per key id (from the
    telemetry store's records; empty when there is none)."""
    sql = "SELECT principal, COUNT(*) FROM requests WHERE migrations > 0 GROUP BY principal"
    return {str(p): int(n) for p, n in _store_rows(run, sql)}


async def check_keys(run: Run) -> dict[str, Any]:
    from auth.store import KeyStore
    from bus_schemas import errors as E

    ids = [kid for _, kid in run.keys.values()] + run.acked_keys
    missing: list[str] = []
    nc = await run.stack.cluster.admin(0)
    try:
        store = await retrying("key store", lambda: KeyStore(nc).open(watch=False), 30)
        for kid in ids:
            try:
                await retrying(
                    f"key {kid}",
                    lambda kid=kid: store.get(kid),
                    15,
                )
            except RuntimeError as exc:
                if isinstance(exc.__cause__, E.NotFound):
                    missing.append(kid)
                else:
                    missing.append(f"{kid} ({exc.__cause__!r})")
    finally:
        await nc.close()
    return {"checked": len(ids), "created_during_run": len(run.acked_keys), "missing": missing}


async def _records_in_stream(nc: Any, missing: set[str]) -> dict[str, Any]:
    """Where the records of requests missing from the store went: how many of them the
    records' stream holds (then the consumer lost them) and by which publisher, read with
    an ephemeral ordered consumer from the stream's start."""
    from bus_schemas import codec
    from telemetry import records as R

    js = nc.jetstream(timeout=5)
    found: dict[str, set[str]] = {}
    seen = 0
    try:
        info = await js.stream_info(R.STREAM)
        last = info.state.last_seq
        sub = await js.subscribe(R.subject(), ordered_consumer=True, stream=R.STREAM)
        try:
            while seen < last:
                msg = await sub.next_msg(timeout=5)
                seen = msg.metadata.sequence.stream
                with contextlib.suppress(Exception):
                    for rec in R.batch(codec.decode_map(msg.data)):
                        rid = rec.get("client_request_id") if isinstance(rec, dict) else None
                        if rid in missing:
                            found.setdefault(rid, set()).add(str(rec.get("source")))
        finally:
            await sub.unsubscribe()
    except Exception as exc:
        return {"error": repr(exc), "read_to_seq": seen}
    by: Counter[str] = Counter("+".join(sorted(v)) for v in found.values())
    return {
        "in_stream": len(found),
        "not_in_stream": len(missing) - len(found),
        "in_stream_by_source": dict(by),
        "not_in_stream_sample": sorted(missing - set(found))[:5],
    }


def check_records(run: Run) -> dict[str, Any]:
    """Every answered request's record in the telemetry store once (by the client's request
    id, the label its records carry: the gateway gives each request an id of its own)."""
    rids = [o.rid for o in run.outcomes if o.via in ("http", "nats") and o.status == "ok"]
    db = run.stack.telemetry_db
    if not db.exists():
        return {"store": str(db), "error": "no telemetry store", "answered": len(rids)}
    labels = _records_by_label(run)
    missing = [r for r in rids if not labels.get(r)]
    # A request has a row per gateway id it was given (a resend or a migration no ticket
    # proved is given another); one id stored twice is a record stored twice.
    repeated = [r for r in rids if len({i for i, _ in labels.get(r, ())}) != len(labels.get(r, ()))]
    return {
        "store": "sqlite (telemetry/store.py, one row per request, by its client's label)",
        "answered": len(rids),
        "stored": len(rids) - len(missing),
        "missing": len(missing),
        "missing_sample": missing[:5],
        "missing_ids": missing,
        "repeated": len(repeated),
    }


async def invariants(
    run: Run, batch: dict[str, Any], background: dict[str, Any]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, violations: list[str], detail: Any = None, known: bool = False) -> None:
        out.append(
            {
                "name": name,
                "ok": not violations,
                "violations": len(violations),
                "examples": violations[:5],
                "detail": detail,
                **({"known_gap": True} if known else {}),
            }
        )

    cfg = run.cfg
    hung = [o for o in run.outcomes if o.status in ("hung", "open")]
    late = [
        o
        for o in run.outcomes
        if o.via in ("http", "nats") and o.status != "hung" and o.t1 - o.t0 > cfg.deadline_s + 5
    ]
    add(
        "every request ended within its deadline",
        [f"{o.rid} ({o.via}, window {o.window}): {o.status} {o.error}" for o in hung + late],
        {"hung": len(hung), "late": len(late)},
    )
    bad = [o for o in run.outcomes if not o.text_ok]
    add(
        "no streamed text has a gap or a repeat",
        [f"{o.rid} ({o.via}, {o.status}): {o.text_problem}" for o in bad]
        + [f"batch line {cid}: wrong text" for cid in batch.get("bad_text", [])],
    )
    bv = []
    if "error" in batch:
        bv.append(f"the batch did not end: {batch['error']}")
    for k in ("missing", "repeated", "unknown"):
        if batch.get(k):
            bv.append(f"batch lines {k}: {batch[k][:10]}")
    add("every batch line answered exactly once", bv, batch)
    bgv = [f"background response: {background['error']}"] if "error" in background else []
    add("the background response ended", bgv, background)
    from bus_schemas import subjects

    since = time.time()  # before the waits below (check_spend)
    nc = await run.stack.cluster.admin(0)
    try:
        # Records a killed telemetry service had taken are stored by the next one. The spend
        # check reads them too (which requests moved, and under which ids), so it waits for
        # them as well: read before the last were stored, a moved request's allowance was
        # missing and its lost attempt's charge counted as an overcharge (a loaded run, seed
        # 4805: 46 µ$ "over" on a request whose record came a moment later).
        settled = await _consumer_settled(
            nc, subjects.RECORDS_STREAM, subjects.RECORDS_CONSUMER, 60
        )
        spend = await check_spend(run, since)
        add("spend equals settled usage, no hold left", spend["violations"], spend["keys"])
        rec = {**check_records(run), "records_consumer_settled": settled}
        if rec.get("missing"):
            rec["missing_where"] = await _records_in_stream(nc, set(rec["missing_ids"]))
    finally:
        await nc.close()
    rec.pop("missing_ids", None)
    recv = []
    if rec.get("error"):
        recv.append(rec["error"])
    if rec.get("missing"):
        recv.append(f"{rec['missing']} answered requests have no record: {rec['missing_sample']}")
    if rec.get("repeated"):
        recv.append(f"{rec['repeated']} request ids stored more than once")
    add("every usage record stored once", recv, rec)
    keys = await check_keys(run)
    add(
        "keys created and acknowledged still exist",
        [f"key {k} is gone" for k in keys["missing"]],
        keys,
    )
    return out
