"""``tokenbus bench --batch-lines N``: a batch on the replica interactive traffic uses.

One sim worker on a stack of its own (bench's stack, as ``--tenants`` builds it: auth,
ratelimit, router, the bridge whose processes run batch lines). Three windows of
``--duration`` seconds each:

* **alone:** an interactive client keeps ``--batch-interactive`` streams of 64 tokens going
  (the ``default`` class): its TTFT and tokens/s;
* **with the batch:** the same load while a batch of N chat lines (32 tokens each, the
  ``flex`` class the runners use) runs on the same replica: the interactive TTFT and
  tokens/s again, and the batch's tokens/s (its answered lines, polled);
* **batch alone:** the interactive client stops; the batch's tokens/s on the idle replica,
  the capacity it has for itself.

The spare capacity while interactive traffic runs is the batch-alone rate less the
interactive tokens/s; the batch's share of it is what the issue's target compares (>= 80 %),
with the interactive TTFT p50/p99 within 10 % of the alone window's. The batch then runs to
its end, and its total time is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from tokenbus.evaluation.bench import _bench_key, report_head
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


def add_arguments(g: Any) -> None:
    g.add_argument(
        "--batch-lines",
        type=int,
        help="instead of the sweep: a batch of N lines on the replica an interactive load "
        "uses (docs/batches.md); --duration seconds per window",
    )
    g.add_argument(
        "--batch-interactive",
        type=int,
        default=64,
        help="--batch-lines: the interactive client's concurrent streams",
    )


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


async def run_batch_bench(a: argparse.Namespace) -> int:
    eng = _engine(a, max_running=192, max_concurrency=4096, decode_ms_per_seq=0.05)
    conc = a.batch_interactive
    # Enough lines in flight to fill what the interactive load leaves (the worker's flow
    # control holds the rest in its flex queue).
    env = {"TOKENBUS_BATCHES__CONCURRENCY": "512"}
    report: dict[str, Any] = {**report_head("tokenbus bench --batch-lines")}
    async with stack(a, eng, "on", env) as st:
        ti = await Tenant.create(a, st, "interactive", INTERACTIVE_TOKENS)
        key = await _bench_key(st.nats_url, name="batch")
        bc = BatchClient(st.url, key)
        try:
            async with ti:
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
                    await _until(b1)
                _say("batch bench: the batch alone ...")
                c0 = time.perf_counter() + 1.0
                c1 = c0 + a.duration
                await _until(c1)
                final = await bc.done()
                t_end = bc.polls[-1][0]
        finally:
            await bc.close()
    alone_tps = _rate(ti.tokens(a0, a1), a1 - a0)
    with_tps = _rate(ti.tokens(b0, b1), b1 - b0)
    batch_with = bc.tokens_per_s(b0, b1)
    batch_alone = bc.tokens_per_s(c0, c1)
    spare = max(0.0, batch_alone - with_tps)
    ttft_alone, ttft_with = ti.ttft_ms(a0, a1), ti.ttft_ms(b0, b1)
    report.update(
        {
            "config": {
                "batch_lines": a.batch_lines,
                "line_tokens": LINE_TOKENS,
                "interactive_concurrency": conc,
                "interactive_tokens": INTERACTIVE_TOKENS,
                "window_s": a.duration,
                "engine": vars(eng),
                "batch_concurrency_per_bridge": 512,
            },
            "interactive_alone": {"ttft_ms": ttft_alone, "tokens_per_s": alone_tps},
            "interactive_with_batch": {"ttft_ms": ttft_with, "tokens_per_s": with_tps},
            "batch_tokens_per_s_with_interactive": batch_with,
            "batch_tokens_per_s_alone": batch_alone,
            "spare_tokens_per_s": round(spare, 1),
            "batch_share_of_spare": round(batch_with / spare, 3) if spare else None,
            "batch": {
                "status": final["status"],
                "request_counts": final["request_counts"],
                "total_s": round(t_end - t_submit, 1),
            },
            "errors": ti.errors(),
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
        f"batch: {batch_with} tok/s beside interactive, {batch_alone} alone; spare "
        f"{round(spare, 1)}; share {report['batch_share_of_spare']}; "
        f"total {report['batch']['total_s']} s ({final['status']})"
    )
    print(f"checks: {json.dumps(report['checks'])}")
    print(f"results: {out}")
    return 0 if final["status"] == "completed" else 1
