"""``tokenbus bench --batch-lines N``: a batch on the replica interactive traffic uses.

One sim worker (a batch of 192 sequences; a decode step slows 0.05 ms per sequence in it)
on a stack of its own (bench's stack, as ``--tenants`` builds it: auth, ratelimit, router,
the bridge). That bridge takes the interactive requests and the batch API calls but runs no
batch work (``batches.run_lines = false``); a second bridge process runs the lines, the
deployment docs/batches.md describes. The worker keeps 34 % of its slots for the
``default`` class (``worker.flow.reserved``), the share the interactive load needs: batch
lines (``flex``) fill the rest. Windows of ``--duration`` seconds:

* **capacity:** ``default`` requests of the lines' shape (32 tokens) at a concurrency of the
  engine's whole batch: the tokens/s the replica gives when full;
* **alone:** an interactive client keeps ``--batch-interactive`` streams of about 64 tokens
  going (normally spread, ``--batch-interactive-std``, as a population of users' answers
  are: streams of one length that end in the same engine step all come back in the next, a
  burst no crowd of users sends): its TTFT and tokens/s;
* **with the batch:** the same load while a batch of N chat lines (32 tokens each) runs on
  the same replica: the interactive TTFT and tokens/s again, and the batch's tokens/s (its
  answered lines, polled), until the window ends or the batch does.

Spare capacity beside the interactive load is the capacity less the interactive tokens/s;
the issue's targets compare the batch's tokens/s with it (>= 80 %) and the interactive TTFT
p50/p99 with the alone window's (within 10 %). The batch then runs to its end; its total time
is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from tokenbus.evaluation.bench_report import report_head
from tokenbus.evaluation.bench_stack import bench_key
from tokenbus.evaluation.tenants import (
    Tenant,
    _engine,
    _ramp,
    _rate,
    _say,
    _until,
    _warm,
    stack,
)

LINE_TOKENS = 32
INTERACTIVE_TOKENS = 64


class BatchClient:
    """Uploads the batch, creates it and follows its answered lines."""

    def __init__(self, url: str, key: str) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        self.id = ""
        self.polls: list[tuple[float, int, str]] = []  # (perf_counter, answered, status)
        self._task: asyncio.Task[None] | None = None
        self.ended = asyncio.Event()

    async def submit(self, model: str, prompt: str, n: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": LINE_TOKENS,
            "ignore_eos": True,
        }
        url = "/v1/chat/completions"
        data = "".join(
            json.dumps({"custom_id": f"l{i}", "method": "POST", "url": url, "body": body}) + "\n"
            for i in range(n)
        )
        r = await self.http.post(
            "/files",
            files={"file": ("batch.jsonl", data.encode()), "purpose": (None, "batch")},
        )
        r.raise_for_status()
        r = await self.http.post(
            "/batches",
            json={
                "input_file_id": r.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        r.raise_for_status()
        self.id = r.json()["id"]
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            b = (await self.http.get(f"/batches/{self.id}")).json()
            c = b["request_counts"]
            self.polls.append((time.perf_counter(), c["completed"] + c["failed"], b["status"]))
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                self.ended.set()
                return
            await asyncio.sleep(0.25)

    def answered_at(self, t: float) -> float:
        """Lines answered by ``t`` (interpolated between polls)."""
        before = [p for p in self.polls if p[0] <= t]
        after = [p for p in self.polls if p[0] > t]
        if not before:
            return 0.0
        if not after:
            return float(before[-1][1])
        (t0, n0, _), (t1, n1, _) = before[-1], after[0]
        return n0 + (n1 - n0) * (t - t0) / (t1 - t0)

    def tokens_per_s(self, w0: float, w1: float) -> float:
        return _rate((self.answered_at(w1) - self.answered_at(w0)) * LINE_TOKENS, w1 - w0)

    async def done(self) -> dict[str, Any]:
        if self._task is not None:
            await self._task
        b: dict[str, Any] = (await self.http.get(f"/batches/{self.id}")).json()
        return b

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.http.aclose()


RESERVED = 0.34  # of the 192 slots, kept for default: 65, the interactive load's 64 and one


async def start_runner(nats_url: str, port: int, lines: int) -> asyncio.subprocess.Process:
    """A bridge process that runs batch lines (and takes no interactive traffic)."""
    from tokenbus.evaluation.bench_stack import wait_http
    from tokenbus.evaluation.tenants import PIPELINE
    from tokenbus.launcher import cli_argv

    env = {
        **os.environ,
        "TOKENBUS_NATS_URL": nats_url,
        "TOKENBUS_LOG_LEVEL": "warning",
        "TOKENBUS_INGRESS__PIPELINE": json.dumps(PIPELINE.split(",")),
        "TOKENBUS_TELEMETRY__ENABLED": "false",
        "TOKENBUS_BATCHES__CONCURRENCY": str(lines),
    }
    proc = await asyncio.create_subprocess_exec(
        *cli_argv("serve", "bridge", "--port", str(port)),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await wait_http(f"http://127.0.0.1:{port}/ready", 60)
    return proc


async def run_batch_bench(a: argparse.Namespace) -> int:
    from tokenbus.launcher import free_port

    eng = _engine(a, max_running=192, max_concurrency=4096, decode_ms_per_seq=0.05)
    conc = a.batch_interactive
    env = {
        "TOKENBUS_BATCHES__RUN_LINES": "false",
        "TOKENBUS_WORKER__FLOW__RESERVED": json.dumps({"default": RESERVED}),
    }
    report: dict[str, Any] = {**report_head("tokenbus bench --batch-lines")}
    async with stack(a, eng, "on", env) as st:
        runner = await start_runner(st.nats_url, free_port(), a.batch_runner_lines)
        tc = await Tenant.create(a, st, "capacity", LINE_TOKENS)
        ti = await Tenant.create(
            a, st, "interactive", INTERACTIVE_TOKENS, max_tokens_std=a.batch_interactive_std
        )
        key = await bench_key(st.nats_url, name="batch")
        bc = BatchClient(st.url, key)
        try:
            async with tc, ti:
                _say(f"batch bench: capacity, c = {eng.max_running} ...")
                async with tc.streams(eng.max_running, eng):
                    await asyncio.sleep(_warm(a, _ramp(eng, LINE_TOKENS)))
                    k0 = time.perf_counter()
                    k1 = k0 + a.duration
                    await _until(k1)
                await asyncio.sleep(2.0)
                _say(f"batch bench: interactive alone, c = {conc} ...")
                async with ti.streams(conc, eng):
                    await asyncio.sleep(_warm(a, _ramp(eng, INTERACTIVE_TOKENS)))
                    a0 = time.perf_counter()
                    a1 = a0 + a.duration
                    await _until(a1)
                    _say(f"batch bench: + a batch of {a.batch_lines} lines ...")
                    t_submit = time.perf_counter()
                    await bc.submit(a.model, a.prompt, a.batch_lines)
                    await asyncio.sleep(3.0)  # validation, the first lines in
                    b0 = time.perf_counter()
                    b1 = b0 + a.duration
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(bc.ended.wait(), b1 - time.perf_counter())
                    b1 = min(b1, time.perf_counter())
                final = await bc.done()
                t_end = bc.polls[-1][0]
        finally:
            await bc.close()
            runner.terminate()
            await runner.wait()
    capacity = _rate(tc.tokens(k0, k1), k1 - k0)
    alone_tps = _rate(ti.tokens(a0, a1), a1 - a0)
    with_tps = _rate(ti.tokens(b0, b1), b1 - b0)
    batch_with = bc.tokens_per_s(b0, b1)
    spare = max(0.0, capacity - with_tps)
    ttft_alone, ttft_with = ti.ttft_ms(a0, a1), ti.ttft_ms(b0, b1)
    report.update(
        {
            "config": {
                "batch_lines": a.batch_lines,
                "line_tokens": LINE_TOKENS,
                "interactive_concurrency": conc,
                "interactive_tokens": INTERACTIVE_TOKENS,
                "interactive_tokens_std": a.batch_interactive_std,
                "window_s": a.duration,
                "engine": vars(eng),
                "reserved_for_default": RESERVED,
                "runner": f"a bridge process of its own, {a.batch_runner_lines} lines at once",
            },
            "capacity_tokens_per_s": capacity,
            "interactive_alone": {"ttft_ms": ttft_alone, "tokens_per_s": alone_tps},
            "interactive_with_batch": {
                "ttft_ms": ttft_with,
                "tokens_per_s": with_tps,
                "window_s": round(b1 - b0, 2),
            },
            "batch_tokens_per_s_with_interactive": batch_with,
            "spare_tokens_per_s": round(spare, 1),
            "batch_share_of_spare": round(batch_with / spare, 3) if spare else None,
            "batch": {
                "status": final["status"],
                "request_counts": final["request_counts"],
                "total_s": round(t_end - t_submit, 1),
            },
            "errors": {"interactive": ti.errors(), "capacity": tc.errors()},
        }
    )

    def ratio(key: str) -> float | None:
        x, y = ttft_alone.get(key), ttft_with.get(key)
        return round(y / x, 3) if x and y else None

    report["checks"] = {
        "ttft_p50_with_over_alone": ratio("p50"),
        "ttft_p99_with_over_alone": ratio("p99"),
        "target_ttft_within_10pct": (ratio("p50") or 9) <= 1.1 and (ratio("p99") or 9) <= 1.1,
        "target_batch_uses_80pct_of_spare": (report["batch_share_of_spare"] or 0) >= 0.8,
    }
    out = Path(a.out or f"bench-results/batch-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("interactive_alone", "interactive_with_batch")}))
    print(
        f"capacity {capacity} tok/s; batch {batch_with} tok/s beside interactive "
        f"{with_tps}; spare {round(spare, 1)}; share {report['batch_share_of_spare']}; "
        f"total {report['batch']['total_s']} s ({final['status']})"
    )
    print(f"checks: {json.dumps(report['checks'])}")
    print(f"results: {out}")
    return 0 if final["status"] == "completed" else 1
