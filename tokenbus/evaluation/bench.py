"""``tokenbus bench``: a closed-loop concurrency sweep over HTTP (any OpenAI-compatible
endpoint) or NATS, with TTFT, TBT, end-to-end latency, tokens/s and errors, as JSON.

``--spawn`` starts its own stack (embedded nats-server, ingress, router, one sim worker, the
bridge) and the same sim engine behind a plain HTTP server, then measures both in one run,
level by level, so the gateway's cost is a ratio measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.config import Settings
from tokenbus.evaluation import peers
from tokenbus.evaluation.bench_load import run_rounds, run_sessions
from tokenbus.evaluation.bench_prompts import prompt_sizes
from tokenbus.evaluation.bench_report import (
    add_latency_split,
    compare,
    print_table,
    report_head,
    write_run_files,
)
from tokenbus.evaluation.bench_requests import Target
from tokenbus.evaluation.bench_stack import spawn_stack, stop_nats


def local_dev_key(s: Settings, url: str) -> str | None:
    """The dev key of a `tokenbus up` in this data folder (``<data_dir>/dev-key``), for a
    target on this machine only, as the other commands find the stack's files; said on
    stderr. A key is never sent to another host unless given with ``--api-key``."""
    from urllib.parse import urlsplit

    path = Path(s.up.data_dir) / "dev-key"
    hosts = {urlsplit(u.strip()).hostname for u in url.split(",")}
    if not path.is_file() or not hosts <= {"127.0.0.1", "localhost", "::1"}:
        return None
    print(f"using the dev key in {path} (--api-key to send another)", file=sys.stderr)
    return path.read_text().strip() or None


async def main(a: argparse.Namespace, s: Settings) -> int:
    if a.filter_cost:
        from tokenbus.evaluation.filter_cost import measure

        cost = {"tool": "tokenbus bench --filter-cost", **measure()}
        path = Path(a.out or f"bench-results/filter-{time.strftime('%Y%m%d-%H%M%S')}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cost, indent=2))
        print(json.dumps(cost, indent=2))
        return 0
    if a.spawn and a.no_direct and (a.upstream or a.peer):
        print("error: --upstream and --peer need the direct engine server: drop --no-direct")
        return 2
    for spec in a.peer:  # before anything starts: a peer that is not there is a usage error
        try:
            peers.parse(spec)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    levels_c = [int(x) for x in a.concurrency.split(",") if x.strip()]
    progress = not a.no_progress and sys.stderr.isatty()
    sup = nats = None
    if a.spawn:
        from services.supervisor import Supervisor

        sup = Supervisor(Path(tempfile.mkdtemp(prefix="tokenbus-bench-logs-")), echo=False)
        try:
            targets, nats = await spawn_stack(a, sup)
        except BaseException:
            await sup.stop(10)  # what did start, and said why not in its log
            print(f"logs: {sup.log_dir}", file=sys.stderr)
            raise
    elif a.mode == "nats":
        key = a.api_key or local_dev_key(s, s.url())
        targets = [Target("tokenbus-nats", "nats", s.url(), api_key=key, login=s.nats_auth())]
    else:
        key = a.api_key or local_dev_key(s, a.url)
        targets = [Target("target", "http", a.url.rstrip("/"), api_key=key)]
    if a.baseline_url and not a.spawn:
        targets.append(Target("baseline", "http", a.baseline_url.rstrip("/")))
    levels: list[dict[str, Any]] = []
    session_runs: list[dict[str, Any]] = []
    try:
        if a.sessions:
            levels_c = []
            for t in targets:
                session_runs.append(await run_sessions(t, a))
        for size in prompt_sizes(a):
            a.prompt_bytes_now = size
            for lv in await run_rounds(targets, levels_c[0], a, progress):
                lv["prompt_bytes"] = size
                levels.append(lv)
        if getattr(a, "prompt_bytes", None):
            levels_c = []
        for c in levels_c:
            levels += await run_rounds(targets, c, a, progress)
        if getattr(a, "telemetry_db", None):
            await asyncio.sleep(1.5)  # the telemetry service flushes its buffer
            add_latency_split(levels, a.telemetry_db)
    finally:
        if sup is not None:
            await sup.stop(10)
        await stop_nats(nats)
    report: dict[str, Any] = {
        **report_head("tokenbus bench"),
        "config": {k: v for k, v in vars(a).items() if k not in ("cmd",)},
        "levels": levels,
    }
    if session_runs:
        report["sessions"] = session_runs
    base = "direct" if a.spawn and not a.no_direct else ("baseline" if a.baseline_url else None)
    if base:
        report["comparison"] = [
            row for t in targets if t.name != base for row in compare(levels, t.name, base)
        ]
    out = Path(a.out or f"bench-results/bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if levels:
        write_run_files(levels, out.with_suffix(""))
    print_table(levels)
    for lv in levels:
        if lv["first_error"]:
            print(
                f"  {lv['target']} c={lv['concurrency']}: {lv['errors']} of {lv['requests']} "
                f"requests failed; the first: {lv['first_error']}"
            )
    for row in report.get("comparison", []):
        at = f" {row['prompt_bytes']} B" if row.get("prompt_bytes") else ""
        print(
            f"  c={row['concurrency']}{at}: {row['target']} vs {row['baseline']}: added TTFT p50 "
            f"{row.get('added_ttft_p50_ms')} ms, tokens/s ratio {row.get('tokens_per_s_ratio')}"
            f", CPU {row.get('cpu_us_per_token')} us/token"
        )
    for sr in session_runs:
        rt = sr["response_ms"]
        print(
            f"  {sr['target']}: {sr['sessions_completed']}/{sr['sessions']} sessions of "
            f"{sr['turns']} turns, response p50 {rt.get('p50')} ms p99 {rt.get('p99')} ms, "
            f"{sr['sessions_per_s']} sessions/s, tokens per {sr['bucket_s']:g} s bucket "
            f"{sr['tokens_per_bucket']}, errors {sr['errors']}"
        )
    print(f"results: {out}")
    runs = [*levels, *session_runs]
    return 0 if all(r["errors"] == 0 for r in runs) else 1
