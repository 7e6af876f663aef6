"""``tokenbus bench --tenants SCENARIO``: many tenants on one saturated model (issue 34).

Each scenario starts a stack of its own (:func:`.bench_stack.spawn_stack`: nats-server,
ingress, auth, ratelimit, router, one sim worker, the bridge; no telemetry), creates a key
per tenant in the key store, and runs twice: with the worker's flow control on
(engine_worker/flow.py) and off (every request goes to the engine at once, which queues what
its batch cannot take first come first served), so the two sit side by side in one report.

* ``two``: tenant A keeps 64 streams of 128 tokens going, tenant B sends one 8-token request
  at a time: B's time to first token alone and while A floods, and the tokens/s of both.
* ``weights``: three tenants with key weights 1, 2 and 4 flood together: each one's share of
  the tokens against 1/7, 2/7 and 4/7.
* ``tiers``: a ``default`` key at c = 8 while a ``flex`` key floods at c = 256 (a batch of
  256, each sequence in it slowing the step): default's time to first token, unloaded and
  under the flood, and the flex answers that still complete.
* ``overload``: requests sent at three times the rate the replica can serve, each with a
  deadline (the bridge's ``request_timeout_s``: an HTTP client cannot ask for its own):
  answers by status, ``Retry-After`` on every 429 and 503, none longer than its deadline,
  and the resident memory of every process of the stack.

Tokens are counted in a measured window: an answer's tokens are spread evenly between its
first token and its end (the sim streams at one token per engine step), so an answer that
straddles the window counts for the part inside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbus.evaluation.bench_prompts import RequestMaker
from tokenbus.evaluation.bench_report import report_head
from tokenbus.evaluation.bench_requests import Result, http_request
from tokenbus.evaluation.bench_stack import bench_key, spawned
from tokenbus.evaluation.bench_stats import rss_mb, summary_ms

SCENARIOS = ("two", "weights", "tiers", "overload")
FLOWS = ("on", "off")
# The stages every request crosses: keys are what flows are counted by.
PIPELINE = "auth,ratelimit,route"
# Seconds of each phase before the measured window (at most the window's length).
ALONE_S = 5.0
WARM_S = 3.0
# A request of the overload scenario must end within this of its deadline.
DEADLINE_SLACK_S = 1.0


# -- the pieces: a stack, a tenant, a window --------------------------------------------------
@dataclass
class Engine:
    """The sim engine of a scenario's one worker."""

    max_running: int
    max_concurrency: int
    prefill_ms: float
    decode_ms: float
    decode_ms_per_seq: float = 0.0

    def step_ms(self, batch: int) -> float:
        """A decode step's time with ``batch`` sequences running (the sim's cost model)."""
        return self.decode_ms + self.decode_ms_per_seq * batch

    def answer_s(self, tokens: int) -> float:
        """One answer's time in a full batch: its prefill, then a step per further token."""
        return (self.prefill_ms + (tokens - 1) * self.step_ms(self.max_running)) / 1000.0


@dataclass
class Stack:
    """A running stack: the bridge's base URL, the bus, the pids of every process."""

    url: str
    nats_url: str
    pids: dict[str, int]


@contextlib.asynccontextmanager
async def stack(
    a: argparse.Namespace, engine: Engine, flow: str, env: dict[str, str] | None = None
) -> AsyncIterator[Stack]:
    """A private stack with one sim worker like ``engine``, its flow control ``flow``."""
    b = argparse.Namespace(**vars(a))
    b.__dict__.update(
        pipeline=PIPELINE,
        replica=[
            f"1:max_concurrency={engine.max_concurrency},"
            f"decode_ms_per_seq={engine.decode_ms_per_seq},flow={flow}"
        ],
        sim_max_running=engine.max_running,
        sim_prefill_ms=engine.prefill_ms,
        sim_decode_ms=engine.decode_ms,
        nats_too=True,  # its target names the bus, where the tenants' keys are created
        no_direct=True,
        telemetry="off",
        peer=[],
        upstream=False,
        locked=False,
        routing=None,
    )
    async with spawned(b, env, "tokenbus-tenants-logs-") as (targets, _):
        yield Stack(targets[0].url, targets[1].url, dict(targets[0].pids))


@dataclass
class Timed:
    """One request as the tenant saw it: sent at ``t0``, over at ``t1`` (perf_counter)."""

    t0: float
    t1: float
    r: Result

    @property
    def first(self) -> float:
        return self.t0 + self.r.ttft_s


@dataclass
class Tenant:
    """A client with a key of its own: its session, its request bodies, what it got."""

    name: str
    key: str
    url: str
    maker: RequestMaker
    timeout: float
    session: Any = None
    done: list[Timed] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after: Counter[int] = field(default_factory=Counter)  # status -> with Retry-After
    tier: str | None = None  # the service tier its answers report

    @classmethod
    async def create(
        cls,
        a: argparse.Namespace,
        st: Stack,
        name: str,
        max_tokens: int,
        max_tokens_std: float = 0.0,
        **key: Any,
    ) -> Tenant:
        """A new key (``key``: its weight, service tier) and a tenant sending with it."""
        # The run's prompt (--prompt, --prompts, --prompt-words); answers of a fixed length
        # (or normally spread around it: ``max_tokens_std``).
        shape = {"api": "chat", "max_tokens": max_tokens, "max_tokens_std": max_tokens_std}
        maker = RequestMaker(argparse.Namespace(**{**vars(a), **shape, "extra_body": None}))
        secret = await bench_key(st.nats_url, name=name, **key)
        return cls(name, secret, st.url, maker, a.timeout)

    async def __aenter__(self) -> Tenant:
        import aiohttp

        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(self._on_response)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
            headers={"Authorization": f"Bearer {self.key}"},
            trace_configs=[trace],
        )
        await self._known()
        return self

    async def _known(self, timeout: float = 10.0) -> None:
        """Until auth knows the new key (it learns keys from the store's watch), with a
        whole one-token answer: the service tier it reports is kept."""
        body = {"model": self.maker.a.model, "messages": [{"role": "user", "content": "hi"}]}
        deadline = time.monotonic() + timeout
        while True:
            async with self.session.post(
                self.url + "/chat/completions", json={**body, "max_tokens": 1}
            ) as resp:
                if resp.status == 200:
                    self.tier = (await resp.json()).get("service_tier")
                    break
                if resp.status != 401 or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: {resp.status} {await resp.text()}")
            await asyncio.sleep(0.05)
        self.statuses.clear()
        self.retry_after.clear()

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def _on_response(self, _session: Any, _ctx: Any, params: Any) -> None:
        """Every response's status, and whether a refusal says when to retry."""
        status = params.response.status
        self.statuses[status] += 1
        if "Retry-After" in params.response.headers:
            self.retry_after[status] += 1

    async def one(self) -> Timed:
        t0 = time.perf_counter()
        r = await http_request(self.session, self.url, self.maker.next(), self.timeout)
        timed = Timed(t0, time.perf_counter(), r)
        self.done.append(timed)
        return timed

    async def loop(self, until: float = math.inf) -> None:
        """One request at a time until ``until`` (perf_counter), or until cancelled."""
        while time.perf_counter() < until:
            await self.one()

    @contextlib.asynccontextmanager
    async def streams(self, n: int, engine: Engine | None = None) -> AsyncIterator[None]:
        """``n`` closed loops while the block runs (cancelled when it ends). With an
        ``engine``, the first of them (one per slot of its batch) start spread over one
        answer's time, the rest after it: see :func:`_ramp`."""
        gap = _ramp(engine, self.maker.a.max_tokens) / engine.max_running if engine else 0.0
        slots = engine.max_running if engine else 0

        async def later(delay: float) -> None:
            await asyncio.sleep(delay)
            await self.loop()

        tasks = [asyncio.ensure_future(later(gap * min(i, slots))) for i in range(n)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def sent(self, w0: float, w1: float) -> list[Timed]:
        return [t for t in self.done if w0 <= t.t0 < w1]

    def ttft_ms(self, w0: float, w1: float) -> dict[str, float]:
        """TTFT of the answers asked for in the window."""
        return summary_ms([t.r.ttft_s for t in self.sent(w0, w1) if t.r.ok])

    def tokens(self, w0: float, w1: float) -> float:
        """Tokens received in the window (each answer's spread over its streaming time)."""
        total = 0.0
        for t in self.done:
            if not t.r.ok:
                continue
            a, b = t.first, t.t0 + t.r.e2e_s
            if b - a <= 1e-9:
                total += t.r.tokens if w0 <= a <= w1 else 0
                continue
            inside = max(0.0, min(b, w1) - max(a, w0))
            total += t.r.tokens * inside / (b - a)
        return total

    def errors(self) -> dict[str, int]:
        return dict(Counter(t.r.error.partition(":")[0] for t in self.done if not t.r.ok))


def _ramp(engine: Engine | None, tokens: int) -> float:
    """How long a flood takes to start (:meth:`Tenant.streams`): one answer's time, its
    first requests spread over it. Answers of one length started together end together, so
    slots would free up in bursts, one batch at a time, for the whole run; spread, one frees
    up every answer time / batch (a slot's turnover), as with independent clients."""
    return engine.answer_s(tokens) if engine is not None else 0.0


def _warm(a: argparse.Namespace, ramp: float) -> float:
    """Seconds from a flood's start to the measured window."""
    return max(min(WARM_S, float(a.duration)), ramp + 1.0)


async def worker_flow(st: Stack, timeout: float = 5.0) -> dict[str, Any] | None:
    """What the worker's next heartbeat says of its flow control: per class, requests
    served and shed and their summed wait (None when it is off)."""
    import nats

    from bus_schemas import codec, subjects

    beat: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def on_beat(msg: Any) -> None:
        if not beat.done():
            beat.set_result(codec.decode_map(msg.data))

    nc = await nats.connect(st.nats_url)
    try:
        await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_beat)
        async with asyncio.timeout(timeout):
            body = await beat
    finally:
        await nc.drain()
    flow = body.get("flow")
    return dict(flow) if isinstance(flow, dict) else None


def _mean_wait_ms(before: dict[str, Any] | None, after: dict[str, Any] | None, cls: str) -> Any:
    """A class's mean wait for a slot between two :func:`worker_flow` snapshots."""
    if before is None or after is None:
        return None
    served = after[cls]["served"] - before[cls]["served"]
    waited = after[cls]["wait_s_sum"] - before[cls]["wait_s_sum"]
    return round(1000 * waited / served, 3) if served else None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.perf_counter()))


def _engine(a: argparse.Namespace, **kw: Any) -> Engine:
    """The scenario's engine at the run's prefill and decode times (--sim-*-ms)."""
    return Engine(prefill_ms=a.sim_prefill_ms, decode_ms=a.sim_decode_ms, **kw)


def _rate(tokens: float, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds > 0 else 0.0


# -- the scenarios ------------------------------------------------------------------------------
async def two(a: argparse.Namespace, flow: str) -> dict[str, Any]:
    """A floods (64 streams of 128 tokens); B sends one short request at a time."""
    eng = _engine(a, max_running=8, max_concurrency=256)
    a_streams, a_tokens, b_tokens = 64, 128, 8
    async with stack(a, eng, flow) as st:
        ta = await Tenant.create(a, st, "tenant-a", a_tokens)
        tb = await Tenant.create(a, st, "tenant-b", b_tokens)
        async with ta, tb:
            alone0 = time.perf_counter()
            alone1 = alone0 + min(ALONE_S, a.duration)
            await tb.loop(alone1)
            async with ta.streams(a_streams, eng):
                await asyncio.sleep(_warm(a, _ramp(eng, a_tokens)))
                w0 = time.perf_counter()
                w1 = w0 + a.duration
                await tb.loop(w1)
                # A's answers streaming at the window's end finish inside the grace.
                await _until(w1 + eng.answer_s(a_tokens) + 1.0)
                flow_stats = await worker_flow(st)
    sec = w1 - w0
    tok_a, tok_b = ta.tokens(w0, w1), tb.tokens(w0, w1)
    return {
        "b_alone_ttft_ms": tb.ttft_ms(alone0, alone1),
        "b_alone_requests": len(tb.sent(alone0, alone1)),
        "b_flood_ttft_ms": tb.ttft_ms(w0, w1),
        "b_flood_requests": len(tb.sent(w0, w1)),
        "a_tokens_per_s": _rate(tok_a, sec),
        "b_tokens_per_s": _rate(tok_b, sec),
        "total_tokens_per_s": _rate(tok_a + tok_b, sec),
        "window_s": round(sec, 3),
        "errors": {"a": ta.errors(), "b": tb.errors()},
        "worker_flow": flow_stats,
        "settings": {
            "engine": vars(eng),
            "a": {"streams": a_streams, "max_tokens": a_tokens},
            "b": {"concurrency": 1, "max_tokens": b_tokens},
            "slot_turnover_ms": round(a_tokens * eng.step_ms(eng.max_running) / eng.max_running, 3),
        },
    }


WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0}


async def weights(a: argparse.Namespace, flow: str) -> dict[str, Any]:
    """Three keys of weights 1, 2 and 4, each flooding: their shares of the tokens."""
    eng = _engine(a, max_running=8, max_concurrency=256)
    streams, tokens = 32, 64
    async with stack(a, eng, flow) as st:
        ts = [
            await Tenant.create(a, st, f"tenant-{n}", tokens, weight=w) for n, w in WEIGHTS.items()
        ]
        async with contextlib.AsyncExitStack() as es:
            for t in ts:
                await es.enter_async_context(t)
                await es.enter_async_context(t.streams(streams))
            await asyncio.sleep(_warm(a, 0.0))
            w0 = time.perf_counter()
            w1 = w0 + a.duration
            await _until(w1 + eng.answer_s(tokens) + 1.0)
            flow_stats = await worker_flow(st)
    got = {n: t.tokens(w0, w1) for n, t in zip(WEIGHTS, ts, strict=True)}
    total = sum(got.values())
    wsum = sum(WEIGHTS.values())
    return {
        "tokens": {n: round(v) for n, v in got.items()},
        "share": {n: round(v / total, 4) if total else 0.0 for n, v in got.items()},
        "expected_share": {n: round(w / wsum, 4) for n, w in WEIGHTS.items()},
        "total_tokens_per_s": _rate(total, w1 - w0),
        "window_s": round(w1 - w0, 3),
        "errors": {n: t.errors() for n, t in zip(WEIGHTS, ts, strict=True)},
        "worker_flow": flow_stats,
        "settings": {
            "engine": vars(eng),
            "per_tenant": {"streams": streams, "max_tokens": tokens},
            "weights": WEIGHTS,
        },
    }


async def tiers(a: argparse.Namespace, flow: str) -> dict[str, Any]:
    """``default`` at c = 8, alone then while ``flex`` floods at c = 256."""
    eng = _engine(a, max_running=256, max_concurrency=512, decode_ms_per_seq=0.2)
    d_conc, d_tokens, f_conc, f_tokens = 8, 64, 256, 128
    async with stack(a, eng, flow) as st:
        td = await Tenant.create(a, st, "tenant-default", d_tokens, service_tier="default")
        tf = await Tenant.create(a, st, "tenant-flex", f_tokens, service_tier="flex")
        async with td, tf:
            served = {"default": td.tier, "flex": tf.tier}
            alone0 = time.perf_counter()
            alone1 = alone0 + min(ALONE_S, a.duration)
            await asyncio.gather(*(td.loop(alone1) for _ in range(d_conc)))
            async with tf.streams(f_conc, eng):
                await asyncio.sleep(_warm(a, _ramp(eng, f_tokens)))
                before = await worker_flow(st)
                w0 = time.perf_counter()
                w1 = w0 + a.duration
                await asyncio.gather(*(td.loop(w1) for _ in range(d_conc)))
                after = await worker_flow(st)
            flex_done = [t for t in tf.done if t.r.ok and w0 <= t.t1 <= w1]
    return {
        "served_tier": served,
        "default_alone_ttft_ms": td.ttft_ms(alone0, alone1),
        "default_alone_requests": len(td.sent(alone0, alone1)),
        "default_flood_ttft_ms": td.ttft_ms(w0, w1),
        "default_flood_requests": len(td.sent(w0, w1)),
        # In the worker's queue, for a slot (flow control on): the scheduler's part of the
        # TTFT under the flood; the rest is the engine's prefill and the stack's hops.
        "default_flood_slot_wait_ms": _mean_wait_ms(before, after, "default"),
        "flex_flood_slot_wait_ms": _mean_wait_ms(before, after, "flex"),
        "worker_flow": after,
        "flex_completed": len(flex_done),
        "flex_completed_tokens_per_s": _rate(sum(t.r.tokens for t in flex_done), w1 - w0),
        "flex_ttft_ms": tf.ttft_ms(w0, w1),
        "window_s": round(w1 - w0, 3),
        "errors": {"default": td.errors(), "flex": tf.errors()},
        "settings": {
            "engine": vars(eng),
            "default": {"concurrency": d_conc, "max_tokens": d_tokens},
            "flex": {"concurrency": f_conc, "max_tokens": f_tokens},
        },
    }


OVERLOAD_DEADLINE_S = 10.0


def _rss_all(pids: dict[str, int]) -> dict[str, float]:
    return {n: round(v, 1) for n, p in pids.items() if (v := rss_mb(p)) is not None}


async def overload(a: argparse.Namespace, flow: str) -> dict[str, Any]:
    """Requests at three times what the replica serves, each with a deadline."""
    eng = _engine(a, max_running=8, max_concurrency=256)
    tokens, factor, deadline = 64, 3.0, OVERLOAD_DEADLINE_S
    capacity = eng.max_running / eng.answer_s(tokens)  # requests/s
    rate = factor * capacity
    env = {"TOKENBUS_BRIDGE__REQUEST_TIMEOUT_S": str(deadline)}
    async with stack(a, eng, flow, env) as st:
        t = await Tenant.create(a, st, "tenant-load", tokens)
        # Past its deadline the stack must have answered: the client waits a little longer.
        t.timeout = deadline + 5.0
        rss: dict[str, dict[str, float]] = {"start": _rss_all(st.pids)}
        async with t:
            w0 = time.perf_counter()
            n = int(a.duration * rate)
            tasks = []
            for i in range(n):
                await _until(w0 + i / rate)
                tasks.append(asyncio.ensure_future(t.one()))
                if i == n // 3:
                    rss["loaded"] = _rss_all(st.pids)
            rss["end"] = _rss_all(st.pids)
            await asyncio.gather(*tasks)
            rss["after"] = _rss_all(st.pids)
            flow_stats = await worker_flow(st)
    late = [x for x in t.done if x.t1 - x.t0 > deadline + DEADLINE_SLACK_S]
    refused = {s: c for s, c in t.statuses.items() if s in (429, 503)}
    ok = [x for x in t.done if x.r.ok]
    return {
        "capacity_requests_per_s": round(capacity, 2),
        "offered_requests_per_s": round(rate, 2),
        "requests": len(t.done),
        "deadline_s": deadline,
        "by_status": {str(s): c for s, c in sorted(t.statuses.items())},
        "completed": len(ok),
        # Answers that began (200) and then failed: cut short by their deadline, say.
        "failed_after_200": sum(
            1 for x in t.done if not x.r.ok and not x.r.error.startswith("http_")
        ),
        "errors": t.errors(),
        "refusals_with_retry_after": {str(s): t.retry_after[s] for s in refused},
        "refusals": {str(s): c for s, c in refused.items()},
        "longest_s": round(max((x.t1 - x.t0 for x in t.done), default=0.0), 3),
        "past_deadline": len(late),
        "completed_ttft_ms": summary_ms([x.r.ttft_s for x in ok]),
        "completed_e2e_ms": summary_ms([x.r.e2e_s for x in ok]),
        # Whole answers' tokens from the first request sent to the last answer's end.
        "goodput_tokens_per_s": _rate(
            sum(x.r.tokens for x in ok), max((x.t1 for x in t.done), default=w0) - w0
        ),
        "rss_mb": rss,
        "worker_flow": flow_stats,
        "settings": {"engine": vars(eng), "max_tokens": tokens, "factor": factor},
    }


RUNS: dict[str, Callable[[argparse.Namespace, str], Any]] = {
    "two": two,
    "weights": weights,
    "tiers": tiers,
    "overload": overload,
}


# -- the targets ----------------------------------------------------------------------
def _check(target: str, measured: str, met: bool) -> dict[str, Any]:
    return {"target": target, "measured": measured, "met": met}


def _p50(summary: dict[str, float]) -> float:
    return summary.get("p50", math.nan)


def checks(name: str, on: dict[str, Any], off: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for scenario ``name``, from its runs with flow control on and off."""
    if name == "two":
        alone, flood = _p50(on["b_alone_ttft_ms"]), _p50(on["b_flood_ttft_ms"])
        turnover = on["settings"]["slot_turnover_ms"]
        bound = 2 * alone + turnover
        ratio = on["total_tokens_per_s"] / off["total_tokens_per_s"]
        return [
            _check(
                "B's TTFT p50 while A floods <= 2 x B alone + one slot's turnover",
                f"{flood:.1f} ms vs {bound:.1f} ms (2 x {alone:.1f} + {turnover:g}); "
                f"off: {_p50(off['b_flood_ttft_ms']):.1f} ms",
                flood <= bound,
            ),
            _check(
                "total tokens/s on >= 0.97 x off",
                f"{ratio:.3f} ({on['total_tokens_per_s']:.0f} vs {off['total_tokens_per_s']:.0f})",
                ratio >= 0.97,
            ),
        ]
    if name == "weights":
        worst = max(abs(on["share"][n] / on["expected_share"][n] - 1) for n in WEIGHTS)
        shares = ", ".join(f"{on['share'][n]:.3f}" for n in WEIGHTS)
        return [
            _check(
                "shares within 10 % of 1/7, 2/7, 4/7",
                f"{shares} (worst {100 * worst:.1f} % off); flow off: "
                + ", ".join(f"{off['share'][n]:.3f}" for n in WEIGHTS),
                worst <= 0.10,
            )
        ]
    if name == "tiers":
        alone, flood = _p50(on["default_alone_ttft_ms"]), _p50(on["default_flood_ttft_ms"])
        return [
            _check(
                "default TTFT p50 under the flex flood <= 1.2 x unloaded",
                f"{flood:.1f} ms vs 1.2 x {alone:.1f} = {1.2 * alone:.1f} ms; "
                f"off: {_p50(off['default_flood_ttft_ms']):.1f} ms",
                flood <= 1.2 * alone,
            ),
            _check(
                "flex still completes",
                f"{on['flex_completed']} flex answers in the window, errors "
                f"{on['errors']['flex'] or 0}",
                on["flex_completed"] > 0 and not on["errors"]["flex"],
            ),
        ]
    refusals = on["refusals"]
    with_ra = on["refusals_with_retry_after"]
    loaded, end = on["rss_mb"].get("loaded", {}), on["rss_mb"]["end"]
    growth = {n: round(end[n] - loaded[n], 1) for n in end if n in loaded}
    return [
        _check(
            "every 429 and 503 carries Retry-After",
            f"{with_ra} of {refusals}",
            all(with_ra.get(s, 0) == c for s, c in refusals.items()),
        ),
        _check(
            f"no request longer than its deadline (+{DEADLINE_SLACK_S:g} s)",
            f"{on['past_deadline']} past, longest {on['longest_s']} s "
            f"(deadline {on['deadline_s']:g} s); off: {off['past_deadline']} past",
            on["past_deadline"] == 0,
        ),
        _check(
            "memory flat (end vs a third in: growth <= 10 % + 2 MiB)",
            f"MiB growth {growth}",
            all(g <= 0.1 * loaded[n] + 2 for n, g in growth.items()),
        ),
    ]


# -- the report -------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        if "p50" in v:
            return f"{v['p50']:.1f}/{v['p90']:.1f}/{v['p99']:.1f}"
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items()) or "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


ROWS: dict[str, list[tuple[str, str | None]]] = {
    "two": [
        ("B TTFT alone p50/p90/p99 ms", "b_alone_ttft_ms"),
        ("B TTFT while A floods ms", "b_flood_ttft_ms"),
        ("B requests in the window", "b_flood_requests"),
        ("A tokens/s", "a_tokens_per_s"),
        ("total tokens/s", "total_tokens_per_s"),
        ("errors", "errors"),
    ],
    "weights": [
        ("tokens per tenant", "tokens"),
        ("share", "share"),
        ("expected share", "expected_share"),
        ("total tokens/s", "total_tokens_per_s"),
        ("errors", "errors"),
    ],
    "tiers": [
        ("served tier", "served_tier"),
        ("default TTFT unloaded ms", "default_alone_ttft_ms"),
        ("default TTFT under flood ms", "default_flood_ttft_ms"),
        ("default mean wait for a slot ms", "default_flood_slot_wait_ms"),
        ("flex completed", "flex_completed"),
        ("flex tokens/s (completed)", "flex_completed_tokens_per_s"),
        ("errors", "errors"),
    ],
    "overload": [
        ("offered / capacity req/s", None),
        ("answers by status", "by_status"),
        ("whole answers", "completed"),
        ("cut short after 200", "failed_after_200"),
        ("429/503 with Retry-After", "refusals_with_retry_after"),
        ("past deadline / longest s", None),
        ("completed e2e ms", "completed_e2e_ms"),
        ("goodput tokens/s", "goodput_tokens_per_s"),
    ],
}


def _cell(name: str, label: str, key: str | None, run: dict[str, Any]) -> str:
    if key is not None:
        return _fmt(run[key])
    if label.startswith("offered"):
        return f"{run['offered_requests_per_s']} / {run['capacity_requests_per_s']}"
    return f"{run['past_deadline']} / {run['longest_s']}"


def print_scenario(name: str, res: dict[str, Any]) -> None:
    print(f"\n{name}: flow control on vs off")
    print(f"  {'':<30}{'on':>36}{'off':>36}")
    for label, key in ROWS[name]:
        on, off = (_cell(name, label, key, res[f]) for f in FLOWS)
        print(f"  {label:<30}{on:>36}{off:>36}")
    for c in res["checks"]:
        print(f"  [{'met' if c['met'] else 'NOT MET'}] {c['target']}: {c['measured']}")


async def run_tenants(a: argparse.Namespace) -> int:
    """``tokenbus bench --tenants``: the scenarios asked for, each with flow control on and
    off; a table each and one JSON report."""
    names = SCENARIOS if a.tenants == "all" else (a.tenants,)
    report: dict[str, Any] = {
        **report_head("tokenbus bench --tenants"),
        "config": {"tenants": a.tenants, "duration_s": a.duration, "pipeline": PIPELINE},
        "scenarios": {},
    }
    for name in names:
        res: dict[str, Any] = {}
        for flow in FLOWS:
            _say(f"{name}: flow control {flow} ...")
            t0 = time.perf_counter()
            res[flow] = await RUNS[name](a, flow)
            res[flow]["run_s"] = round(time.perf_counter() - t0, 1)
        res["checks"] = checks(name, res["on"], res["off"])
        report["scenarios"][name] = res
        print_scenario(name, res)
    out = Path(a.out or f"bench-results/tenants-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"results: {out}")
    return 0
