"""ScaleLLM's concurrency-tiered routing vs either pool alone, on the sim backend.

    python docs/bench/tiered.py [--requests-per-client 4] [--out docs/bench]

Runs ``tokenbus bench --spawn`` four times over the same concurrency sweep (1 ... 256):

* ``high_tp``: one TP8-like replica alone (fast steps, but its tensor parallelism scales
  poorly: 50 % efficiency per extra GPU and 1.5 ms of all-reduce per step);
* ``wide``: four TP2-like replicas alone (slower steps, 90 % efficiency, 0.5 ms all-reduce);
* ``tiered``: both pools, ``pool_policy = "concurrency_tiered"`` (threshold 64);
* ``both_least_outstanding``: both pools, no tiering (a reference: the same replicas,
  spread by load only).

Every step also costs 0.5 ms per running sequence (divided by the TP speed-up), so a big
batch slows a replica down. Writes ``tiered-<config>.json`` per run, ``tiered.json`` (the
table) and ``tiered.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HIGH = "1:tp=8,pool=high_tp,tp_efficiency=0.5,tp_comm_ms=1.5,decode_ms_per_seq=0.5"
WIDE = "4:tp=2,pool=wide,tp_efficiency=0.9,tp_comm_ms=0.5,decode_ms_per_seq=0.5"
CONFIGS: dict[str, tuple[list[str], dict[str, Any] | None]] = {
    "high_tp": ([HIGH], None),
    "wide": ([WIDE], None),
    "tiered": ([HIGH, WIDE], {"pool_policy": "concurrency_tiered"}),
    "both_least_outstanding": ([HIGH, WIDE], None),
}


def run(name: str, levels: str, rpc: int, out: Path) -> dict[str, Any]:
    replicas, routing = CONFIGS[name]
    path = out / f"tiered-{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "tokenbus.cli",
        "bench",
        "--spawn",
        "--no-direct",
        "--no-progress",
        "--concurrency",
        levels,
        "--requests-per-client",
        str(rpc),
        "--out",
        str(path),
    ]
    for r in replicas:
        cmd += ["--replica", r]
    if routing:
        cmd += ["--routing", json.dumps(routing)]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, data in results.items():
        for lv in data["levels"]:
            rows.append(
                {
                    "config": name,
                    "concurrency": lv["concurrency"],
                    "errors": lv["errors"],
                    "ttft_p50_ms": round(lv["ttft_ms"].get("p50", float("nan")), 1),
                    "tbt_p50_ms": round(lv["tbt_ms"].get("p50", float("nan")), 2),
                    "e2e_p50_ms": round(lv["e2e_ms"].get("p50", float("nan")), 1),
                    "tokens_per_s": round(lv["output_tokens_per_s"], 1),
                }
            )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in CONFIGS:
        pts = sorted((r["concurrency"], r) for r in rows if r["config"] == name)
        if not pts:
            continue
        xs = [c for c, _ in pts]
        style = "-" if name != "both_least_outstanding" else ":"
        axes[0].plot(xs, [r["e2e_p50_ms"] for _, r in pts], style, marker="o", label=name)
        axes[1].plot(xs, [r["tokens_per_s"] for _, r in pts], style, marker="o", label=name)
    for ax, title in zip(axes, ("end-to-end latency p50 (ms)", "output tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend()
    fig.suptitle("concurrency_tiered vs each pool alone (sim: 1x TP8-like, 4x TP2-like)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--only", help="comma separated configs to run")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.only.split(",") if a.only else list(CONFIGS)
    results = {n: run(n, a.concurrency, a.requests_per_client, out) for n in names}
    rows = table(results)
    (out / "tiered.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(r)
    try:
        plot(rows, out / "tiered.png")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
