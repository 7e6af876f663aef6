"""The closed loops of ``tokenbus bench``: a concurrency level (``--concurrency``, each client
sending ``--requests-per-client`` requests one after another) and Expert Router's sessions
(``--sessions``, ``--turns``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from tokenbus.evaluation.bench_prompts import RequestMaker
from tokenbus.evaluation.bench_requests import Result, Target, http_request, nats_request
from tokenbus.evaluation.bench_stats import cpu_seconds, rss_mb, summary_ms


async def run_level(
    target: Target, conc: int, total: int, a: argparse.Namespace, progress: bool
) -> dict[str, Any]:
    import aiohttp

    bodies = RequestMaker(a)
    results: list[Result] = []
    remaining = total
    peak: dict[str, float] = {}
    session = client = None
    if target.mode == "http":
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
            headers={"Authorization": f"Bearer {target.api_key}"} if target.api_key else None,
        )
    else:
        from tokenbus import Client

        client = await Client.connect(target.url, **target.login)

    async def one_client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            body = bodies.next()
            if session is not None:
                results.append(await http_request(session, target.url, body, a.timeout))
            else:
                results.append(await nats_request(client, body, a.timeout, target.api_key))

    async def sample() -> None:
        while True:
            for name, pid in target.pids.items():
                v = rss_mb(pid)
                if v is not None:
                    peak[name] = max(peak.get(name, 0.0), v)
            if progress:
                done = len(results)
                bar = int(30 * done / total)
                errs = sum(1 for r in results if not r.ok)
                sys.stderr.write(
                    f"\r  {target.name:<15} c={conc:<5} [{'#' * bar}{'.' * (30 - bar)}]"
                    f" {done}/{total} errors={errs}   "
                )
                sys.stderr.flush()
            await asyncio.sleep(0.25)

    sampler = asyncio.get_running_loop().create_task(sample())
    cpu0 = {n: cpu_seconds(p) for n, p in target.pids.items()}
    cpu0["bench-client"] = cpu_seconds(os.getpid())
    t0 = time.perf_counter()
    t0_ns = time.time_ns()
    try:
        await asyncio.gather(*(one_client() for _ in range(conc)))
    finally:
        wall = time.perf_counter() - t0
        sampler.cancel()
        cpu: dict[str, float] = {}
        cpu_s: dict[str, float] = {}
        for n, p in [*target.pids.items(), ("bench-client", os.getpid())]:
            before, after = cpu0.get(n), cpu_seconds(p)
            if before is not None and after is not None and wall:
                cpu[n] = round(100 * (after - before) / wall, 1)
                cpu_s[n] = after - before
        if session is not None:
            await session.close()
        if client is not None:
            await client.close()
    if progress:
        sys.stderr.write("\n")
    figures = _figures(results, wall)
    tokens = figures["output_tokens"]
    return {
        "target": target.name,
        "mode": target.mode,
        "concurrency": conc,
        **figures,
        "peak_rss_mb": {k: round(v, 1) for k, v in peak.items()},
        "cpu_percent": cpu,
        # CPU (user + system, from /proc) of the target's own processes per output token:
        # the gateway's cost, the engine's and the load generator's left out.
        "cpu_us_per_token": (
            round(1e6 * sum(v for k, v in cpu_s.items() if k != "bench-client") / tokens, 1)
            if tokens and len(cpu_s) > 1
            else None
        ),
        "window_ns": [t0_ns, time.time_ns()],
        # What :func:`merge` needs to join rounds (removed before the report is written).
        RAW: {"results": results, "cpu_s": cpu_s, "wall_s": wall},
    }


RAW = "_raw"


async def run_rounds(
    targets: list[Target], conc: int, a: argparse.Namespace, progress: bool
) -> list[dict[str, Any]]:
    """One level per target, each of ``conc * --requests-per-client`` requests. With
    ``--rounds N`` they are sent in N rounds, each running every target in turn (the order
    turned by one each round) for its share: drift in a shared machine's load falls on every
    target alike instead of on whichever ran last. The level's figures are over all rounds."""
    rounds = max(1, min(getattr(a, "rounds", 1), a.requests_per_client))
    parts: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for r in range(rounds):
        share = a.requests_per_client // rounds + (r < a.requests_per_client % rounds)
        k = r % len(targets)
        for t in [*targets[k:], *targets[:k]]:
            parts[t.name].append(await run_level(t, conc, conc * share, a, progress))
    out = [merge(parts[t.name]) for t in targets]
    for lv in out:
        lv.pop(RAW, None)
    return out


def _figures(results: list[Result], wall: float) -> dict[str, Any]:
    """A level's counts, errors, throughput and latencies from its requests' results and
    the time they took (one run, or every round of one joined)."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "first_error": next((r.error for r in results if not r.ok), None),
        "duration_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "requests_per_s": round(len(ok) / wall, 2) if wall else 0.0,
        "ttft_ms": summary_ms([r.ttft_s for r in ok]),
        "tbt_ms": summary_ms([r.tbt_s for r in ok if r.tbt_s is not None]),
        # Gaps between events with text, every request's pooled: what coalescing (the
        # worker's stream_coalesce_ms) trades, which the mean ``tbt_ms`` does not show.
        "itl_ms": summary_ms([g for r in ok for g in r.gaps_s]),
        "tokens_per_event": round(tokens / max(1, sum(len(r.gaps_s) + 1 for r in ok)), 2),
        "e2e_ms": summary_ms([r.e2e_s for r in ok]),
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The levels of one target's rounds as one level: latencies over every request, tokens
    per second over the time it was measured, peak memory the highest, CPU summed."""
    if len(parts) == 1:
        return parts[0]
    results: list[Result] = [r for p in parts for r in p[RAW]["results"]]
    wall = sum(p[RAW]["wall_s"] for p in parts)
    cpu_s: dict[str, float] = {}
    peak: dict[str, float] = {}
    for p in parts:
        for n, v in p[RAW]["cpu_s"].items():
            cpu_s[n] = cpu_s.get(n, 0.0) + v
        for n, v in p["peak_rss_mb"].items():
            peak[n] = max(peak.get(n, 0.0), v)
    figures = _figures(results, wall)
    tokens = figures["output_tokens"]
    return {
        **parts[0],
        "rounds": len(parts),
        **figures,
        "peak_rss_mb": peak,
        "cpu_percent": {n: round(100 * v / wall, 1) for n, v in cpu_s.items()} if wall else {},
        "cpu_us_per_token": (
            round(1e6 * sum(v for k, v in cpu_s.items() if k != "bench-client") / tokens, 1)
            if tokens and len(cpu_s) > 1
            else None
        ),
        "window_ns": [parts[0]["window_ns"][0], parts[-1]["window_ns"][1]],
        "windows_ns": [p["window_ns"] for p in parts],
    }


# -- Expert Router's methodology: sessions ----------------------------------------------------
async def run_sessions(target: Target, a: argparse.Namespace) -> dict[str, Any]:
    """``a.sessions`` users at once, each a conversation of ``a.turns`` requests: a base
    prompt, then "continue" with the history. Reports the p99 response time, sessions per
    second and output tokens per time bucket."""
    import aiohttp

    maker = RequestMaker(a)
    results: list[Result] = []
    sessions_done = 0
    session = client = None
    if target.mode == "http":
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
            headers={"Authorization": f"Bearer {target.api_key}"} if target.api_key else None,
        )
    else:
        from tokenbus import Client

        client = await Client.connect(target.url, **target.login)

    async def user(i: int) -> None:
        nonlocal sessions_done
        body = maker.next()
        for turn in range(a.turns):
            if session is not None:
                r = await http_request(session, target.url, body, a.timeout, keep_text=True)
            else:
                r = await nats_request(client, body, a.timeout, target.api_key, keep_text=True)
            results.append(r)
            if not r.ok:
                return
            history = "input" if "input" in body else "messages"
            body = {
                **body,
                history: [
                    *body[history],
                    {"role": "assistant", "content": r.text},
                    {"role": "user", "content": f"Continue ({turn + 2})."},
                ],
            }
        sessions_done += 1

    t0, wall0 = time.perf_counter(), time.time()
    try:
        await asyncio.gather(*(user(i) for i in range(a.sessions)))
    finally:
        wall = time.perf_counter() - t0
        if session is not None:
            await session.close()
        if client is not None:
            await client.close()
    ok = [r for r in results if r.ok]
    buckets: dict[int, int] = {}
    for r in ok:
        k = int((r.t_end - wall0) // a.bucket)
        buckets[k] = buckets.get(k, 0) + r.tokens
    return {
        "target": target.name,
        "sessions": a.sessions,
        "turns": a.turns,
        "sessions_completed": sessions_done,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "duration_s": round(wall, 3),
        "response_ms": summary_ms([r.e2e_s for r in ok]),
        "ttft_ms": summary_ms([r.ttft_s for r in ok]),
        "sessions_per_s": round(sessions_done / wall, 3) if wall else 0.0,
        "bucket_s": a.bucket,
        "tokens_per_bucket": [buckets.get(k, 0) for k in range(max(buckets, default=-1) + 1)],
    }
