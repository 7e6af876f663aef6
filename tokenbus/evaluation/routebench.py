"""``tokenbus bench --routing-trace N``: one generated trace (tokenbus.evaluation.trace: shared
system prompts, multi-turn sessions, a long tail of prompt lengths) replayed against each
routing policy in turn, on sim replicas with prefix caches and chunked prefill, side by side
in one run: TTFT p50/p99, time between tokens p99 (of each request's mean gap), output
tokens/s, goodput (requests per second that met the SLO) and the closed loop's ratio
(predicted cached tokens over the replicas' own hits; docs/routing.md).

Each policy gets a stack of its own (nats-server, the bridge routing in-process,
``--kv-replicas`` sim workers, or the groups ``--replica`` names: a mixed fleet such as
``--replica 2:tp=2 --replica 2:``) and the same trace (same seed, same arrivals).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bus_schemas import codec, subjects
from tokenbus.evaluation import trace as T
from tokenbus.evaluation.bench_report import report_head
from tokenbus.evaluation.bench_requests import http_request
from tokenbus.evaluation.bench_stack import replica_specs, spawned
from tokenbus.evaluation.bench_stats import percentile, summary_ms
from tokenbus.evaluation.kvbench import _cache_stats, _index_metrics, _text

POLICIES = ("least_outstanding", "prefix_aware", "kv_aware", "predicted_latency")


async def _session(
    url: str, a: argparse.Namespace, s: T.Session, systems: list[str], t0: float, out: list[Any]
) -> None:
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.perf_counter()))
    rng = random.Random(a.seed * 7919 + s.id)
    messages: list[dict[str, Any]] = [{"role": "system", "content": systems[s.system]}]
    async with aiohttp.ClientSession(headers={"X-Session-Id": f"s{s.id}"}) as http:
        for n, turn in enumerate(s.turns):
            await asyncio.sleep(float(turn["think_s"]))
            messages.append({"role": "user", "content": _text(rng, int(turn["user_tokens"]))})
            body = {
                "model": a.model,
                "messages": messages,
                "max_tokens": int(turn["output_tokens"]),
                "stream": True,
                # The usage (its prompt and cached tokens: the request's row, its tail).
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            start = time.perf_counter() - t0
            r = await http_request(http, url, body, a.timeout, keep_text=True)
            out.append(
                {"session": s.id, "turn": n, "ok": r.ok, "ttft_s": r.ttft_s, "tbt_s": r.tbt_s}
                | {"tokens": r.tokens, "error": r.error, "start_s": round(start, 3)}
                | {"replica": r.replica, "prompt": r.prompt_tokens, "cached": r.cached_tokens}
            )
            if not r.ok:
                return
            messages.append({"role": "assistant", "content": r.text})


async def _one(
    a: argparse.Namespace, policy: str, head: dict[str, Any], sessions: list[Any]
) -> dict[str, Any]:
    b = argparse.Namespace(**vars(a))
    b.__dict__.update(
        pipeline="route",
        # --replica groups make a mixed fleet (e.g. two tp=2 replicas beside two of tp 1).
        replica=a.replica or [f"{a.kv_replicas}:max_concurrency=256"],
        no_direct=True,
        telemetry="off",
        peer=[],
        upstream=False,
        locked=False,
        nats_too=True,
        # --routing's other settings (kv weights, when_behind) with each policy in turn.
        routing=json.dumps({**json.loads(a.routing or "{}"), "policy": policy}),
        engine="sim",
        bridge_processes=1,
    )
    env = {
        "TOKENBUS_WORKER__SIM__PREFILL_MS_PER_TOKEN": str(a.kv_prefill_ms_per_token),
        "TOKENBUS_WORKER__SIM__KV_CACHE_BLOCKS": str(a.kv_cache_blocks),
        "TOKENBUS_WORKER__SIM__CHUNKED_PREFILL_TOKENS": str(a.trace_chunked_prefill),
    }
    systems = [_text(random.Random(a.seed + i), n) for i, n in enumerate(head["system_tokens"])]
    done: list[dict[str, Any]] = []
    async with spawned(b, env, "tokenbus-routing-logs-") as (targets, _sup):
        url, nats_url = targets[0].url, targets[1].url
        beats: dict[str, dict[str, Any]] = {}
        async with _heartbeats(nats_url, beats):
            t0 = time.perf_counter()
            await asyncio.gather(*(_session(url, a, s, systems, t0, done) for s in sessions))
            wall = time.perf_counter() - t0
        names = [f"bench-{i}" for i in range(len(replica_specs(b.replica)))]
        stats = await _cache_stats(nats_url, a.model, names)
        index = await _index_metrics(url)
    ok = [d for d in done if d["ok"]]
    slo_ttft, slo_tbt = a.slo_ttft_ms / 1000, a.slo_tbt_ms / 1000
    good = [d for d in ok if d["ttft_s"] <= slo_ttft and (d["tbt_s"] or 0) <= slo_tbt]
    hit = sum(int(s.get("hit_tokens", 0)) for s in stats.values())
    query = sum(int(s.get("query_tokens", 0)) for s in stats.values())
    predicted = index.get("tokenbus_kv_route_predicted_tokens_total", 0.0)
    behind = index.get("tokenbus_kv_route_behind_decisions_total", 0.0)
    decisions = index.get("tokenbus_kv_route_decisions_total", 0.0)
    return {
        "policy": policy,
        "requests": len(done),
        "errors": len(done) - len(ok),
        "ttft_ms": summary_ms([d["ttft_s"] for d in ok]),
        "tbt_ms": summary_ms([d["tbt_s"] for d in ok if d["tbt_s"] is not None]),
        "output_tokens_per_s": round(sum(d["tokens"] for d in ok) / wall, 1) if wall else 0,
        "goodput_rps": round(len(good) / wall, 3) if wall else 0,
        "slo_met": round(len(good) / len(done), 4) if done else None,
        "wall_s": round(wall, 2),
        "cache_hit_ratio": round(hit / query, 4) if query else None,
        "predicted_over_reported_cached": round(predicted / hit, 4) if hit and predicted else None,
        # predicted_latency: the share of its decisions made while every replica was behind.
        "behind_share": round(behind / decisions, 4) if decisions else 0.0,
        "replicas": _per_replica(stats, beats, query, ok),
        "tail": _tail(ok),
        # What the placement cost in prefill: the prompt tokens the engines computed (not
        # read from cache), and how often a session's next turn went to another replica.
        "computed_tokens": sum(_computed(d) for d in ok),
        "session_moves": _moves(ok),
        "pooled_ttft_ms": _pooled(ok, [(beats.get(n) or {}).get("perf") for n in names]),
    } | ({"detail": [_row(d) for d in done]} if a.trace_detail else {})


def _row(d: dict[str, Any]) -> dict[str, Any]:
    """One request's row for ``--trace-detail``: times in ms."""
    ttft, tbt = d["ttft_s"], d["tbt_s"]
    return {k: v for k, v in d.items() if k not in ("ttft_s", "tbt_s")} | {
        "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "tbt_ms": round(tbt * 1000, 1) if tbt is not None else None,
    }


def _tail(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """What the slowest 1 % of first tokens (TTFT at or past the p99) were: how many, on
    which replicas, their prompts' median tokens and median tokens not read from cache, the
    share of them that were a session's first turn, and the median of when they were sent
    (seconds into the run)."""
    if not ok:
        return {}
    # The reported p99's own value (summary_ms), so the tail is what that figure names.
    cut = percentile([d["ttft_s"] for d in ok], 99)
    slow = [d for d in ok if d["ttft_s"] >= cut]
    by_replica = collections.Counter(d["replica"] or "?" for d in slow)
    return {
        "requests": len(slow),
        "replicas": dict(sorted(by_replica.items())),
        "prompt_tokens_p50": statistics.median(d["prompt"] for d in slow),
        "uncached_tokens_p50": statistics.median(d["prompt"] - d["cached"] for d in slow),
        "first_turn_share": round(sum(d["turn"] == 0 for d in slow) / len(slow), 3),
        "start_s_p50": statistics.median(d["start_s"] for d in slow),
    }


def _computed(d: dict[str, Any]) -> int:
    """The prompt tokens a request's engine computed (its prompt less what it read cached)."""
    return max(0, int(d["prompt"] or 0) - int(d["cached"] or 0))


def _moves(ok: list[dict[str, Any]]) -> int:
    """How many times a session's next turn was served by another replica than its last."""
    last: dict[int, tuple[int, str | None]] = {}
    moves = 0
    for d in sorted(ok, key=lambda d: (d["session"], d["turn"])):
        prev = last.get(d["session"])
        if prev is not None and prev[1] is not None and d["replica"] is not None:
            moves += prev[0] == d["turn"] - 1 and prev[1] != d["replica"]
        last[d["session"]] = (d["turn"], d["replica"])
    return moves


def _pooled(ok: list[dict[str, Any]], perfs: list[Any]) -> dict[str, float]:
    """TTFT p50/p99 of the same requests on a perfectly balanced fleet: every replica's
    prefill speed (as it learned it) pooled into one first-come, first-served queue, each
    request arriving when it was sent with the prompt tokens this run's caches left it to
    compute, its own prefill no faster than on the fastest replica. A reference for how much
    of a policy's tail is the trace's own bursts of work, not a bound: a router can let a short
    prompt pass a long one, and hits depend on the placement."""
    rates = [float(p["prefill_ms_per_token"]) for p in perfs if p and p.get("prefill_ms_per_token")]
    if not ok or not rates or len(rates) != len(perfs):
        return {}
    pooled = sum(1.0 / r for r in rates)  # prompt tokens a ms, the whole fleet
    base = statistics.median(float(p.get("ttft_base_ms") or 0.0) for p in perfs)
    queue, at, est = 0.0, 0.0, []
    for d in sorted(ok, key=lambda d: d["start_s"]):
        now = d["start_s"] * 1000.0
        queue, at = max(0.0, queue - (now - at) * pooled), now
        own = _computed(d)
        est.append(base + max((queue + own) / pooled, own * min(rates)))
        queue += own
    return {"p50": round(percentile(est, 50), 1), "p99": round(percentile(est, 99), 1)}


@contextlib.asynccontextmanager
async def _heartbeats(nats_url: str, latest: dict[str, dict[str, Any]]) -> AsyncIterator[None]:
    """Keep each replica's latest heartbeat in ``latest`` while the block runs."""
    import nats

    nc = await nats.connect(nats_url)

    async def keep(msg: Any) -> None:
        hb = codec.decode_map(msg.data)
        latest[str(hb.get("replica"))] = hb

    try:
        await nc.subscribe(subjects.heartbeat_wildcard(), cb=keep)
        yield
    finally:
        await nc.drain()


def _per_replica(
    stats: dict[str, Any], beats: dict[str, dict[str, Any]], query: int, ok: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per replica: its share of the prompt tokens, its cache hit ratio, the requests it
    served and their TTFT p50/p99, and the speed it announced last (what predicted_latency
    routed on)."""
    ttfts: dict[str, list[float]] = {}
    for d in ok:
        ttfts.setdefault(d["replica"], []).append(d["ttft_s"])
    out: dict[str, Any] = {}
    for name, st in sorted(stats.items()):
        q, h = int(st.get("query_tokens", 0)), int(st.get("hit_tokens", 0))
        mine = summary_ms(ttfts.get(name, []))
        out[name] = {
            "prompt_token_share": round(q / query, 4) if query else None,
            "hit_ratio": round(h / q, 4) if q else None,
            "requests": len(ttfts.get(name, [])),
            "ttft_ms": {k: mine[k] for k in ("p50", "p99")} if mine else {},
            "perf": (beats.get(name) or {}).get("perf"),
        }
    return out


async def run_routing_trace(a: argparse.Namespace) -> int:
    if a.trace_file:
        head, sessions = T.load(Path(a.trace_file))
    else:
        head, sessions = T.generate(
            T.TraceShape(
                sessions=a.routing_trace, seed=a.seed, sessions_per_s=a.trace_sessions_per_s
            )
        )
    policies = [p for p in a.trace_policies.split(",") if p]
    runs = []
    for policy in policies:
        print(f"routing-trace: {len(sessions)} sessions, {policy}", file=sys.stderr)
        runs.append(await _one(a, policy, head, sessions))
    report = {
        **report_head("tokenbus bench --routing-trace"),
        "config": {k: v for k, v in vars(a).items() if k != "cmd"},
        "trace": head,
        "runs": runs,
    }
    out = Path(a.out or f"bench-results/routing-trace-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for r in runs:
        t, g = r["ttft_ms"], r["tbt_ms"]
        print(
            f"{r['policy']:<18} TTFT p50 {t.get('p50')} p99 {t.get('p99')} ms  "
            f"(pooled fleet p99 {r['pooled_ttft_ms'].get('p99')} ms)  "
            f"TBT p99 {g.get('p99')} ms  goodput {r['goodput_rps']} req/s "
            f"(SLO met {r['slo_met']})  hit {r['cache_hit_ratio']}  "
            f"predicted/reported {r['predicted_over_reported_cached']}  errors {r['errors']}"
        )
    print(f"results: {out}")
    return 0
