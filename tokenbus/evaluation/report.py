"""``tokenbus report``: the telemetry store as a summary table and plots.

Reads the records (the SQLite file ``telemetry.db_path``, or a PostgreSQL database given as its
connection string) and writes into ``--out``:
``summary.json``, ``summary.md`` (per model: requests by outcome, TTFT / TBT / end-to-end /
gateway / engine percentiles, and the mean time in each stage) and, with matplotlib
installed (``pip install tokenbus[report]``), four PNGs: the latency breakdown stacked per
stage, TTFT and TBT percentiles over time, throughput over time, requests per replica.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from telemetry.store import PgRecordStore, RecordStore, is_dsn

# In path order: the bridge reading the request (HTTP only), the stages, the hop from the
# route stage's mark to the engine's start, the engine, and the first token's way back.
BREAKDOWN = (
    "receive",
    "ingress",
    "auth",
    "ratelimit",
    "filter",
    "route",
    "dispatch",
    "engine",
    "relay",
)


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))], 3)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {f"p{p}": pct(values, p) for p in (50, 90, 99)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[str(r.get("model") or "")].append(r)
    models = {}
    for model, rs in sorted(by_model.items()):
        ok = [r for r in rs if r.get("outcome") in ("ok", "length", "stop")]

        def col(key: str, rows_: list[dict[str, Any]] = ok) -> list[float]:
            return [float(r[key]) for r in rows_ if isinstance(r.get(key), int | float)]

        stage_means: dict[str, float] = {}
        for name in BREAKDOWN:
            vals = [breakdown(r).get(name, 0.0) for r in ok]
            stage_means[name] = round(sum(vals) / len(vals), 3) if vals else 0.0
        models[model] = {
            "requests": len(rs),
            "outcomes": dict(Counter(str(r.get("outcome")) for r in rs)),
            "ttft_ms": _dist(col("ttft_ms")),
            "tbt_ms": _dist(col("tbt_ms")),
            "e2e_ms": _dist(col("e2e_ms")),
            "gateway_ms": _dist(col("gateway_ms")),
            "engine_ms": _dist(col("engine_ms")),
            "completion_tokens": int(sum(col("completion_tokens", rs))),
            "migrations": int(sum(col("migrations", rs))),
            "mean_ms_by_stage": stage_means,
        }
    return {"requests": len(rows), "models": models}


def breakdown(r: dict[str, Any]) -> dict[str, float]:
    """Where one request's time to first token went, by stage (ms)."""
    out = {k: float(v) for k, v in (r.get("stages") or {}).items()}
    t = r.get("t")
    marks = {k: v for k, v in t.items() if isinstance(v, int)} if isinstance(t, dict) else {}
    # receive: from the bridge's first byte of the request to its admission (HTTP records);
    # dispatch: from the route stage's mark to the engine's start (picking a replica, the bus
    # hop, the worker's checks).
    for name, a, b in (("receive", "t1", "ingress"), ("dispatch", "route", "engine_start")):
        if a in marks and b in marks:
            out[name] = max(0, marks[b] - marks[a]) / 1e6
    if isinstance(r.get("engine_ms"), int | float):
        out["engine"] = float(r["engine_ms"])
    if isinstance(r.get("relay_ms"), int | float):
        out["relay"] = float(r["relay_ms"])
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| model | requests | outcomes | TTFT p50/p99 | TBT p50 | e2e p50/p99 | gateway p50 "
        "| engine p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, m in summary["models"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(m["outcomes"].items()))
        lines.append(
            f"| {model} | {m['requests']} | {outcomes} | {m['ttft_ms']['p50']} / "
            f"{m['ttft_ms']['p99']} ms | {m['tbt_ms']['p50']} ms | {m['e2e_ms']['p50']} / "
            f"{m['e2e_ms']['p99']} ms | {m['gateway_ms']['p50']} ms | "
            f"{m['engine_ms']['p50']} ms |"
        )
    lines += ["", "Mean time to first token by stage (ms):", ""]
    lines.append("| model | " + " | ".join(BREAKDOWN) + " |")
    lines.append("|---|" + "---|" * len(BREAKDOWN))
    for model, m in summary["models"].items():
        vals = " | ".join(str(m["mean_ms_by_stage"][k]) for k in BREAKDOWN)
        lines.append(f"| {model} | {vals} |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], out: Path, bucket_s: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    ok = [r for r in rows if r.get("outcome") in ("ok", "length", "stop") and r.get("ts_ns")]
    models = sorted({str(r.get("model")) for r in ok})
    # 1. latency breakdown, stacked per stage, per model
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(models)
    for stage in BREAKDOWN:
        vals = []
        for m in models:
            rs = [breakdown(r).get(stage, 0.0) for r in ok if r.get("model") == m]
            vals.append(sum(rs) / len(rs) if rs else 0.0)
        ax.bar(models, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("mean ms to first token")
    ax.set_title("Where the time to first token goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "latency_breakdown.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    # 2./3. percentiles and throughput over time
    t_start = min((int(r["ts_ns"]) for r in ok), default=0)
    buckets: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        buckets[int((int(r["ts_ns"]) - t_start) / 1e9 // bucket_s)].append(r)
    xs = sorted(buckets)
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, name in (("ttft_ms", "TTFT"), ("tbt_ms", "TBT")):
        for p in (50, 99):
            ys = [pct([float(r[key]) for r in buckets[x] if r.get(key) is not None], p) for x in xs]
            ys_f = [math.nan if y is None else y for y in ys]
            ax.plot([x * bucket_s for x in xs], ys_f, marker=".", label=f"{name} p{p}")
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("ms")
    ax.set_title("TTFT and TBT percentiles over time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "latency_over_time.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    tps = [sum(int(r.get("completion_tokens") or 0) for r in buckets[x]) / bucket_s for x in xs]
    ax.plot([x * bucket_s for x in xs], tps, marker=".")
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput ({bucket_s:g} s buckets)")
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    # 4. per-replica load
    per = Counter(str(r.get("replica")) for r in ok if r.get("replica"))
    fig, ax = plt.subplots(figsize=(8, 4))
    names = sorted(per)
    ax.bar(names, [per[n] for n in names])
    ax.set_ylabel("requests served")
    ax.set_title("Requests per replica")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    written.append(out / "replica_load.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def report(
    db: str | Path, out: str | Path, *, since_s: float = 0, bucket_s: float = 10.0
) -> dict[str, Any]:
    """Write the report; returns the summary (with the files written). ``db``: the SQLite
    file, or a PostgreSQL connection string (``postgresql://...``: telemetry.store =
    postgres)."""
    store: RecordStore | PgRecordStore
    if is_dsn(db):
        store = PgRecordStore(str(db))
    elif not Path(db).exists():
        raise FileNotFoundError(f"no telemetry store at {db} (is the telemetry service running?)")
    else:
        store = RecordStore(db)
    try:
        since_ns = int((time.time() - since_s) * 1e9) if since_s else 0
        rows = list(store.rows(since_ns))
    finally:
        store.close()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(rows)
    files = [out_dir / "summary.json", out_dir / "summary.md"]
    try:
        files += plots(rows, out_dir, bucket_s)
    except ImportError:
        summary["plots"] = (
            "matplotlib is not installed (.venv/bin/pip install -e '.[report]' adds it)"
        )
    summary["files"] = [str(f) for f in files]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "summary.md").write_text(markdown(summary))
    return summary
