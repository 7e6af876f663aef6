"""What ``tokenbus bench`` and its scenarios measure a run with: percentiles in ms, and a
process' CPU seconds and resident memory from /proc."""

from __future__ import annotations

import os
import statistics
from pathlib import Path


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile of ``values``: the nearest-rank value (nan for none)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def summary_ms(values: list[float]) -> dict[str, float]:
    """Seconds as ms: mean, p50, p90, p99 and max (empty for none)."""
    ms = [v * 1000 for v in values]
    if not ms:
        return {}
    return {
        "mean": round(statistics.fmean(ms), 3),
        "p50": round(percentile(ms, 50), 3),
        "p90": round(percentile(ms, 90), 3),
        "p99": round(percentile(ms, 99), 3),
        "max": round(max(ms), 3),
    }


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_mb(pid: int) -> float | None:
    """A process' resident memory now, in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
