"""A nemesis run's report: availability per fault kind, and the printed table."""

from __future__ import annotations

from typing import Any

from tokenbus.evaluation.nemesis_state import Run


def per_kind(run: Run) -> dict[str, dict[str, Any]]:
    """Per fault kind: faults injected, and the requests of its windows sent, completed,
    failed and hung, with their availability."""
    rows: dict[str, dict[str, Any]] = {}
    for w in run.windows:
        r = rows.setdefault(
            w["kind"], {"faults": 0, "sent": 0, "completed": 0, "failed": 0, "hung": 0}
        )
        r["faults"] += w["kind"] != "none"
    for o in run.outcomes:
        if o.via not in ("http", "nats"):
            continue
        r = rows[run.windows[o.window]["kind"]]
        r["sent"] += 1
        r["completed"] += o.status == "ok"
        r["failed"] += o.status == "error"
        r["hung"] += o.status in ("hung", "open")
    for r in rows.values():
        r["availability"] = round(r["completed"] / r["sent"], 4) if r["sent"] else None
    return rows


def print_table(report: dict[str, Any]) -> None:
    """The report on stdout: the per-kind table, the invariants, unplanned exits, errors."""
    print(
        f"\n{'fault kind':<16}{'faults':>7}{'sent':>7}{'done':>7}{'failed':>7}"
        f"{'hung':>6}{'avail':>8}"
    )
    for kind, r in report["per_kind"].items():
        av = "-" if r["availability"] is None else f"{r['availability']:.3f}"
        print(
            f"{kind:<16}{r['faults']:>7}{r['sent']:>7}{r['completed']:>7}{r['failed']:>7}"
            f"{r['hung']:>6}{av:>8}"
        )
    print("\ninvariants:")
    for inv in report["invariants"]:
        mark = "ok  " if inv["ok"] else "FAIL"
        print(f"  {mark} {inv['name']}" + ("" if inv["ok"] else f": {inv['violations']}"))
        for ex in inv["examples"]:
            print(f"         {ex}")
    for when, rows in report["unplanned_exits"].items():
        for x in rows:
            print(f"unplanned exit ({when}): {x['process']} rc={x['rc']} at {x['t']} s")
    served = report.get("served_by") or {}
    if served:
        print("\nanswered by replica:", ", ".join(f"{k} {v}" for k, v in sorted(served.items())))
    for site, link in (report.get("site_links") or {}).items():
        print(f"site {site}'s link: {link['up']} bytes up, {link['down']} down")
    errs = report["errors"]
    if errs:
        print("\nerrors seen:", ", ".join(f"{k} x{v}" for k, v in errs.items()))
    print(f"\nseed {report['seed']}; {report['violations']} invariant violations")
