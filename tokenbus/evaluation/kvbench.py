"""``tokenbus bench --kv-sessions``: multi-turn agent sessions on sim replicas that keep a
paged prefix cache, routed by each load policy in turn (docs/benchmarks.md).

Each session resends a growing conversation every turn, as Codex and Claude Code do: a
system prompt every session shares, then per turn a user message of a random 200 to 2 000
tokens and the model's answer. The sim's prefill costs ``prefill_ms_per_token`` for every
token its cache does not hold (engine_worker/kvcache.py), so where a turn lands decides its
time to first token. Each policy gets a stack of its own (nats-server, the bridge routing
in-process, ``--kv-replicas`` sim workers), the same sessions (same seed), and reports TTFT
p50/p99, output tokens/s and the replicas' own cache hit ratio (tokens read from the cache
over prompt tokens, from their snapshots). ``--kv-churn`` also kills one replica (SIGKILL)
at half time and starts a new one; the hit ratio is then reported per turn.

``index_cost()`` measures the router's index alone: event updates and lookups per second on
one core, and the routing decision's added time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bus_schemas import kv_events as kv
from bus_schemas import subjects
from tokenbus.evaluation.bench_report import report_head
from tokenbus.evaluation.bench_requests import http_request
from tokenbus.evaluation.bench_stack import environ, spawned
from tokenbus.evaluation.bench_stats import summary_ms

CHARS_PER_TOKEN = 4  # the sim's tokens (bus_schemas.kv_events.text_token_ids)
_WORDS = ("the", "agent", "reads", "files", "runs", "tests", "edits", "code", "and")


def _text(rng: random.Random, tokens: int) -> str:
    out: list[str] = []
    n = 0
    while n < tokens * CHARS_PER_TOKEN:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[: tokens * CHARS_PER_TOKEN]


async def _session(
    url: str, a: argparse.Namespace, sid: int, system: str, out: list[dict[str, Any]]
) -> None:
    import aiohttp

    rng = random.Random(a.seed * 7919 + sid)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    headers = {"X-Session-Id": f"s{sid}"}
    # With several routing instances a turn may land on any of them: a new connection each
    # (the kernel spreads connections over the bridge processes' shared port).
    connector = aiohttp.TCPConnector(force_close=a.kv_routers > 1)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as http:
        for turn in range(a.kv_turns):
            messages.append({"role": "user", "content": _text(rng, rng.randint(200, 2000))})
            body = {
                "model": a.model,
                "messages": messages,
                "max_tokens": a.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            t0 = time.perf_counter()
            r = await http_request(http, url, body, a.timeout, keep_text=True)
            out.append(
                {
                    "session": sid,
                    "turn": turn,
                    "ok": r.ok,
                    "ttft_s": r.ttft_s,
                    "tokens": r.tokens,
                    "t0": t0,
                    "t1": t0 + r.e2e_s,
                    "error": r.error,
                }
            )
            if not r.ok:
                return
            messages.append({"role": "assistant", "content": r.text})


async def _cache_stats(nats_url: str, model: str, replicas: list[str]) -> dict[str, Any]:
    import nats

    nc = await nats.connect(nats_url)
    out: dict[str, Any] = {}
    try:
        for name in replicas:
            try:
                msg = await nc.request(subjects.kv_snapshot(model, name), b"", timeout=5)
            except Exception:
                continue
            page = kv.decode_snapshot(msg.data)
            out[name] = page.get("stats") or {}
    finally:
        await nc.drain()
    return out


async def _index_metrics(url: str) -> dict[str, float]:
    """The routing bridge's KV index counters (its /metrics), summed over label values."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(url[: -len("/v1")] + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.startswith("tokenbus_kv_") and not sample.name.endswith("_created"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def _one(a: argparse.Namespace, policy: str, sessions: int) -> dict[str, Any]:
    from services.supervisor import Child
    from tokenbus.launcher import cli_argv

    b = argparse.Namespace(**vars(a))
    b.__dict__.update(
        pipeline="route",
        replica=[f"{a.kv_replicas}:max_concurrency=256"],
        no_direct=True,
        telemetry="off",
        peer=[],
        upstream=False,
        locked=False,
        nats_too=True,
        routing=json.dumps({"policy": policy}),
        engine="sim",
        bridge_processes=max(1, a.kv_routers),
    )
    env = {
        "TOKENBUS_WORKER__SIM__PREFILL_MS_PER_TOKEN": str(a.kv_prefill_ms_per_token),
        "TOKENBUS_WORKER__SIM__KV_CACHE_BLOCKS": str(a.kv_cache_blocks),
    }
    system = _text(random.Random(a.seed), a.kv_system_tokens)
    turns: list[dict[str, Any]] = []
    churn: dict[str, Any] = {}
    async with spawned(b, env, "tokenbus-kv-logs-") as (targets, sup):
        url, nats_url = targets[0].url, targets[1].url
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_session(url, a, i, system, turns)) for i in range(sessions)]
        if a.kv_churn:
            await asyncio.sleep(_half_time(a))
            victim = next(c for c in sup.children if c.name == "worker-0")
            victim.kill()  # and reaped: the supervisor no longer watches it
            sup.children.remove(victim)  # not restarted: a new replica joins instead
            with environ(env):
                argv = cli_argv("serve", "worker", "--replica", "bench-new", "--model", a.model)
                argv += ["--sim-prefill-ms", str(a.sim_prefill_ms)]
                argv += ["--sim-decode-ms", str(a.sim_decode_ms), "--max-concurrency", "256"]
                await sup.add(Child("worker-new", argv, {"TOKENBUS_NATS_URL": nats_url}))
            churn = {"killed": "bench-0", "added": "bench-new", "at_s": _half_time(a)}
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        names = [f"bench-{i}" for i in range(a.kv_replicas)] + ["bench-new"]
        stats = await _cache_stats(nats_url, a.model, names)
        index = await _index_metrics(url)
    ok = [t for t in turns if t["ok"]]
    query = sum(int(s.get("query_tokens", 0)) for s in stats.values())
    hit = sum(int(s.get("hit_tokens", 0)) for s in stats.values())
    by_turn = {}
    for n in range(a.kv_turns):
        ts = [t["ttft_s"] * 1000 for t in ok if t["turn"] == n]
        if ts:
            by_turn[n] = round(statistics.median(ts), 1)
    return {
        "policy": policy,
        "sessions": sessions,
        "routers": max(1, a.kv_routers),
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "first_error": next((t["error"] for t in turns if not t["ok"]), ""),
        "ttft_ms": summary_ms([t["ttft_s"] for t in ok]),
        "ttft_p50_by_turn_ms": by_turn,
        "output_tokens_per_s": round(sum(t["tokens"] for t in ok) / wall, 1) if wall else 0,
        "wall_s": round(wall, 2),
        "cache_hit_ratio": round(hit / query, 4) if query else None,
        # The closed loop over the run (docs/routing.md): the routers' predicted cached
        # tokens over what the replicas read from their caches (1: the index was right).
        "predicted_over_reported_cached": (
            round(index.get("tokenbus_kv_route_predicted_tokens_total", 0.0) / hit, 4)
            if hit and index.get("tokenbus_kv_route_predicted_tokens_total")
            else None
        ),
        "cache_by_replica": stats,
        "router_index": index,
        **({"churn": churn} if churn else {}),
    }


def _half_time(a: argparse.Namespace) -> float:
    """About half of a session's turns: each is a prefill and ``max_tokens`` decode steps."""
    per_turn = (a.sim_prefill_ms + a.max_tokens * a.sim_decode_ms) / 1000.0
    return float(per_turn * a.kv_turns / 2)


def index_cost(
    replicas: int = 4, blocks: int = 200_000, prompt_blocks: int = 800
) -> dict[str, Any]:
    """The router's index alone, on this core: stored events applied per second (one
    event per 16 blocks, as a prefill stores a chain), lookups of a ``prompt_blocks`` prompt
    per second with ``replicas`` replicas each holding ``blocks // replicas`` blocks."""
    from router.kv_index import KVIndex

    idx = KVIndex()
    rng = random.Random(1)
    chains: list[list[int]] = []
    for r in range(replicas):
        idx.load(
            {
                "replica": f"r{r}",
                "boot": "b",
                "block_size": 16,
                "capacity_blocks": 0,
                "seq": 0,
                "blocks": [],
            }
        )
    per = blocks // replicas
    t = time.perf_counter()
    n_events = 0
    for r in range(replicas):
        seq = 0
        made = 0
        while made < per:
            # a conversation of a quarter of the prompt's blocks
            tokens = [rng.getrandbits(32) for _ in range(16 * prompt_blocks // 4)]
            chain = kv.chain_hashes(tokens, 16)
            chains.append(chain)
            for i in range(0, len(chain), 16):
                seq += 1
                idx.apply(
                    {
                        "replica": f"r{r}",
                        "boot": "b",
                        "block_size": 16,
                        "seq_first": seq,
                        "seq_last": seq,
                        "ts_ms": 0,
                        "events": [kv.stored(chain[i : i + 16], chain[i - 1] if i else None, 16)],
                    }
                )
                n_events += 1
            made += len(chain)
    apply_s = time.perf_counter() - t
    # Prompts that extend a cached conversation with blocks nobody holds.
    probes = [
        c + [rng.getrandbits(63) for _ in range(prompt_blocks - len(c))] for c in chains[:200]
    ]
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 1.0:
        for p in probes:
            idx.lookup(p)
            n += 1
    lookup_s = (time.perf_counter() - t) / n
    text = _text(random.Random(2), prompt_blocks * 16)
    t = time.perf_counter()
    for _ in range(20):
        kv.text_block_hashes(text, 16)
    hash_s = (time.perf_counter() - t) / 20
    st = idx.stats()
    return {
        "replicas": replicas,
        "entries": st["entries"],
        "bytes_estimate": st["bytes_estimate"],
        "stored_events_per_s": round(n_events / apply_s),
        "block_updates_per_s": round(st["entries"] / apply_s),
        "lookups_per_s": round(1 / lookup_s),
        "lookup_us": round(lookup_s * 1e6, 1),
        "prompt_hash_us": round(hash_s * 1e6, 1),
        "prompt_blocks": prompt_blocks,
    }


async def run_kv_sessions(a: argparse.Namespace) -> int:
    levels = [int(x) for x in str(a.kv_sessions).split(",") if x.strip()]
    policies = [p for p in a.kv_policies.split(",") if p]
    runs = []
    for level in levels:
        for policy in policies:
            print(f"kv-sessions: {level} sessions, {policy}", file=sys.stderr)
            runs.append(await _one(a, policy, level))
    report = {
        **report_head("tokenbus bench --kv-sessions"),
        "config": {k: v for k, v in vars(a).items() if k != "cmd"},
        "runs": runs,
        "index_cost": index_cost(),
    }
    out = Path(a.out or f"bench-results/kv-sessions-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for r in runs:
        t = r["ttft_ms"]
        print(
            f"{r['sessions']:>4} sessions  {r['policy']:<18} TTFT p50 {t.get('p50')} ms "
            f"p99 {t.get('p99')} ms  {r['output_tokens_per_s']} tok/s  "
            f"hit ratio {r['cache_hit_ratio']}  errors {r['errors']}"
        )
    print(f"index: {json.dumps(report['index_cost'])}")
    print(f"results: {out}")
    return 0 if all(r["errors"] == 0 for r in runs) else 1
