"""``tokenbus bench --cold-path``: what one request's steps cost in a process that just woke.

At one request at a time every process on the path sleeps while the engine prefills, and
wakes for its part of the next request. On some machines (virtual machines especially) the
caches are cold by then, and the same Python runs many times slower than in a loop: that,
not the work counted in a warm profile, is most of what each hop adds at c=1
(docs/benchmarks.md, issue 50). This measures it for the steps the bridge and the worker
run in-process on a chat request, each timed once after the process slept ``--cold-gap-ms``
(cold: median of ``--cold-trials``) and in a loop (warm: the mean of many calls), and one
step after sleeps of several lengths. Nothing is spawned; the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from bus_schemas import codec, frames
from bus_schemas.messages import check_envelope
from engine_worker.backends.base import GenerationRequest
from filter.policy import FilterPolicy
from filter.service import Policies, filter_request
from gateway import validation
from gateway.ingress import Admission
from services import logging as tlog
from services.config import Settings
from tokenbus.evaluation.bench_report import report_head, write_report

BODY = {
    "model": "tokenbus-sim",
    "messages": [
        {"role": "user", "content": "Write a short poem about the sea and the sky, please."}
    ],
    "max_tokens": 64,
    "stream": True,
}
EVENT = (
    b'{"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":" hello"},"logprobs":null,"finish_reason":null}]}'
)


def steps() -> list[tuple[str, Callable[[], Any]]]:
    """(name, a call of that step) for each step, in the order a request meets them."""
    settings = Settings()
    admission = Admission(settings)
    raw = json.dumps(BODY).encode()
    req = validation.parse("chat", json.loads(raw))
    hdrs: dict[str, str] = {}
    env = admission.admit("chat", req, json.loads(raw), hdrs, time.time_ns())
    data = codec.encode(env)
    policies = Policies(settings.filter)
    log = tlog.get("bench")
    return [
        ("nothing (the timer itself)", lambda: None),
        ("bridge: the body's JSON", lambda: json.loads(raw)),
        ("bridge: validation.parse", lambda: validation.parse("chat", json.loads(raw))),
        (
            "bridge: admission (envelope, headers)",
            lambda: admission.admit("chat", req, json.loads(raw), {}, time.time_ns()),
        ),
        (
            "bridge: filter stage on the prompt",
            lambda: filter_request(policies, dict(hdrs), dict(env), log),
        ),
        ("bridge: envelope to msgpack", lambda: codec.encode(env)),
        ("worker: envelope from msgpack", lambda: codec.decode_map(data)),
        ("worker: check_envelope", lambda: check_envelope(codec.decode_map(data))),
        (
            "worker: GenerationRequest.from_envelope",
            lambda: GenerationRequest.from_envelope(codec.decode_map(data)),
        ),
        ("worker: the filter policy", lambda: FilterPolicy.from_dict(env.get("filter_policy"))),
        ("worker: an upstream SSE event's JSON", lambda: orjson.loads(EVENT)),
        ("worker: a chunk frame", lambda: frames.chunk(" hello", 1, 3)),
    ]


def _warm(fn: Callable[[], Any], n: int = 500) -> float:
    for _ in range(n // 2):
        fn()
    t = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t) / n / 1000


def _cold(
    fn: Callable[[], Any],
    gap_s: float,
    trials: int,
    before: Callable[[], Any] | None = None,
) -> float:
    """Median µs of ``fn`` called once after a sleep of ``gap_s`` (``before`` run untimed
    between the sleep and the call)."""
    xs = []
    for _ in range(trials):
        time.sleep(gap_s)
        if before is not None:
            before()
        t = time.perf_counter_ns()
        fn()
        xs.append((time.perf_counter_ns() - t) / 1000)
    return statistics.median(xs)


def _spin(ns: int) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter_ns() + ns
        while time.perf_counter_ns() < end:
            pass

    return spin


def measure(gap_ms: float, trials: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    timed = steps()
    for name, fn in timed:
        warm = _warm(fn)
        cold = _cold(fn, gap_ms / 1000, trials)
        rows.append(
            {
                "step": name,
                "warm_us": round(warm, 1),
                "cold_us": round(cold, 1),
                "ratio": round(cold / warm, 1) if warm >= 0.5 else None,
            }
        )
    parse = dict(timed)["bridge: validation.parse"]
    gaps = {str(g): round(_cold(parse, g / 1000, trials), 1) for g in (0.0, 0.1, 1.0, 10.0, 50.0)}
    # Caches or the clock? The same call again right after a cold one, and a cold call after
    # the CPU spun for 200 µs (a clock ramping up would be fast by then; caches would not).
    second = _cold(parse, gap_ms / 1000, trials, before=parse)
    spun = _cold(parse, gap_ms / 1000, trials, before=_spin(200_000))
    return {
        "gap_ms": gap_ms,
        "trials": trials,
        "steps": rows,
        "warm_steps_us": round(sum(r["warm_us"] for r in rows[1:]), 1),
        "cold_steps_us": round(sum(r["cold_us"] for r in rows[1:]), 1),
        "parse_after_sleep_ms_us": gaps,
        "parse_second_call_us": round(second, 1),
        "parse_after_200us_spin_us": round(spun, 1),
    }


def run_cold_path(a: argparse.Namespace) -> int:
    report = report_head("tokenbus bench --cold-path")
    report["cold_path"] = measure(a.cold_gap_ms, a.cold_trials)
    write_report(report, a.out)
    return 0
