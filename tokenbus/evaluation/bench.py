"""``tokenbus bench``: a closed-loop concurrency sweep over HTTP (any OpenAI-compatible
endpoint) or NATS, with TTFT, TBT, end-to-end latency, tokens/s and errors, as JSON.

``--spawn`` starts its own stack (embedded nats-server, ingress, router, one sim worker, the
bridge) and the same sim engine behind a plain HTTP server, then measures both in one run,
level by level, so the gateway's cost is a ratio measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.config import BridgeSettings, Settings
from telemetry import records
from tokenbus.evaluation import peers
from tokenbus.launcher import free_port


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tbt_s: float | None = None
    tokens: int = 0
    error: str = ""
    text: str = ""  # the answer (kept for multi-turn sessions only)
    t_end: float = 0.0  # time.time() when it ended


@dataclass
class Target:
    """One thing to measure: an HTTP base URL or the NATS client."""

    name: str
    mode: str  # http | nats
    url: str
    pids: dict[str, int] = field(default_factory=dict)
    api_key: str | None = None
    login: dict[str, Any] = field(default_factory=dict)


# -- one request ------------------------------------------------------------------------------
# Marks a body of the Messages API (RequestMaker), taken off before it is sent.
MESSAGES_API = "__messages_api"

# What one SSE event's data says: (text of a token or None, the answer's output tokens or
# None, an error code or None, whether the answer is over).
Event = tuple[str | None, int | None, str | None, bool]


def _chat_event(obj: dict[str, Any]) -> Event:
    if "error" in obj:
        return None, None, str(obj["error"].get("code")), True
    usage = obj.get("usage")
    tokens = int(usage.get("completion_tokens", 0)) if usage else None
    text = "".join((ch.get("delta") or {}).get("content") or "" for ch in obj.get("choices") or ())
    return text or None, tokens, None, False


def _responses_event(obj: dict[str, Any]) -> Event:
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        return obj.get("delta") or "", None, None, False
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        resp = obj["response"]
        if kind == "response.failed":
            return None, None, str((resp.get("error") or {}).get("code")), True
        return None, int((resp.get("usage") or {}).get("output_tokens", 0)), None, True
    return None, None, None, False


def _messages_event(obj: dict[str, Any]) -> Event:
    kind = obj.get("type")
    delta = obj.get("delta") or {}
    if kind == "content_block_delta" and delta.get("type") == "text_delta":
        return delta.get("text") or "", None, None, False
    if kind == "message_delta":
        return None, int((obj.get("usage") or {}).get("output_tokens", 0)), None, False
    if kind == "error":
        return None, None, str((obj.get("error") or {}).get("type")), True
    return None, None, None, kind == "message_stop"


class _Timing:
    """A streamed answer's tokens as they come: the first's and last's times, the text."""

    def __init__(self, keep_text: bool) -> None:
        self.t0 = time.perf_counter()
        self.first = self.last = 0.0
        self.tokens = self.chunks = 0
        self.keep_text = keep_text
        self.parts: list[str] = []

    def event(self, ev: Event) -> str | None:
        """Take one event; its error, if any."""
        piece, n, error, _ = ev
        if n is not None:
            self.tokens = n
        if piece:
            if self.keep_text:
                self.parts.append(piece)
            now = time.perf_counter()
            self.first = self.first or now
            self.last = now
            self.chunks += 1
        return error

    def result(self) -> Result:
        end = time.perf_counter()
        if not self.first:
            return Result(False, error="no_tokens")
        tokens = self.tokens or self.chunks
        tbt = (self.last - self.first) / (tokens - 1) if tokens > 1 else None
        return Result(
            True,
            self.first - self.t0,
            end - self.t0,
            tbt,
            tokens,
            text="".join(self.parts),
            t_end=time.time(),
        )


async def http_request(
    session: Any, url: str, body: dict[str, Any], timeout: float, keep_text: bool = False
) -> Result:
    """One streamed request: a chat completion, a Responses request (a body with
    ``input``: a token is an ``output_text.delta`` event) or a Messages API one (marked
    :data:`MESSAGES_API`: a token is a ``text_delta``)."""
    if "input" in body:
        path, read = "/responses", _responses_event
    elif body.get(MESSAGES_API):
        path, read = "/messages", _messages_event
        body = {k: v for k, v in body.items() if k != MESSAGES_API}
    else:
        path, read = "/chat/completions", _chat_event
    timing = _Timing(keep_text)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    return Result(False, error=f"http_{resp.status}:{text[:120]}")
                async for raw in resp.content:
                    if not raw.startswith(b"data: "):
                        continue
                    payload = raw[6:].strip()
                    if payload == b"[DONE]":
                        break
                    ev = read(json.loads(payload))
                    if (error := timing.event(ev)) is not None:
                        return Result(False, error=error)
                    if ev[3]:
                        break
    except TimeoutError:
        return Result(False, error="timeout")
    except Exception as exc:
        return Result(False, error=type(exc).__name__)
    return timing.result()


async def nats_request(
    client: Any,
    body: dict[str, Any],
    timeout: float,
    api_key: str | None = None,
    keep_text: bool = False,
) -> Result:
    from bus_schemas.errors import TokenbusError

    if "input" in body or body.get(MESSAGES_API):
        return await nats_events_request(client, body, timeout, api_key, keep_text)
    t0 = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    stream = client.submit("chat", body, timeout=timeout, api_key=api_key)
    try:
        async for ch in stream:
            if keep_text:
                parts.append(ch.text)
            now = time.perf_counter()
            if not first:
                first = now
            last = now
    except TokenbusError as exc:
        return Result(False, error=exc.code)
    finally:
        await stream.aclose()
    end = time.perf_counter()
    if not first:
        return Result(False, error="no_tokens")
    tokens = stream.usage.completion_tokens if stream.usage else 0
    tbt = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(True, first - t0, end - t0, tbt, tokens, text="".join(parts), t_end=time.time())


async def nats_events_request(
    client: Any,
    body: dict[str, Any],
    timeout: float,
    api_key: str | None = None,
    keep_text: bool = False,
) -> Result:
    """One Responses (``Client.responses``) or Messages API (``Client.messages``) request
    over NATS: the same events as over HTTP."""
    from bus_schemas.errors import TokenbusError

    timing = _Timing(keep_text)
    given = "input" if "input" in body else "messages"
    params = {k: v for k, v in body.items() if k not in ("model", given, "stream", MESSAGES_API)}
    call, read = (
        (client.responses, _responses_event)
        if given == "input"
        else (client.messages, _messages_event)
    )
    try:
        events = call(body["model"], body[given], timeout=timeout, api_key=api_key, **params)
        async for ev in events:
            if (error := timing.event(read(ev))) is not None:
                return Result(False, error=error)
    except TokenbusError as exc:
        return Result(False, error=exc.code)
    return timing.result()


# -- a level ----------------------------------------------------------------------------------
def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def _summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    if not ms:
        return {}
    return {
        "mean": round(statistics.fmean(ms), 3),
        "p50": round(_pct(ms, 50), 3),
        "p90": round(_pct(ms, 90), 3),
        "p99": round(_pct(ms, 99), 3),
        "max": round(max(ms), 3),
    }


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


_WORDS = [
    "engine", "batch", "token", "latency", "request", "replica", "router", "stream", "queue",
    "cache", "prefix", "model", "gateway", "throughput", "schedule", "sequence", "decode",
    "prefill", "tensor", "parallel", "memory",
]  # fmt: skip


class RequestMaker:
    """Request bodies for a run: a fixed prompt, prompts from a file in turn, or generated
    prompts of a sampled length; output length fixed or sampled."""

    def __init__(self, a: argparse.Namespace) -> None:
        import random

        self.a = a
        self.rng = random.Random(getattr(a, "seed", 0))
        self.items: list[dict[str, Any]] = []
        if getattr(a, "prompts", None):
            self.items = load_prompts(a.prompts)
        self.i = 0
        self.extra = extra_body(getattr(a, "extra_body", None))
        self._sized = ""

    def _messages(self) -> list[dict[str, Any]]:
        a = self.a
        size = getattr(a, "prompt_bytes_now", 0)
        if size:  # the prompt-size axis: words up to exactly ``size`` bytes, made once
            if len(self._sized) != size:
                words = " ".join(self.rng.choice(_WORDS) for _ in range(size // 4 + 1))
                self._sized = words[:size]
            return [{"role": "user", "content": self._sized}]
        if self.items:
            item = self.items[self.i % len(self.items)]
            self.i += 1
            if "messages" in item:
                return list(item["messages"])
            return [{"role": "user", "content": str(item["prompt"])}]
        if getattr(a, "prompt_words", None):
            mean, _, std = str(a.prompt_words).partition(":")
            n = max(1, round(self.rng.gauss(float(mean), float(std or 0))))
            words = " ".join(self.rng.choice(_WORDS) for _ in range(n))
            return [{"role": "user", "content": words}]
        return [{"role": "user", "content": a.prompt}]

    def next(self) -> dict[str, Any]:
        a = self.a
        max_tokens = a.max_tokens
        if getattr(a, "max_tokens_std", 0):
            max_tokens = max(1, round(self.rng.gauss(a.max_tokens, a.max_tokens_std)))
        # Every answer runs to its length (vLLM's ignore_eos, which the sim honours too), so
        # a level's tokens are what it asked for; --extra-body '{"ignore_eos": false}' lets
        # answers end on their own.
        fixed = {"ignore_eos": True}
        if getattr(a, "api", "chat") == "messages":
            return {
                **fixed,
                **self.extra,
                MESSAGES_API: True,
                "model": a.model,
                "messages": self._messages(),
                "max_tokens": max_tokens,
                "stream": True,
            }
        if getattr(a, "api", "chat") == "responses":
            return {
                **fixed,
                **self.extra,
                "model": a.model,
                "input": self._messages(),
                "max_output_tokens": max_tokens,
                "stream": True,
            }
        return {
            **fixed,
            **self.extra,
            "model": a.model,
            "messages": self._messages(),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def extra_body(value: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object given inline or as ``@FILE``."""
    if not value:
        return {}
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return obj


def load_prompts(path: str) -> list[dict[str, Any]]:
    from services.datafiles import read_lines

    items: list[dict[str, Any]] = []
    try:
        for n, row in read_lines(path):
            if isinstance(row, str):
                items.append({"prompt": row})
            elif isinstance(row.get("messages"), list) or isinstance(row.get("prompt"), str):
                items.append(row)
            else:
                raise SystemExit(f'{path}:{n}: needs "prompt" or "messages"')
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if not items:
        raise SystemExit(f"{path}: no prompts")
    return items


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
                v = _rss_mb(pid)
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
    cpu0 = {n: _cpu_s(p) for n, p in target.pids.items()}
    cpu0["bench-client"] = _cpu_s(os.getpid())
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
            before, after = cpu0.get(n), _cpu_s(p)
            if before is not None and after is not None and wall:
                cpu[n] = round(100 * (after - before) / wall, 1)
                cpu_s[n] = after - before
        if session is not None:
            await session.close()
        if client is not None:
            await client.close()
    if progress:
        sys.stderr.write("\n")
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    first_error = next((r.error for r in results if not r.ok), None)
    tokens = sum(r.tokens for r in ok)
    return {
        "target": target.name,
        "mode": target.mode,
        "concurrency": conc,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "first_error": first_error,
        "duration_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "requests_per_s": round(len(ok) / wall, 2) if wall else 0.0,
        "ttft_ms": _summary_ms([r.ttft_s for r in ok]),
        "tbt_ms": _summary_ms([r.tbt_s for r in ok if r.tbt_s is not None]),
        "e2e_ms": _summary_ms([r.e2e_s for r in ok]),
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
        "response_ms": _summary_ms([r.e2e_s for r in ok]),
        "ttft_ms": _summary_ms([r.ttft_s for r in ok]),
        "sessions_per_s": round(sessions_done / wall, 3) if wall else 0.0,
        "bucket_s": a.bucket,
        "tokens_per_bucket": [buckets.get(k, 0) for k in range(max(buckets, default=-1) + 1)],
    }


# -- the latency split and the run folder ------------------------------------------------------
def add_latency_split(levels: list[dict[str, Any]], db: str) -> None:
    """Per level of a spawned stack: the gateway's and the engine's share of the time to
    first token, from the telemetry records of the level's requests."""
    from telemetry.store import RecordStore

    if not Path(db).exists():
        return
    store = RecordStore(db)
    try:
        rows = list(store.rows())
    finally:
        store.close()
    for lv in levels:
        if lv["target"] == "direct":
            continue
        lo, hi = lv["window_ns"]
        src = "http" if lv["mode"] == "http" else "worker"
        mine = [r for r in rows if lo <= int(r["ts_ns"] or 0) <= hi and r["source"] == src]
        for key in ("gateway_ms", "engine_ms"):
            vals = [float(r[key]) for r in mine if isinstance(r.get(key), int | float)]
            lv[key] = _summary_ms([v / 1000 for v in vals]) if vals else {}
        split = path_split([r["t"] for r in mine if isinstance(r.get("t"), dict)])
        if split:
            lv["path_ms"] = split


# The marks of a request's record on its way to the first token: the bridge's t1, the marks
# the request collects on the bus, then the first token's way back.
PATH_MARKS = ("t1", *records.PATH, "first_token", "t4", "t5")


def path_split(timings: list[dict[str, int]]) -> dict[str, float]:
    """Where the time to the first token goes, hop by hop: the median, over requests, of the
    time between each mark and the next one in time (``route->engine_start``: from the route
    stage's mark to the engine's start), in ms. Marks are taken in time order, since the path
    differs by entry (over HTTP the bridge admits the request before its caller sends it)."""
    gaps: dict[str, list[float]] = {}
    for t in timings:
        seen = sorted(
            ((t[n], i, n) for i, n in enumerate(PATH_MARKS) if isinstance(t.get(n), int)),
        )
        for (a, _, na), (b, _, nb) in itertools.pairwise(seen):
            gaps.setdefault(f"{na}->{nb}", []).append((b - a) / 1e6)
    return {k: round(statistics.median(v), 3) for k, v in gaps.items()}


def write_run_files(levels: list[dict[str, Any]], run_dir: Path) -> None:
    """The run as a table like ScaleLLM's Table 1 (``table.md``) and, with matplotlib,
    latency and throughput against concurrency (``latency.png``, ``throughput.png``)."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def g(lv: dict[str, Any], key: str, p: str = "p50") -> str:
        v = (lv.get(key) or {}).get(p)
        return "" if v is None else f"{v:.1f}"

    sized = any(lv.get("prompt_bytes") for lv in levels)  # the prompt-size axis
    x = "prompt_bytes" if sized else "concurrency"
    lines = [
        f"| target | {'prompt bytes | ' if sized else ''}c | requests | errors | TTFT p50 "
        "| TTFT p99 | TBT p50 | e2e p50 | e2e p99 | tok/s | gateway p50 | engine p50 |"
        + (" peak MB by process |" if sized else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if sized else ""),
    ]
    for lv in levels:
        mem = ", ".join(f"{n} {v:.0f}" for n, v in sorted((lv.get("peak_rss_mb") or {}).items()))
        lines.append(
            f"| {lv['target']} | {str(lv.get('prompt_bytes')) + ' | ' if sized else ''}"
            f"{lv['concurrency']} | {lv['requests']} | {lv['errors']} | "
            f"{g(lv, 'ttft_ms')} | {g(lv, 'ttft_ms', 'p99')} | {g(lv, 'tbt_ms')} | "
            f"{g(lv, 'e2e_ms')} | {g(lv, 'e2e_ms', 'p99')} | {lv['output_tokens_per_s']:.0f} | "
            f"{g(lv, 'gateway_ms')} | {g(lv, 'engine_ms')} |" + (f" {mem} |" if sized else "")
        )
    (run_dir / "table.md").write_text("\n".join(lines) + "\n\n(times in ms)\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(dict.fromkeys(lv["target"] for lv in levels))
    for fname, key, label in (
        ("latency.png", "e2e_ms", "end-to-end p50 (ms)"),
        ("throughput.png", "output_tokens_per_s", "output tokens/s"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in names:
            pts = sorted(((lv[x], lv) for lv in levels if lv["target"] == n), key=lambda p: p[0])
            ys: list[float] = [
                float(
                    lv[key]
                    if key == "output_tokens_per_s"
                    else (lv[key] or {}).get("p50", float("nan"))
                )
                for _, lv in pts
            ]
            ax.plot([c for c, _ in pts], ys, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt bytes" if sized else "concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / fname, dpi=100)
        plt.close(fig)


# -- spawned stack ----------------------------------------------------------------------------
async def _wait_http(url: str, timeout: float = 30.0) -> None:
    from tokenbus.launcher import wait_ready

    if not await wait_ready(url, timeout):
        raise RuntimeError(f"{url} did not become ready")


async def _wait_replicas(
    url: str, n: int, timeout: float = 30.0, login: dict[str, str] | None = None
) -> None:
    """Until ``n`` replicas have sent heartbeats (and the routers heard them: two beats)."""
    import nats as nats_mod

    from bus_schemas import codec, subjects

    seen: dict[str, int] = {}
    nc = await nats_mod.connect(url, **(login or {}))
    try:

        async def on_beat(msg: Any) -> None:
            rid = str(codec.decode_map(msg.data).get("replica", ""))
            seen[rid] = seen.get(rid, 0) + 1

        await nc.subscribe(subjects.heartbeat_wildcard(), cb=on_beat)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(seen) >= n and all(v >= 2 for v in seen.values()):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"only {len(seen)} of {n} replicas came up")
    finally:
        await nc.drain()


async def _bench_key(
    url: str, login: dict[str, str] | None = None, name: str = "bench", **fields: Any
) -> str:
    """A key whose limits are far above what a run can use, so every stage does its work;
    ``fields`` are more of its settings (a weight, a service tier)."""
    import nats

    from auth.store import KeyStore

    nc = await nats.connect(url, **(login or {}))
    try:
        store = await KeyStore(nc).open(watch=False)
        limits: dict[str, Any] = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}
        key, _ = await store.create(name, **{**limits, **fields})
    finally:
        await nc.drain()
    return key


async def spawn_stack(a: argparse.Namespace, sup: Any) -> tuple[list[Target], Any]:
    from tokenbus.launcher import nats_server_binary

    nats_port, bridge_port, direct_port = free_port(), free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="tokenbus-bench-")
    from services.natsconf import generate, jetstream_block

    # The sync policy a deployment runs (services.config.NATS_SYNC), or --nats-sync's.
    sync = getattr(a, "nats_sync", None) or Settings().nats_sync
    js_conf = Path(tmp) / "js.conf"
    js_conf.write_text(jetstream_block(tmp, sync))
    server_args = ["-c", str(js_conf), "-a", "127.0.0.1", "-p", str(nats_port)]
    users: Path | None = None
    stages = [s for s in a.pipeline.split(",") if s and s != "route"]
    if getattr(a, "locked", False):
        conf, users = generate(
            Path(tmp) / "locked",
            port=nats_port,
            store_dir=tmp,
            callout="auth" in stages,
            sync=sync,
        )
        server_args = ["-c", str(conf)]
    nats = await asyncio.create_subprocess_exec(
        nats_server_binary(),
        *server_args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        ports = (nats_port, bridge_port, direct_port)
        return await _spawn_on(a, sup, nats, ports, tmp, users, stages)
    except BaseException:
        # Stopped while it started (Ctrl-C during a vLLM start, a peer that never came
        # up): the supervisor's children are stopped by the caller, the server here.
        await stop_nats(nats)
        raise


async def stop_nats(nats: Any) -> None:
    """Stop the run's nats-server, if it still runs."""
    if nats is not None and nats.returncode is None:
        nats.terminate()
        with contextlib.suppress(Exception):
            await nats.wait()


async def _spawn_on(
    a: argparse.Namespace,
    sup: Any,
    nats: Any,
    ports: tuple[int, int, int],
    tmp: str,
    users: Path | None,
    stages: list[str],
) -> tuple[list[Target], Any]:
    """The rest of :func:`spawn_stack`, once its nats-server is started: the stack's
    processes, the engine server and the peers (``ports``: nats, bridge, engine server)."""
    from services.natsconf import role_login
    from tokenbus.launcher import Child, as_role, bridge_children, cli_argv, port_open

    nats_port, bridge_port, direct_port = ports
    for _ in range(100):
        if port_open("127.0.0.1", nats_port):
            break
        await asyncio.sleep(0.05)
    url = f"nats://127.0.0.1:{nats_port}"
    env = {
        "TOKENBUS_NATS_URL": url,
        "TOKENBUS_LOG_LEVEL": "warning",
        "TOKENBUS_INGRESS__PIPELINE": json.dumps(a.pipeline.split(",")),
    }
    sim = [
        "--model",
        a.model,
        "--sim-prefill-ms",
        str(a.sim_prefill_ms),
        "--sim-decode-ms",
        str(a.sim_decode_ms),
        "--sim-max-running",
        str(a.sim_max_running),
        "--max-concurrency",
        str(a.sim_max_running),
    ]

    if a.routing:
        env["TOKENBUS_ROUTER"] = a.routing
    elif getattr(a, "budget_usd", None):
        # Spend on the request path: the model priced, every request reserved and settled.
        env["TOKENBUS_ROUTER__PRICE"] = json.dumps({"input": 1.0, "output": 2.0})
    env["TOKENBUS_TELEMETRY__ENABLED"] = "true" if a.telemetry == "on" else "false"
    if getattr(a, "prompt_bytes", None):  # the prompt-size axis: a context that takes them
        env["TOKENBUS_WORKER__SIM__MAX_MODEL_LEN"] = str(10**9)
    if a.telemetry == "on":
        a.telemetry_db = str(Path(tmp) / "telemetry.db")
        tel_env = {
            **env,
            "TOKENBUS_TELEMETRY__DB_PATH": a.telemetry_db,
            "TOKENBUS_TELEMETRY__METRICS_PORT": "0",
        }
        await sup.add(
            Child("telemetry", cli_argv("serve", "telemetry"), as_role(tel_env, users, "telemetry"))
        )
    for name in ["ingress", *stages, "router"]:
        await sup.add(Child(name, cli_argv("serve", name), as_role(env, users, name)))
    login = role_login(users, "admin") if users is not None else {}
    budget = {"budget_usd": a.budget_usd} if getattr(a, "budget_usd", None) else {}
    key = await _bench_key(url, login, **budget) if "auth" in stages else None
    engine = f"http://127.0.0.1:{direct_port}"
    # The workers' engine: the direct server over HTTP (as a peer reaches it), or in-process.
    backend = (
        [
            *("--backend", "openai", "--model", a.model, "--upstream-url", f"{engine}/v1"),
            *("--max-concurrency", str(a.sim_max_running)),
        ]
        if a.upstream
        else sim
    )
    direct = (cli_argv("serve", "openai-http", "--port", str(direct_port), *sim), env)
    worker_env = dict(env)
    if a.sim_decode_ms_per_seq:
        worker_env["TOKENBUS_WORKER__SIM__DECODE_MS_PER_SEQ"] = str(a.sim_decode_ms_per_seq)
    ready_s = 30.0
    ready = f"{engine}/ready"  # the engine server's readiness
    if a.engine == "vllm-scripted":
        from tokenbus.evaluation import vllm_scripted

        vs = vllm_scripted.prepare(a, Path(tmp), direct_port)
        direct = (vs.direct_argv, vs.direct_env)
        if not a.upstream:
            backend = vs.worker_args
        worker_env |= vs.worker_env
        ready_s = 300.0  # vLLM's start: its imports, the renderer's warm-up
        ready = f"{engine}/health"  # vllm serve's
    if not a.no_direct:
        await sup.add(Child("direct", direct[0], {**worker_env, **direct[1]}))
    if a.upstream:
        await _wait_http(ready, ready_s)
    for i, (extra_args, extra_env) in enumerate(replica_specs(a.replica)):
        await sup.add(
            Child(
                f"worker-{i}",
                cli_argv("serve", "worker", "--replica", f"bench-{i}", *backend, *extra_args),
                as_role({**worker_env, **extra_env}, users, "worker"),
            )
        )
    bridges = BridgeSettings(port=bridge_port, processes=a.bridge_processes)
    bridge_env = as_role(env, users, "bridge")
    for child in bridge_children(bridges, bridge_env):
        await sup.add(child)
    launches = []
    for spec in a.peer:
        name, binary = peers.parse(spec)
        launch = peers.launch(name, binary, engine, a.model, free_port(), Path(tmp), free_port())
        for companion, argv in launch.companions:
            await sup.add(Child(companion, argv, {}))
        await sup.add(Child(name, launch.argv, {}))
        launches.append(launch)
    await _wait_http(f"http://127.0.0.1:{bridge_port}/ready")
    await _wait_replicas(url, len(replica_specs(a.replica)), timeout=ready_s, login=login)
    if not a.no_direct:
        await _wait_http(ready, ready_s)
    for launch in launches:
        await _wait_http(launch.ready_url, timeout=max(120.0, ready_s))
    pids = {c.name: c.proc.pid for c in sup.children if c.proc is not None}
    others = {"direct", *(p.name for p in launches)}
    others |= {c for p in launches for c, _ in p.companions}
    # Every tokenbus process, its nats-server included.
    stack_pids = {k: v for k, v in pids.items() if k not in others} | {"nats-server": nats.pid}
    targets = [
        Target(
            "tokenbus-http", "http", f"http://127.0.0.1:{bridge_port}/v1", stack_pids, api_key=key
        )
    ]
    if a.nats_too:
        # On the locked bus a NATS client logs in with the run's key (auth callout), or as
        # the client role when keys are off.
        client_login: dict[str, Any] = {}
        if users is not None and key:
            client_login = {"api_key": key}
        elif users is not None:
            client_login = role_login(users, "client")
        targets.append(
            Target("tokenbus-nats", "nats", url, stack_pids, api_key=key, login=client_login)
        )
    for launch in launches:
        peer_pids = {n: pids[n] for n in (launch.name, *(c for c, _ in launch.companions))}
        if a.engine != "sim" and not a.no_direct:
            # vLLM's front end is in the engine server: Python every path pays, counted in each.
            peer_pids["direct"] = pids["direct"]
        targets.append(Target(launch.name, "http", launch.base_url, peer_pids, launch.api_key))
    if not a.no_direct:
        targets.append(
            Target(
                "direct", "http", f"http://127.0.0.1:{direct_port}/v1", {"direct": pids["direct"]}
            )
        )
    return targets, nats


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in this process' environment while children start (they inherit it):
    settings :func:`spawn_stack` has no flag for."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.asynccontextmanager
async def spawned(
    a: argparse.Namespace, env: dict[str, str] | None = None, logs: str = "tokenbus-bench-logs-"
) -> AsyncIterator[tuple[list[Target], Any]]:
    """:func:`spawn_stack` under a supervisor of its own, ``env`` in the environment its
    children start with: (targets, supervisor). Every child is stopped on the way out, and
    after a start that failed, whose logs are named."""
    from tokenbus.launcher import Supervisor

    sup = Supervisor(Path(tempfile.mkdtemp(prefix=logs)), echo=False)
    with environ(env or {}):
        try:
            targets, nats = await spawn_stack(a, sup)
        except BaseException:
            await sup.stop(10)
            print(f"logs: {sup.log_dir}", file=sys.stderr)
            raise
    try:
        yield targets, sup
    finally:
        await sup.stop(10)
        await stop_nats(nats)


_REPLICA_FLAGS = {
    "tp": "--tp",
    "pool": "--pool",
    "max_running": "--sim-max-running",
    "max_concurrency": "--max-concurrency",
    "role": "--pd-role",
}
_REPLICA_SIM = ("decode_ms_per_seq", "tp_efficiency", "tp_comm_ms")


def replica_specs(specs: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """``N:key=value,...`` -> per worker (extra flags, extra env); one plain worker if none."""
    if not specs:
        return [([], {})]
    out: list[tuple[list[str], dict[str, str]]] = []
    for spec in specs:
        count, _, rest = spec.partition(":")
        if not count.strip().isdigit() or int(count) < 1:
            raise SystemExit(f"--replica wants N:KEY=VALUE,..., got {spec!r}")
        flags: list[str] = []
        env: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            k, sep, v = pair.partition("=")
            if not sep:
                raise SystemExit(f"--replica: {pair!r} is not KEY=VALUE")
            if k in _REPLICA_FLAGS:
                flags += [_REPLICA_FLAGS[k], v]
            elif k in _REPLICA_SIM:
                env[f"TOKENBUS_WORKER__SIM__{k.upper()}"] = v
            elif k == "flow":
                if v not in ("on", "off"):
                    raise SystemExit(f"--replica: flow is on or off, got {v!r}")
                env["TOKENBUS_WORKER__FLOW__ENABLED"] = "true" if v == "on" else "false"
            else:
                raise SystemExit(f"--replica: unknown key {k!r}")
        out += [(flags, env)] * int(count)
    return out


def prompt_sizes(a: argparse.Namespace) -> list[int]:
    """The sizes of ``--prompt-bytes``, or none."""
    raw = getattr(a, "prompt_bytes", None) or ""
    return [int(x) for x in str(raw).split(",") if x.strip()]


def compare(levels: list[dict[str, Any]], name: str, base: str) -> list[dict[str, Any]]:
    """Per concurrency (and prompt size, on that axis): added TTFT (p50, p99) and the
    tokens/s ratio of ``name`` vs ``base``."""
    out = []
    by = {(lv["target"], lv["concurrency"], lv.get("prompt_bytes", 0)): lv for lv in levels}
    for (t, c, size), lv in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if t != name or (base, c, size) not in by:
            continue
        b = by[(base, c, size)]
        row: dict[str, Any] = {
            "concurrency": c,
            **({"prompt_bytes": size} if size else {}),
            "target": name,
            "baseline": base,
            "errors": lv["errors"],
            "baseline_errors": b["errors"],
        }
        if lv["ttft_ms"] and b["ttft_ms"]:
            row["added_ttft_p50_ms"] = round(lv["ttft_ms"]["p50"] - b["ttft_ms"]["p50"], 3)
            row["added_ttft_p99_ms"] = round(lv["ttft_ms"]["p99"] - b["ttft_ms"]["p99"], 3)
        row["cpu_us_per_token"] = lv.get("cpu_us_per_token")
        if b["output_tokens_per_s"]:
            row["tokens_per_s_ratio"] = round(
                lv["output_tokens_per_s"] / b["output_tokens_per_s"], 3
            )
        out.append(row)
    return out


def print_table(levels: list[dict[str, Any]]) -> None:
    print(
        f"{'target':<15}{'conc':>6}{'reqs':>7}{'errs':>6}{'ttft p50':>10}{'ttft p99':>10}"
        f"{'tbt p50':>9}{'e2e p50':>9}{'tok/s':>10}"
    )
    for lv in levels:
        t, tb, e = lv["ttft_ms"], lv["tbt_ms"], lv["e2e_ms"]
        if lv.get("prompt_bytes"):
            mem = ", ".join(f"{n} {v:.0f} MB" for n, v in sorted(lv.get("peak_rss_mb", {}).items()))
            print(f"  prompt {lv['prompt_bytes']} bytes; peak memory: {mem or 'not sampled'}")
        print(
            f"{lv['target']:<15}{lv['concurrency']:>6}{lv['requests']:>7}{lv['errors']:>6}"
            f"{t.get('p50', float('nan')):>10.2f}{t.get('p99', float('nan')):>10.2f}"
            f"{tb.get('p50', float('nan')):>9.2f}{e.get('p50', float('nan')):>9.1f}"
            f"{lv['output_tokens_per_s']:>10.0f}"
        )


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


def write_report(report: dict[str, Any], out: str | None) -> None:
    """Print a JSON report, and write it to ``out`` (its folder made) when given."""
    text = json.dumps(report, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)


def report_head(tool: str) -> dict[str, Any]:
    """What a JSON report starts with: the tool, when it started, the machine."""
    return {
        "tool": tool,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


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
        from tokenbus.launcher import Supervisor

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
            for t in targets:
                c = levels_c[0]
                lv = await run_level(t, c, c * a.requests_per_client, a, progress)
                lv["prompt_bytes"] = size
                levels.append(lv)
        if getattr(a, "prompt_bytes", None):
            levels_c = []
        for c in levels_c:
            for t in targets:
                levels.append(await run_level(t, c, c * a.requests_per_client, a, progress))
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
