"""``tokenbus bench --adapters N``: LoRA adapters loaded at run time (docs/adapters.md).

On a spawned stack (two replicas of the sim, or of vLLM's front end over the scripted core
with ``--engine vllm-scripted``), while ``--concurrency`` streams run on the base model and
on an adapter kept loaded, ``N`` adapters are each loaded on one replica, asked once, and
unloaded with a request still on them. Reported (JSON): per cycle the load's time and the
time from the load command to the first token of the first request on the adapter; the
requests of the load and of the cycles that failed (the target: none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import nats

from router import adapters as A
from router.service import heard
from tokenbus.evaluation.bench_report import report_head, write_report
from tokenbus.evaluation.bench_stack import spawned


def _folder(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


async def _first_token(h: httpx.AsyncClient, model: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content, tokens) of one streamed chat on ``model``; raises
    on an error answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "select the rows"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = 0.0
    tokens = 0
    async with h.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"])[:200])
            if not first and any(c["delta"].get("content") for c in event.get("choices", [])):
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if tokens != max_tokens:
        raise RuntimeError(f"{tokens} of {max_tokens} tokens")
    return first, tokens


async def run_adapter_bench(a: argparse.Namespace) -> int:
    a.no_direct = True
    a.nats_too = True
    if not a.replica:
        a.replica = ["2:"]
    if a.engine == "vllm-scripted":
        a.engine_options = {"enable_lora": True}
    conc = max(1, int(str(a.concurrency).split(",")[0]))
    report: dict[str, Any] = {**report_head("tokenbus bench --adapters"), "engine": a.engine}
    root = Path(tempfile.mkdtemp(prefix="tokenbus-adapters-"))
    async with spawned(a) as (targets, _sup):
        http = next(t for t in targets if t.mode == "http")
        bus = next(t for t in targets if t.mode == "nats")
        nc = await nats.connect(bus.url, **bus.login)
        registry = await heard(nc, 2.5)  # every replica's heartbeat (idle: every 2 s)
        keep = A.Wanted("bench-keep", a.model, _folder(root, "keep"), 1)
        await A.load(nc, registry, keep)
        failures: list[str] = []
        served = 0
        stop = asyncio.Event()

        async def client(i: int, h: httpx.AsyncClient) -> None:
            nonlocal served
            model = a.model if i % 2 else keep.name
            while not stop.is_set():
                try:
                    await _first_token(h, model, 32)
                    served += 1
                except Exception as exc:
                    failures.append(f"{model}: {exc}")

        cycles: list[dict[str, Any]] = []
        limits = httpx.Limits(max_connections=conc + 8)
        async with httpx.AsyncClient(base_url=http.url, timeout=120, limits=limits) as h:
            load = [asyncio.create_task(client(i, h)) for i in range(conc)]
            try:
                for n in range(a.adapters):
                    want = A.Wanted(f"bench-lora-{n}", a.model, _folder(root, f"a{n}"), 1)
                    t0 = time.perf_counter()
                    out = await A.load(nc, registry, want)
                    loaded = time.perf_counter() - t0
                    first, _ = await _first_token(h, want.name, 8)
                    ready = time.perf_counter() - t0
                    # One still on it while it is unloaded: drained, not cut.
                    on_it = asyncio.create_task(_first_token(h, want.name, 64))
                    await asyncio.sleep(0.2)
                    gone = await A.unload(nc, registry, want.name, drain_s=60)
                    try:
                        await on_it
                    except Exception as exc:
                        failures.append(f"{want.name} (drained): {exc}")
                    cycles.append(
                        {
                            "adapter": want.name,
                            "replica": out["loaded"][0]["replica"],
                            "load_ms": round(loaded * 1000, 1),
                            "first_token_after_load_ms": round(first * 1000, 1),
                            "load_to_first_token_ms": round(ready * 1000, 1),
                            "unload": gone["unloaded"],
                        }
                    )
            finally:
                stop.set()
                await asyncio.gather(*load, return_exceptions=True)
        with contextlib.suppress(Exception):
            await A.unload(nc, registry, keep.name, drain_s=5)
        await nc.drain()
    ready_ms = [c["load_to_first_token_ms"] for c in cycles]
    report.update(
        concurrency=conc,
        cycles=cycles,
        load_to_first_token_ms={
            "p50": round(statistics.median(ready_ms), 1) if ready_ms else None,
            "max": max(ready_ms, default=None),
        },
        requests_served=served,
        requests_failed=len(failures),
        failures=failures[:20],
    )
    write_report(report, a.out)
    return 1 if failures else 0
