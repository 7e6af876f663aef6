"""``tokenbus bench --pd``: prefill/decode disaggregation against aggregated serving on the
same number of replicas (docs/disaggregation.md).

For each replica count R of ``--pd-replicas`` (even), two stacks are spawned in turn: R
replicas serving whole requests, then R/2 prefill and R/2 decode replicas. Both run the sim
with vLLM's chunked prefill (a long prompt in the batch stretches every running sequence's
step) and the same load for ``--pd-duration`` seconds over NATS: ``--pd-short-clients``
clients of short chats (about 100 prompt tokens, 128 answer tokens) and ``--pd-long-clients``
clients of long prompts (about 6 000 tokens, each unique so no prefix cache helps, 32 answer
tokens). Reported (JSON) per configuration: TTFT p50/p99 per class, inter-token latency
p50/p99 (the short chats' gaps between tokens), tokens/s, and goodput: requests per second
whose TTFT and longest gap between two tokens both met the SLO (``--pd-slo-ttft-ms``,
``--pd-slo-itl-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from tokenbus.evaluation.bench_report import report_head, write_report
from tokenbus.evaluation.bench_stack import spawned

# The engine every configuration runs: an 8B-class model on one GPU, as the sim models it.
SIM_ENV = {
    "TOKENBUS_WORKER__SIM__CHUNKED_PREFILL_TOKENS": "2048",  # vLLM's max_num_batched_tokens
    "TOKENBUS_WORKER__SIM__PREFILL_MS_PER_TOKEN": "0.05",  # 20 000 prompt tokens a second
    "TOKENBUS_WORKER__SIM__DECODE_MS_PER_SEQ": "0.1",
    "TOKENBUS_WORKER__SIM__ANSWER_TOKENS_MEDIAN": "0",
    "TOKENBUS_ROUTER__PD_MIN_PROMPT_TOKENS": "512",
}
SHORT_PROMPT = "summarise the note about the meeting on tuesday " * 8  # ~100 tokens
LONG_WORDS = "the quarterly report covers revenue costs and the outlook for next year " * 340


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


async def _one(tb: Any, model: str, long: bool) -> dict[str, Any]:
    """One request: its class, TTFT, every gap between tokens (per token), tokens."""
    if long:
        prompt = f"{uuid.uuid4().hex} {LONG_WORDS}"  # unique: no prefix cache helps
        n = 32
    else:
        prompt, n = SHORT_PROMPT, 128
    msgs = [{"role": "user", "content": prompt}]
    t0 = time.perf_counter()
    last = 0.0
    first = 0.0
    gaps: list[float] = []
    tokens = 0
    s = tb.chat(model, msgs, max_tokens=n, ignore_eos=True)
    async for c in s:
        now = time.perf_counter()
        if not c.tokens:
            continue
        if not first:
            first = now
        elif last:
            gaps.extend([(now - last) * 1000 / c.tokens] * c.tokens)
        last = now
        tokens += c.tokens
    return {
        "long": long,
        "ttft_ms": (first - t0) * 1000 if first else None,
        "gaps": gaps,
        "tokens": tokens,
        "ok": tokens == n,
    }


async def _load(a: argparse.Namespace, bus: Any, shorts: int, longs: int) -> list[dict[str, Any]]:
    from tokenbus import Client

    out: list[dict[str, Any]] = []
    stop = time.monotonic() + a.pd_duration
    async with await Client.connect(bus.url, **bus.login) as tb:
        # Warm: one of each class, not counted.
        await _one(tb, a.model, False)
        await _one(tb, a.model, True)

        async def client(long: bool) -> None:
            while time.monotonic() < stop:
                try:
                    out.append(await _one(tb, a.model, long))
                except Exception as exc:
                    out.append({"long": long, "error": repr(exc)[:200]})

        await asyncio.gather(
            *(client(False) for _ in range(shorts)), *(client(True) for _ in range(longs))
        )
    return out


def _summary(a: argparse.Namespace, rows: list[dict[str, Any]], took: float) -> dict[str, Any]:
    done = [r for r in rows if r.get("ok")]
    short = [r for r in done if not r["long"]]
    long = [r for r in done if r["long"]]
    itl = [g for r in short for g in r["gaps"]]
    good = [
        r
        for r in done
        if r["ttft_ms"] is not None
        and r["ttft_ms"] <= a.pd_slo_ttft_ms
        and max(r["gaps"], default=0.0) <= a.pd_slo_itl_ms
    ]
    return {
        "requests": len(rows),
        "completed": len(done),
        "errors": [r["error"] for r in rows if "error" in r][:5],
        "short": {
            "requests": len(short),
            "ttft_ms": {"p50": _pct([r["ttft_ms"] for r in short], 0.5),
                        "p99": _pct([r["ttft_ms"] for r in short], 0.99)},
        },
        "long": {
            "requests": len(long),
            "ttft_ms": {"p50": _pct([r["ttft_ms"] for r in long], 0.5),
                        "p99": _pct([r["ttft_ms"] for r in long], 0.99)},
        },
        "ttft_ms": {"p50": _pct([r["ttft_ms"] for r in done], 0.5),
                    "p99": _pct([r["ttft_ms"] for r in done], 0.99)},
        "itl_ms": {"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99),
                   "mean": round(statistics.fmean(itl), 2) if itl else None},
        "tokens_per_s": round(sum(r["tokens"] for r in done) / took, 1),
        "goodput_rps": round(len(good) / took, 2),
        "slo_met": f"{len(good)} of {len(done)}",
    }  # fmt: skip


async def _config(
    a: argparse.Namespace, replicas: list[str], shorts: int, longs: int
) -> dict[str, Any]:
    a.replica = replicas
    async with spawned(a, SIM_ENV, logs="tokenbus-pd-logs-") as (targets, _sup):
        bus = next(t for t in targets if t.mode == "nats")
        t0 = time.monotonic()
        rows = await _load(a, bus, shorts, longs)
        took = time.monotonic() - t0
    return _summary(a, rows, took)


async def run_pd_bench(a: argparse.Namespace) -> int:
    a.no_direct = True
    a.nats_too = True
    a.pipeline = "route"
    a.sim_decode_ms = 15.0  # a step's fixed cost (the workers' flags)
    a.sim_prefill_ms = 5.0
    report: dict[str, Any] = {
        **report_head("tokenbus bench --pd"),
        "sim": {
            **{k.rsplit("__", 1)[1].lower(): v for k, v in SIM_ENV.items()},
            "decode_ms": a.sim_decode_ms,
        },
        "slo": {"ttft_ms": a.pd_slo_ttft_ms, "itl_ms": a.pd_slo_itl_ms},
        "duration_s": a.pd_duration,
        "runs": [],
    }
    failed = False
    for n in (int(x) for x in str(a.pd_replicas).split(",") if x.strip()):
        if n < 2 or n % 2:
            raise SystemExit(f"--pd-replicas: an even count of at least 2, got {n}")
        shorts, longs = a.pd_short_clients * n // 2, a.pd_long_clients * n // 2
        for name, spec in (
            ("aggregated", [f"{n}:"]),
            (f"{n // 2}P+{n // 2}D", [f"{n // 2}:role=prefill", f"{n // 2}:role=decode"]),
        ):
            got = await _config(a, spec, shorts, longs)
            got = {
                "config": name,
                "replicas": n,
                "short_clients": shorts,
                "long_clients": longs,
                **got,
            }
            print(json.dumps(got), flush=True)
            report["runs"].append(got)
            failed = failed or bool(got["errors"])
    write_report(report, a.out)
    return 1 if failed else 0
