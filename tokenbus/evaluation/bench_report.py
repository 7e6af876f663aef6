"""What a ``tokenbus bench`` run writes: the latency split from the telemetry records, the
run folder (``table.md``, plots), the comparison against the baseline, the printed table,
and the JSON report's head."""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from telemetry import records
from tokenbus.evaluation.bench_stats import summary_ms


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
        windows = lv.get("windows_ns") or [lv["window_ns"]]  # one a round (--rounds)
        src = "http" if lv["mode"] == "http" else "worker"
        mine = [
            r
            for r in rows
            if r["source"] == src and any(lo <= int(r["ts_ns"] or 0) <= hi for lo, hi in windows)
        ]
        for key in ("gateway_ms", "engine_ms"):
            vals = [float(r[key]) for r in mine if isinstance(r.get(key), int | float)]
            lv[key] = summary_ms([v / 1000 for v in vals]) if vals else {}
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
